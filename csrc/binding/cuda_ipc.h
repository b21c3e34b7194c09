// The device-to-device path for CUDA tensors between the ranks of one host (CUDA builds only): per
// communicator and device, a channel of CUDA IPC (core/ipc over cuda/ipc) set up once by all ranks
// together, or the reason it is off, in which case calls go through the staging pipeline.
#pragma once

#ifdef BRAID_WITH_CUDA

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../core/communicator.h"
#include "binding_util.h"
#include "../core/ipc/ipc_collectives.h"
#include "../cuda/ipc/cuda_ipc_engine.h"

namespace braid {

// Knobs of the IPC path (environment; every rank must read the same, since the scratch layout is
// part of the protocol: the setup checks it).
struct IpcOptions {
  // BRAID_CUDA_IPC: 0 turns the path off (calls on CUDA tensors go through pinned host memory).
  bool enabled = true;
  // BRAID_IPC_AREA_BYTES: bytes of each scratch area (a slot has two). A piece of a collective moves
  // at most one area per rank, and each piece costs one or two host steps (a few microseconds of
  // shared-memory round trip on the host), which the device must outlast for the host to stay
  // ahead: at ~3 TB/s a 16 MiB piece keeps an H100/H200 busy ~30 us. To be measured on a GPU.
  size_t area_bytes = 16u << 20;
  // BRAID_IPC_SLOTS: pieces in flight. Two let the host queue piece g+1 while the device runs g.
  int slots = 2;

  static IpcOptions from_env();
  // Throws std::invalid_argument naming the knob out of range.
  void validate() const;
};

// One device's IPC state of a communicator: the engine (scratch, events, peers opened), the stream
// every IPC call runs on (from torch's pool), and the piece sequence the schedules advance.
class CudaIpcChannel {
 public:
  CudaIpcChannel(std::unique_ptr<cuda::CudaIpcEngine> engine, c10::cuda::CUDAStream stream)
      : engine_(std::move(engine)), stream_(stream) {}
  // The peers map this rank's scratch and may still read it: only release() frees it, after
  // every rank agreed that all are done. A channel dropped otherwise (a poisoned communicator, an
  // abort) keeps its device memory until the process exits rather than free what a peer may read.
  ~CudaIpcChannel() { (void)engine_.release(); }
  CudaIpcChannel(const CudaIpcChannel&) = delete;
  CudaIpcChannel& operator=(const CudaIpcChannel&) = delete;
  // Frees the engine once every peer finished with this rank's scratch; only after a host step
  // that every rank of the host reached with all of its work queued (CudaIpcChannels::release).
  void release() {
    engine_->wait_for_peers();
    engine_.reset();
  }
  cuda::CudaIpcEngine& engine() { return *engine_; }
  const c10::cuda::CUDAStream& stream() const { return stream_; }
  IpcSequence& sequence() { return seq_; }

 private:
  std::unique_ptr<cuda::CudaIpcEngine> engine_;
  c10::cuda::CUDAStream stream_;
  IpcSequence seq_;  // only touched by the communicator's executing thread
};

// The IPC channels of one communicator, by device: made at the first call on a device's tensors,
// by all ranks together (a host step of every rank), and kept, or recorded as off with the reason.
class CudaIpcChannels {
 public:
  // The channel of `device`, set up now if this is the device's first call: null when the path is
  // off for this communicator (several hosts, BRAID_CUDA_IPC=0 on any rank, IPC refused on any
  // rank; the reason is logged once on stderr and kept in reason()). Blocks until every rank took
  // part; every rank must reach it at the same point of its sequence (its first call on CUDA
  // tensors), as with any collective.
  std::shared_ptr<CudaIpcChannel> get(Communicator& c, c10::DeviceIndex device);
  // "ipc", "staged" (with the reason after a colon), or "" before the device's first call.
  std::string path(c10::DeviceIndex device);
  // Frees every channel's device memory safely: one host step of every rank (all of whose IPC
  // work is then queued), then each channel waits until its peers are done with its scratch.
  // The communicator's close hook (set by the first channel made): runs as a task, in issue order.
  void release(Communicator& c);

 private:
  struct Entry {
    bool decided = false;
    std::shared_ptr<CudaIpcChannel> channel;
    std::string reason;
  };
  std::mutex mu_;  // guards by_device_; the setup runs under it, so a second caller waits for it
  std::map<c10::DeviceIndex, Entry> by_device_;
};

CudaIpcChannels& ipc_channels_of(Communicator& c);

// Submits `requests` (device pointers of the channel's device; all_reduce, reduce_scatter,
// all_gather, broadcast, all_to_all, barrier) as one task of `comm`, ordered after the caller's
// current stream; `used` are recordStream'ed on the channel's stream so the caching allocator keeps
// them until the stream is done; `finish` runs after the last request is queued, with the channel's
// stream as the current stream (copies into the caller's tensors). Returns the task's work (null
// when `async` is false: it then returned once everything was queued).
std::shared_ptr<Work> submit_ipc_call(Communicator& comm, CudaIpcChannel& ch, std::vector<Request> requests,
                                      std::vector<at::Tensor> used, std::function<void()> finish, bool async);

// The same for an all-to-all with split sizes: `counts.send[j]` elements of `dtype` to rank j,
// `counts.recv[j]` from rank j, each side's pieces consecutive in rank order in `in` / `out`.
std::shared_ptr<Work> submit_ipc_all_to_all_v(Communicator& comm, CudaIpcChannel& ch, DType dtype, const void* in,
                                              void* out, const SplitCounts& counts, std::vector<at::Tensor> used,
                                              std::function<void()> finish, bool async);

// Whether the IPC path runs `kind` (the rest: point-to-point, exchanges, go through staging).
bool ipc_runs(CollKind kind);

}  // namespace braid

#endif  // BRAID_WITH_CUDA
