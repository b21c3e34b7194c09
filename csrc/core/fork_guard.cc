// pthread_atfork counter behind fork_generation().
#include "fork_guard.h"

#include <pthread.h>

#include <atomic>

namespace braid {
namespace {

std::atomic<uint64_t> g_generation{0};

void on_fork_child() { g_generation.fetch_add(1, std::memory_order_relaxed); }

// Registered when the library loads, so that objects created before the first fork already carry
// the generation they were made in.
const int g_registered = ::pthread_atfork(nullptr, nullptr, on_fork_child);

}  // namespace

uint64_t fork_generation() noexcept {
  (void)g_registered;
  return g_generation.load(std::memory_order_relaxed);
}

}  // namespace braid
