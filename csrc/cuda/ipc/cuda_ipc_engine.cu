// CudaIpcEngine: the IPC schedules' operations as stream-ordered CUDA calls on one stream, peers'
// scratch and events opened through CUDA IPC.
#include "cuda_ipc_engine.h"

#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "../cuda_call.h"
#include "ipc_reduce.h"

namespace braid {
namespace cuda {
namespace {

constexpr const char* kWho = "braid CUDA IPC";

void check(cudaError_t e, const std::string& what) { check_call(e, kWho, what); }

// The engine's device current for a scope (cuda_call.h).
class Scope : public DeviceScope {
 public:
  explicit Scope(int device) : DeviceScope(device, kWho) {}
};

// An export: a header that open_peers checks against its own layout, this rank's memory handle,
// then one event handle per (slot, event).
constexpr uint32_t kExportMagic = 0x50494272;  // "rBIP"
struct ExportHeader {
  uint32_t magic;
  int32_t rank;
  int32_t world;
  int32_t slots;
  uint64_t area_bytes;
};

size_t export_bytes(int slots) {
  return sizeof(ExportHeader) + sizeof(cudaIpcMemHandle_t) +
         static_cast<size_t>(slots) * kIpcEvents * sizeof(cudaIpcEventHandle_t);
}

}  // namespace

CudaIpcEngine::CudaIpcEngine(int device, cudaStream_t stream, int local_rank, int local_world, int slots,
                             size_t area_bytes)
    : device_(device), stream_(stream), rank_(local_rank), world_(local_world), slots_(slots),
      area_bytes_(area_bytes) {
  if (local_world < 1 || local_world > kMaxIpcRanks)
    throw std::invalid_argument("CudaIpcEngine: local_world " + std::to_string(local_world) + " is outside 1.." +
                                std::to_string(kMaxIpcRanks) + " (an IPC reduction reads at most that many ranks)");
  if (local_rank < 0 || local_rank >= local_world)
    throw std::invalid_argument("CudaIpcEngine: local_rank " + std::to_string(local_rank) + " is outside 0.." +
                                std::to_string(local_world - 1));
  if (slots < 2)
    throw std::invalid_argument("CudaIpcEngine: slots " + std::to_string(slots) +
                                " is below 2 (the host queues one piece while the device runs the other)");
  if (area_bytes == 0 || area_bytes % 256 != 0 ||
      area_bytes > std::numeric_limits<size_t>::max() / 2 / static_cast<size_t>(slots))
    throw std::invalid_argument("CudaIpcEngine: area_bytes " + std::to_string(area_bytes) +
                                " is not a positive multiple of 256 that fits " + std::to_string(slots) + " slots");
  Scope scope(device_);
  try {
    void* p = nullptr;
    const size_t bytes = static_cast<size_t>(slots_) * 2 * area_bytes_;
    check(cudaMalloc(&p, bytes), "cudaMalloc of " + std::to_string(bytes) + " bytes of scratch");
    own_ = static_cast<char*>(p);
    bases_.assign(static_cast<size_t>(world_), nullptr);
    bases_[static_cast<size_t>(rank_)] = own_;
    events_.assign(static_cast<size_t>(world_) * slots_ * kIpcEvents, nullptr);
    for (int s = 0; s < slots_; ++s) {
      for (int e = 0; e < kIpcEvents; ++e) {
        check(cudaEventCreateWithFlags(&events_[event_index(rank_, static_cast<IpcEvent>(e), s)],
                                       cudaEventDisableTiming | cudaEventInterprocess),
              "cudaEventCreateWithFlags (interprocess)");
      }
    }
  } catch (...) {
    release();
    throw;
  }
}

CudaIpcEngine::~CudaIpcEngine() { release(); }

void CudaIpcEngine::release() noexcept {
  // Errors are ignored: at interpreter exit the runtime may already be shutting down.
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(device_);
  // The stream may still read the peers' memory, wait on their events, record this rank's.
  cudaStreamSynchronize(stream_);
  for (int p = 0; p < static_cast<int>(bases_.size()); ++p) {
    if (p != rank_ && bases_[static_cast<size_t>(p)] != nullptr) cudaIpcCloseMemHandle(bases_[static_cast<size_t>(p)]);
  }
  for (cudaEvent_t e : events_) {
    if (e != nullptr) cudaEventDestroy(e);  // created or opened alike
  }
  if (own_ != nullptr) cudaFree(own_);
  bases_.clear();
  events_.clear();
  own_ = nullptr;
  cudaSetDevice(previous);
}

std::vector<uint8_t> CudaIpcEngine::export_handles() const {
  Scope scope(device_);
  std::vector<uint8_t> out(export_bytes(slots_));
  const ExportHeader header{kExportMagic, rank_, world_, slots_, area_bytes_};
  std::memcpy(out.data(), &header, sizeof header);
  size_t at = sizeof header;
  cudaIpcMemHandle_t mem;
  check(cudaIpcGetMemHandle(&mem, own_), "cudaIpcGetMemHandle of the scratch");
  std::memcpy(out.data() + at, &mem, sizeof mem);
  at += sizeof mem;
  for (int s = 0; s < slots_; ++s) {
    for (int e = 0; e < kIpcEvents; ++e) {
      cudaIpcEventHandle_t h;
      check(cudaIpcGetEventHandle(&h, events_[event_index(rank_, static_cast<IpcEvent>(e), s)]),
            "cudaIpcGetEventHandle");
      std::memcpy(out.data() + at, &h, sizeof h);
      at += sizeof h;
    }
  }
  return out;
}

void CudaIpcEngine::open_peers(const std::vector<std::vector<uint8_t>>& exports) {
  if (exports.size() != static_cast<size_t>(world_))
    throw std::invalid_argument("open_peers: exports has " + std::to_string(exports.size()) +
                                " entries, local_world is " + std::to_string(world_));
  for (int p = 0; p < world_; ++p) {
    if (p != rank_ && bases_[static_cast<size_t>(p)] != nullptr)
      throw std::logic_error("open_peers: the peers are open already (or a failed call left the engine unusable)");
  }
  Scope scope(device_);
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const std::vector<uint8_t>& x = exports[static_cast<size_t>(p)];
    const std::string who = "local rank " + std::to_string(p) + "'s";
    ExportHeader h{};
    if (x.size() == export_bytes(slots_)) std::memcpy(&h, x.data(), sizeof h);
    if (h.magic != kExportMagic || h.rank != p || h.world != world_ || h.slots != slots_ ||
        h.area_bytes != area_bytes_)
      throw std::invalid_argument("open_peers: exports[" + std::to_string(p) + "] is not " + who + " export of " +
                                  std::to_string(slots_) + " slots of " + std::to_string(area_bytes_) +
                                  " bytes among " + std::to_string(world_) + " ranks");
    size_t at = sizeof h;
    cudaIpcMemHandle_t mem;
    std::memcpy(&mem, x.data() + at, sizeof mem);
    at += sizeof mem;
    void* base = nullptr;
    // Lazy peer access: a peer on another device is mapped through NVLink/PCIe peer access, one on
    // this device (another process) directly.
    check(cudaIpcOpenMemHandle(&base, mem, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle of " + who + " scratch");
    bases_[static_cast<size_t>(p)] = static_cast<char*>(base);
    for (int s = 0; s < slots_; ++s) {
      for (int e = 0; e < kIpcEvents; ++e) {
        cudaIpcEventHandle_t eh;
        std::memcpy(&eh, x.data() + at, sizeof eh);
        at += sizeof eh;
        check(cudaIpcOpenEventHandle(&events_[event_index(p, static_cast<IpcEvent>(e), s)], eh),
              "cudaIpcOpenEventHandle of " + who + " events");
      }
    }
  }
}

char* CudaIpcEngine::scratch(int peer, int slot, int area) {
  return bases_[static_cast<size_t>(peer)] + (static_cast<size_t>(slot) * 2 + static_cast<size_t>(area)) * area_bytes_;
}

void CudaIpcEngine::copy(void* dst, const void* src, size_t bytes) {
  // The copy engines, not a kernel: they stream peer memory over NVLink without taking SMs from
  // the reductions or the caller's compute, and a piece (an area, megabytes) is large enough for
  // their setup not to show. Still to be measured against a kernel copy on a multi-GPU host.
  Scope scope(device_);
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
}

void CudaIpcEngine::reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op,
                           int divisor) {
  if (!op_supports(op, dtype))
    throw std::invalid_argument(std::string("bitwise reduce op ") + reduce_op_name(op) + " needs an integer dtype");
  Scope scope(device_);
  check(launch_ipc_reduce(dst, srcs, nsrcs, count, dtype, op, divisor, stream_),
        std::string("launch_ipc_reduce (") + dtype_name(dtype) + " " + reduce_op_name(op) + " of " +
            std::to_string(nsrcs) + ")");
}

// `piece` is not needed by CUDA: a stream waits for an event's latest record, and the protocol
// (core/ipc/ipc_collectives.h) guarantees that the latest record is the piece's.
void CudaIpcEngine::signal(IpcEvent event, int slot, uint64_t) {
  Scope scope(device_);
  check(cudaEventRecord(events_[event_index(rank_, event, slot)], stream_), "cudaEventRecord");
}

void CudaIpcEngine::wait(int peer, IpcEvent event, int slot, uint64_t) {
  Scope scope(device_);
  check(cudaStreamWaitEvent(stream_, events_[event_index(peer, event, slot)], 0), "cudaStreamWaitEvent");
}

void CudaIpcEngine::wait_for_peers() {
  Scope scope(device_);
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  // Every read of this rank's scratch by a peer comes before that peer's kReadDone of the same
  // piece on its stream, and the caller's host step made every peer queue its last one: the
  // latest record of each slot's kReadDone is the last the peer will make.
  for (int p = 0; p < world_; ++p)
    if (p != rank_)
      for (int s = 0; s < slots_; ++s)
        check(cudaEventSynchronize(events_[event_index(p, IpcEvent::kReadDone, s)]), "cudaEventSynchronize");
}

bool cuda_ipc_supported(int device, std::string* why) {
  auto refuse = [why](const std::string& reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return refuse(std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e));
  const std::string dev = "device " + std::to_string(device);
  if (device < 0 || device >= count) return refuse(dev + " is not one of the " + std::to_string(count) + " visible");
  int unified = 0;
  e = cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device);
  if (e != cudaSuccess) return refuse(dev + ": cudaDeviceGetAttribute: " + cudaGetErrorString(e));
  if (unified == 0) return refuse(dev + " has no unified addressing, which CUDA IPC needs");
#if CUDART_VERSION >= 12000
  // The attribute CUDA documents for testing IPC (absent before CUDA 12).
  int ipc_events = 0;
  e = cudaDeviceGetAttribute(&ipc_events, cudaDevAttrIpcEventSupport, device);
  if (e != cudaSuccess) return refuse(dev + ": cudaDeviceGetAttribute: " + cudaGetErrorString(e));
  if (ipc_events == 0) return refuse(dev + " does not support CUDA IPC events on this platform");
#endif
  return true;
}

}  // namespace cuda
}  // namespace braid
