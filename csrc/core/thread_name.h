// Names for braid's own threads, as `top -H`, gdb, py-spy and /proc/<pid>/task/*/comm show them:
// "braid-progress" (a communicator's progress engine), "braid-watch" (its failure and dump-signal
// watcher), "braid-accept" (the TCP transport's acceptor).
#pragma once

#include <pthread.h>

namespace braid {

// Names the calling thread (Linux keeps 15 characters).
inline void name_this_thread(const char* name) noexcept {
#if defined(__linux__)
  (void)::pthread_setname_np(::pthread_self(), name);
#else
  (void)name;
#endif
}

}  // namespace braid
