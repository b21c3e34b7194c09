// The launch machinery of the CUDA host emulation (cuda_host.h): a block's threads as ucontext
// fibers scheduled round robin on the calling thread, with block and warp barriers.
#include "cuda_host.h"

#include <ucontext.h>

#include <memory>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace cuda_host {
namespace {

constexpr unsigned kMaxThreads = 1024;           // per block, as on every GPU since sm_20
constexpr size_t kMaxDynamicShared = 48 << 10;   // without an opt-in attribute
constexpr unsigned kMaxGrid = 0x7fffffffu;       // gridDim.x
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr size_t kFiberStack = 128 << 10;  // instrumented frames are a few times larger
#else
constexpr size_t kFiberStack = 64 << 10;   // the kernels keep their arrays in shared memory
#endif

cudaError_t g_error = cudaSuccess;
std::string g_failure;

enum class Wait { kNone, kBlock, kWarp, kDone };

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  Wait wait = Wait::kNone;
  uint64_t offered = 0;  // exchange_in_warp: this lane's value, then the value it receives
  unsigned src_lane = 0;
#if defined(__SANITIZE_THREAD__)
  void* tsan_fiber = nullptr;
#endif
};

// The block being run: its fibers, the scheduler's context and the body every thread runs.
struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  bool backwards = false;  // the order of the next scheduling pass
  const std::function<void()>* body = nullptr;
  unsigned current = 0;
  std::vector<unsigned char> shared;
  bool failed = false;
#if defined(__SANITIZE_ADDRESS__)
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
#endif
#if defined(__SANITIZE_THREAD__)
  void* tsan_scheduler = nullptr;
#endif
};

Block* g_block = nullptr;

// Fiber stacks, kept from launch to launch (a launch of 1024 threads needs 1024 of them).
char* fiber_stack(unsigned t) {
  static std::vector<std::unique_ptr<char[]>> stacks;
  while (stacks.size() <= t) stacks.emplace_back(new char[kFiberStack]);
  return stacks[t].get();
}

void fail(cudaError_t e, const std::string& why) {
  set_error(e, why);
  if (g_block != nullptr) g_block->failed = true;
}

// Fiber -> scheduler. `finished`: the fiber will not be resumed (its fake stack can go).
void yield_to_scheduler(bool finished) {
  Block& b = *g_block;
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(finished ? nullptr : &fake, b.scheduler_stack, b.scheduler_stack_size);
#endif
#if defined(__SANITIZE_THREAD__)
  __tsan_switch_to_fiber(b.tsan_scheduler, 0);
#endif
  swapcontext(&b.fibers[b.current].ctx, &b.scheduler);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  (void)finished;
}

void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &g_block->scheduler_stack, &g_block->scheduler_stack_size);
#endif
  (*g_block->body)();
  g_block->fibers[g_block->current].wait = Wait::kDone;
  yield_to_scheduler(true);
}

// Scheduler -> fiber t, until it reaches a barrier or ends.
void resume(Block& b, unsigned t) {
  b.current = t;
  threadIdx = dim3(t);
  Fiber& f = b.fibers[t];
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kFiberStack);
#endif
#if defined(__SANITIZE_THREAD__)
  __tsan_switch_to_fiber(f.tsan_fiber, 0);
#endif
  swapcontext(&b.scheduler, &f.ctx);
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// Releases the warps whose lanes all wait in exchange_in_warp (a warp some of whose lanes wait
// elsewhere or ended stays, and is reported as divergence); true if any was released.
bool release_warps(Block& b) {
  bool released = false;
  const unsigned n = static_cast<unsigned>(b.fibers.size());
  for (unsigned w = 0; w * 32 < n; ++w) {
    const unsigned lo = w * 32, hi = std::min(n, lo + 32);
    bool all = true;
    for (unsigned t = lo; t < hi; ++t) all = all && b.fibers[t].wait == Wait::kWarp;
    if (!all) continue;
    std::vector<uint64_t> offered(32);
    for (unsigned t = lo; t < hi; ++t) offered[t - lo] = b.fibers[t].offered;
    for (unsigned t = lo; t < hi; ++t) {
      Fiber& f = b.fibers[t];
      if (lo + f.src_lane >= hi) {
        fail(cudaErrorLaunchFailure, "warp shuffle from lane " + std::to_string(f.src_lane) + " of a partial warp");
        return false;
      }
      f.offered = offered[f.src_lane];
      f.wait = Wait::kNone;
    }
    released = true;
  }
  return released;
}

// A fresh start of fiber_main on the fiber's stack (its own function: getcontext returns twice,
// which must not clobber a caller's loop variables).
void prepare(Fiber& f) {
  f.wait = Wait::kNone;
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = kFiberStack;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, fiber_main, 0);
}

