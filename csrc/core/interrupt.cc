// The process-wide interrupt hook.
#include "interrupt.h"

#include <atomic>

namespace braid {
namespace {
std::atomic<InterruptHook> g_hook{nullptr};
}  // namespace

void set_interrupt_hook(InterruptHook hook) noexcept { g_hook.store(hook, std::memory_order_release); }

bool interrupt_hook_installed() noexcept { return g_hook.load(std::memory_order_acquire) != nullptr; }

bool interrupt_requested() {
  InterruptHook hook = g_hook.load(std::memory_order_acquire);
  return hook != nullptr && hook();
}

}  // namespace braid
