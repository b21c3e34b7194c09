// One pause in a busy-poll loop: tells the core that the thread spins (on x86 `pause`, which
// also keeps the loop from flooding the memory order machinery; on Arm `yield`).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BRAID_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define BRAID_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define BRAID_CPU_RELAX() ((void)0)
#endif