bool run_block(Block& b) {
  for (Fiber& f : b.fibers) prepare(f);
  const unsigned n = static_cast<unsigned>(b.fibers.size());
  for (;;) {
    // Passes alternate between ascending and descending thread order, so a kernel that reads
    // what another thread writes without a barrier between them sees it unwritten in one of them.
    for (unsigned i = 0; i < n && !b.failed; ++i) {
      const unsigned t = b.backwards ? n - 1 - i : i;
      if (b.fibers[t].wait == Wait::kNone) resume(b, t);
    }
    b.backwards = !b.backwards;
    if (b.failed) return false;
    size_t done = 0, at_block = 0;
    for (const Fiber& f : b.fibers) {
      done += f.wait == Wait::kDone;
      at_block += f.wait == Wait::kBlock;
    }
    if (done == b.fibers.size()) return true;
    if (release_warps(b)) continue;
    if (b.failed) return false;
    if (at_block == b.fibers.size()) {  // every thread reached __syncthreads
      for (Fiber& f : b.fibers) f.wait = Wait::kNone;
      continue;
    }
    // Some threads wait at a barrier that the others (ended, or waiting elsewhere) never reach:
    // undefined behaviour on a GPU, where it hangs or corrupts; a failed launch here.
    fail(cudaErrorLaunchFailure, "block " + std::to_string(blockIdx.x) + ": " + std::to_string(at_block) +
                                     " threads wait in __syncthreads, " + std::to_string(done) +
                                     " ended, the others wait in a warp shuffle");
    return false;
  }
}

}  // namespace

cudaError_t take_error() {
  const cudaError_t e = g_error;
  g_error = cudaSuccess;
  return e;
}

const std::string& last_failure() { return g_failure; }

void set_error(cudaError_t e, const std::string& why) {
  if (g_error == cudaSuccess) g_error = e;
  g_failure = why;
}

void* dynamic_shared_memory() { return g_block->shared.data(); }

void sync_block() {
  g_block->fibers[g_block->current].wait = Wait::kBlock;
  yield_to_scheduler(false);
}

uint64_t exchange_in_warp(uint64_t value, unsigned src_lane, unsigned mask) {
  Fiber& f = g_block->fibers[g_block->current];
  if (mask != 0xffffffffu || src_lane >= 32) {
    fail(cudaErrorLaunchFailure, "warp shuffle other than a full-mask 32-lane one");
    return value;
  }
  f.offered = value;
  f.src_lane = src_lane;
  f.wait = Wait::kWarp;
  yield_to_scheduler(false);
  return g_block->fibers[g_block->current].offered;
}

bool run_grid(dim3 grid, dim3 block, size_t dynamic_shared_bytes, const std::function<void()>& body) {
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    set_error(cudaErrorInvalidConfiguration, "only 1-D grids and blocks are emulated");
    return false;
  }
  if (grid.x == 0 || grid.x > kMaxGrid || block.x == 0 || block.x > kMaxThreads) {
    set_error(cudaErrorInvalidConfiguration, "grid " + std::to_string(grid.x) + " x block " +
                                                 std::to_string(block.x) + " is not a valid launch");
    return false;
  }
  if (dynamic_shared_bytes > kMaxDynamicShared) {
    set_error(cudaErrorInvalidValue, std::to_string(dynamic_shared_bytes) + " bytes of dynamic shared memory");
    return false;
  }
  Block b;
  b.body = &body;
  b.fibers.resize(block.x);
  for (unsigned t = 0; t < block.x; ++t) b.fibers[t].stack = fiber_stack(t);
  // Uninitialized on a GPU: a pattern, so a kernel that reads shared memory it never wrote
  // computes garbage here too instead of zeros that could pass.
  b.shared.assign(std::max<size_t>(dynamic_shared_bytes, 1), 0xCD);
#if defined(__SANITIZE_THREAD__)
  b.tsan_scheduler = __tsan_get_current_fiber();
  for (Fiber& f : b.fibers) f.tsan_fiber = __tsan_create_fiber(0);
#endif
  Block* outer = g_block;
  g_block = &b;
  gridDim = grid;
  blockDim = block;
  bool ok = true;
  for (unsigned i = 0; i < grid.x && ok; ++i) {
    blockIdx = dim3(i);
    ok = run_block(b);
  }
  g_block = outer;
#if defined(__SANITIZE_THREAD__)
  for (Fiber& f : b.fibers) __tsan_destroy_fiber(f.tsan_fiber);
#endif
  return ok;
}

}  // namespace cuda_host
