// The IPC collectives' engine on a GPU (core/ipc/ipc_collectives.h): this rank's scratch and
// events, exported with CUDA IPC and opened by the other ranks of its host, and the stream every
// operation is queued on. Torch-free: raw pointers, cudaStream_t, cudaEvent_t.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../../core/ipc/ipc_collectives.h"

namespace braid {
namespace cuda {

class CudaIpcEngine final : public IpcEngine {
 public:
  // This rank's scratch (slots x 2 areas x area_bytes of device memory on `device`, one
  // cudaMalloc, so that one IPC handle covers it) and its interprocess events (slots x kIpcEvents,
  // cudaEventDisableTiming | cudaEventInterprocess). Every operation is queued on `stream`, a
  // stream of `device` that the caller owns and keeps alive for the engine's lifetime. Throws
  // std::invalid_argument naming an argument out of range (local_world above kMaxIpcRanks
  // included), std::runtime_error naming the failing CUDA call and its error.
  CudaIpcEngine(int device, cudaStream_t stream, int local_rank, int local_world, int slots, size_t area_bytes);
  // Waits for the stream, then closes the peers' opened memory and events and frees this rank's;
  // never throws. Peers read this rank's scratch and wait on its events: every rank's stream must
  // be done with them (the caller synchronizes, then a host step) before any rank destroys its
  // engine.
  ~CudaIpcEngine() override;
  CudaIpcEngine(const CudaIpcEngine&) = delete;
  CudaIpcEngine& operator=(const CudaIpcEngine&) = delete;

  // This rank's memory handle and event handles, to publish to the other local ranks; the same
  // size on every rank of equal slots.
  std::vector<uint8_t> export_handles() const;
  // Opens every other local rank's export (exports[p] is rank p's; this rank's own is skipped: it
  // uses its own pointers). Throws std::invalid_argument for an export of another layout (slots,
  // area bytes, world) or rank, std::runtime_error for a CUDA call that fails (IPC refused in a
  // container, say); either leaves the engine unusable (only its destructor may follow).
  void open_peers(const std::vector<std::vector<uint8_t>>& exports);

  // Blocks until this rank's stream is idle and every peer finished reading this rank's scratch
  // (each peer's latest kReadDone of every slot is done). Only after a host step that every rank
  // reached with all of its IPC work queued: then nothing reads the scratch any more, and the
  // engine may be destroyed. Throws std::runtime_error for a failing CUDA call.
  void wait_for_peers();

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

  int slots() const override { return slots_; }
  size_t area_bytes() const override { return area_bytes_; }
  char* scratch(int peer, int slot, int area) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op,
              int divisor) override;
  void signal(IpcEvent event, int slot, uint64_t piece) override;
  void wait(int peer, IpcEvent event, int slot, uint64_t piece) override;

 private:
  size_t event_index(int rank, IpcEvent event, int slot) const {
    return (static_cast<size_t>(rank) * slots_ + slot) * kIpcEvents + static_cast<size_t>(event);
  }
  // Frees what the engine holds, whatever was set up so far (the destructor, a failed constructor).
  void release() noexcept;

  int device_;
  cudaStream_t stream_;
  int rank_, world_, slots_;
  size_t area_bytes_;
  char* own_ = nullptr;              // this rank's scratch
  std::vector<char*> bases_;         // every local rank's scratch: own_, or a peer's opened mapping
  std::vector<cudaEvent_t> events_;  // [rank][slot][event]: this rank's created, the peers' opened
};

// Whether `device` can take part in CUDA IPC (unified addressing; interprocess events, which
// some platforms lack), from its attributes only: nothing is selected or allocated. When not,
// `why` (if not null) says what is missing.
bool cuda_ipc_supported(int device, std::string* why);

}  // namespace cuda
}  // namespace braid
