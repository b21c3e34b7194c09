// Collectives on device memory through pinned host memory, chunk by chunk: the copy to the host of
// chunk i+1 and the copy back of chunk i-1 overlap the host collective of chunk i.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "communicator.h"

namespace braid {

// The two copy directions. Each is a stream of its own (on a GPU, a copy engine of its own), so
// that a copy to the host and a copy back run at the same time.
enum class Lane : int { kToHost = 0, kToDevice = 1 };

// What the pipeline needs from a device: asynchronous copies queued in order on two lanes, events
// recorded on a lane, and pinned host memory. The CUDA implementation (csrc/cuda/staging) queues on
// two CUDA streams; the CPU one (csrc/tests/staging_test.cc) runs each lane on a thread.
//
// Errors are thrown as std::runtime_error (or a subclass). A copy that fails after it was queued is
// reported by the next synchronize() of an event recorded after it on its lane.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // Pinned host memory of at least `bytes` and at least `events` event ids (0 .. events-1), kept
  // between calls and grown when needed. Growing first waits until both lanes are idle, so no
  // queued copy still uses the old memory.
  virtual char* prepare(size_t bytes, int events) = 0;
  // Queues a copy of `bytes` bytes on `lane`: device to host on kToHost, host to device on
  // kToDevice.
  virtual void copy(Lane lane, void* dst, const void* src, size_t bytes) = 0;
  // Records `event` on `lane`: it completes once everything queued on the lane before it has.
  virtual void record(int event, Lane lane) = 0;
  // Makes `lane` wait, without blocking the caller, until the latest record of `event` at the time
  // of the call completed (no wait when it was never recorded).
  virtual void wait(Lane lane, int event) = 0;
  // Blocks the calling thread until the latest record of `event` completed (at once when it was
  // never recorded); throws the error of a copy on its lane that failed before it.
  virtual void synchronize(int event) = 0;
  // Waits until both lanes are idle and forgets any error: after a failure, nothing queued still
  // reads or writes the buffers of the failed call once this returns.
  virtual void drain() noexcept = 0;
};

// Knobs of the pipeline (BRAID_STAGING_* environment variables).
struct StagingOptions {
  // BRAID_STAGING_CHUNK_BYTES: bytes of one part of a chunk. Large enough that a copy runs near
  // the link's bandwidth (a PCIe copy of 4 MiB is past the knee of its launch and latency cost),
  // small enough that the pipeline fills in one chunk and pinned memory stays small.
  size_t chunk_bytes = 4 * 1024 * 1024;
  // BRAID_STAGING_SLOTS: chunks in flight. Two let the copy to the host of chunk i+1 overlap the
  // collective of chunk i; a third keeps the copy back of chunk i-1 from delaying chunk i+2.
  int slots = 3;

  static StagingOptions from_env();
  // Throws std::invalid_argument naming the first knob out of its range.
  void validate() const;
};

// How a collective's device buffers split into parts: the input holds `in_parts` parts of `count`
// elements (`in_stride` elements apart), the output `out_parts` (`out_stride` apart). A chunk is
// the same element range [offset, offset + len) of every part; on the host its parts lie one
// after another. all_reduce and broadcast: one part in and out; all_gather: one in, world_size
// out; reduce_scatter: world_size in, one out; all_to_all: world_size both ways. `in_place`: the
// host collective reads and writes one buffer (all_reduce, and broadcast, which works on its
// output only), so a chunk's input and output share pinned memory.
struct StagingLayout {
  size_t elem_size = 1;
  size_t count = 0;
  int in_parts = 1;
  int out_parts = 1;
  size_t in_stride = 0;
  size_t out_stride = 0;
  bool in_place = false;
};

// The layout of `r` (device pointers in r.in / r.out) on rank `rank` of `world`; throws
// std::invalid_argument for a kind that has no staged form (point-to-point, exchanges). A
// broadcast copies nothing to the host on ranks other than its root.
StagingLayout staging_layout(const Request& r, int rank, int world);

// One chunk as the host step sees it: element range [offset, offset + len) of every part, its
// input parts at `in` and its output parts at `out` (pinned host memory, parts `len` elements
// apart).
struct StagedChunk {
  size_t index = 0;
  size_t offset = 0;
  size_t len = 0;
  const char* in = nullptr;
  char* out = nullptr;
};

// Event ids the pipeline uses: per slot, one for its copy to the host and one for its copy back.
inline int staging_event(Lane lane, int slot) { return 2 * slot + static_cast<int>(lane); }

// Runs `step` on every chunk of `layout` in order (one chunk of no elements when count is 0, so
// that every rank still runs one step): copies the chunk's input parts from the device buffer
// `in` to pinned memory, runs `step` on them once they arrived, and queues the copy back of its
// output parts into the device buffer `out`. Copies to the host run up to `slots` chunks ahead.
//
// Returns once the last copy back is queued; with `wait_copies_back`, once every copy back is done
// (and a failed one throws). Any failure (a copy, `step`) drains the engine before it is rethrown,
// so no copy of this call is still running when the caller sees the error.
void run_staged(CopyEngine& engine, const StagingLayout& layout, const void* in, void* out,
                const StagingOptions& opts, const std::function<void(const StagedChunk&)>& step,
                bool wait_copies_back = false);

// Hooks of a staged collective, run on the executing thread.
struct StagedHooks {
  std::function<void()> before;  // first (e.g. both lanes wait for the caller's stream)
  std::function<void()> after;   // once every copy back is queued (e.g. record the completion)
};

// Submits `r` (device pointers in r.in / r.out; kind, dtype, op, count, root and tag as for a host
// call) as one task of `comm`: run_staged with one host collective per chunk, in issue order with
// the communicator's other work. All ranks must use equal `opts` (each chunk is a collective of
// its own, and ranks compare their counts). A copy that fails makes this rank abort the
// communicator, so that its peers fail at once instead of at the timeout; the work fails with the
// copy's error. `keepalive` is released when the task ends. Blocking when `async` is false.
std::shared_ptr<Work> submit_staged(Communicator& comm, std::shared_ptr<CopyEngine> engine, Request r,
                                    StagingOptions opts, StagedHooks hooks, std::shared_ptr<void> keepalive,
                                    bool async);

}  // namespace braid
