// The device-to-device path for CUDA tensors between the ranks of one host (CUDA builds only): the
// channel's setup by all ranks together and the submission of calls to it.
#ifdef BRAID_WITH_CUDA

#include "cuda_ipc.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "../core/tunables.h"
#include "cuda_stager.h"

namespace braid {

namespace {

// Tags of the setup's host steps (an all_gather's tag is compared between ranks like the rest of
// its descriptor): a rank that reaches its setup while a peer issues an ordinary call fails with
// a mismatch instead of exchanging the wrong words.
constexpr uint32_t kSetupLayoutTag = 0x1bc0da01u;
constexpr uint32_t kSetupHandlesTag = 0x1bc0da02u;
constexpr uint32_t kSetupOpenedTag = 0x1bc0da03u;
constexpr uint32_t kReleaseTag = 0x1bc0da04u;

// How the flight recorder labels a device-to-device call (static strings, as TaskTrace wants).
const char* ipc_label(CollKind kind) {
  switch (kind) {
    case CollKind::kAllReduce: return "ipc all_reduce";
    case CollKind::kReduceScatter: return "ipc reduce_scatter";
    case CollKind::kAllGather: return "ipc all_gather";
    case CollKind::kBroadcast: return "ipc broadcast";
    case CollKind::kAllToAll: return "ipc all_to_all";
    case CollKind::kBarrier: return "ipc barrier";
    default: return "ipc";
  }
}

// An all_gather of int64 words over the host's ranks, from inside a task body: `words` holds this
// rank's on entry and every rank's (rank-major) on return.
void host_gather(Communicator& c, uint32_t tag, std::vector<int64_t>& words) {
  std::vector<int64_t> all(words.size() * static_cast<size_t>(c.scope_size(Scope::kHost)));
  Request h = make_request(CollKind::kAllGather, DType::kInt64, words.size(), words.data(), all.data());
  h.tag = tag;
  h.scope = Scope::kHost;
  c.run_collective(h);
  words = std::move(all);
}

void host_gather_bytes(Communicator& c, uint32_t tag, const std::vector<uint8_t>& mine, std::vector<uint8_t>& all) {
  all.assign(mine.size() * static_cast<size_t>(c.scope_size(Scope::kHost)), 0);
  Request h = make_request(CollKind::kAllGather, DType::kUInt8, mine.size(), mine.data(), all.data());
  h.tag = tag;
  h.scope = Scope::kHost;
  c.run_collective(h);
}

// Runs `run` (which queues an IPC call's work on the channel's stream, calling the host step it is
// given) as one task of `comm`: the channel's stream first waits for the caller's current stream;
// `finish` runs last with the channel's stream current. A failure outside a host step (a CUDA
// error) aborts the communicator, so that the peers, which would wait for this rank at their next
// step, fail at once; a failure inside a step already poisoned it.
std::shared_ptr<Work> submit_ipc_task(Communicator& comm, const CudaIpcChannel& ch,
                                      std::function<void(const IpcHostStep&)> run, std::vector<at::Tensor> used,
                                      std::function<void()> finish, bool async, const TaskTrace& trace) {
  const c10::cuda::CUDAStream stream = ch.stream();
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(stream.device_index());
  auto start = std::make_shared<cuda::CudaEvent>(stream.device_index());
  start->record(caller.stream());
  for (const auto& t : used)
    if (t.defined() && t.is_cuda() && t.numel() > 0)
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
  auto keep = std::make_shared<std::vector<at::Tensor>>(std::move(used));
  Communicator* c = &comm;
  auto body = [c, stream, start, run = std::move(run), finish = std::move(finish)] {
    bool in_step = false;
    const IpcHostStep step = [c, &in_step](uint32_t tag, std::vector<int64_t>& words) {
      in_step = true;
      host_gather(*c, tag, words);
      in_step = false;
    };
    try {
      start->block(stream.stream());
      run(step);
      c10::cuda::CUDAStreamGuard guard(stream);
      if (finish) finish();
    } catch (...) {
      if (!in_step) c->abort();
      throw;
    }
  };
  return comm.submit_task(std::move(body), std::move(keep), async, trace);
}

}  // namespace

IpcOptions IpcOptions::from_env() {
  IpcOptions o;
  const char* on = std::getenv("BRAID_CUDA_IPC");
  if (on != nullptr && *on != '\0') {
    const std::string v(on);
    if (v != "0" && v != "1") throw std::invalid_argument("BRAID_CUDA_IPC must be 0 or 1, got '" + v + "'");
    o.enabled = v == "1";
  }
  o.area_bytes = env_bytes("BRAID_IPC_AREA_BYTES", o.area_bytes);
  o.slots = static_cast<int>(env_bytes("BRAID_IPC_SLOTS", static_cast<size_t>(o.slots)));
  o.validate();
  return o;
}

void IpcOptions::validate() const {
  if (area_bytes < 4096 || area_bytes % 256 != 0 || area_bytes > (size_t{1} << 30))
    throw std::invalid_argument("BRAID_IPC_AREA_BYTES must be a multiple of 256 in [4096, 2^30], got " +
                                std::to_string(area_bytes));
  if (slots < 2 || slots > 16)
    throw std::invalid_argument("BRAID_IPC_SLOTS must be in [2, 16], got " + std::to_string(slots));
}

bool ipc_runs(CollKind kind) {
  switch (kind) {
    case CollKind::kAllReduce:
    case CollKind::kReduceScatter:
    case CollKind::kAllGather:
    case CollKind::kBroadcast:
    case CollKind::kAllToAll:
    case CollKind::kBarrier:
      return true;
    default:
      return false;
  }
}

std::shared_ptr<CudaIpcChannel> CudaIpcChannels::get(Communicator& c, c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = by_device_[device];
  if (e.decided) return e.channel;
  if (c.topology().multi_host()) {
    // Not a refusal: the path between hosts is the staged one (pinned buffers over TCP).
    e.decided = true;
    e.reason = "the communicator spans several hosts";
    return nullptr;
  }
  const IpcOptions opts = IpcOptions::from_env();  // a bad knob raises here, on every rank alike
  const int rank = c.scope_rank(Scope::kHost), world = c.scope_size(Scope::kHost);
  const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(false, device);
  std::shared_ptr<CudaIpcChannel> made;
  std::string why;  // this rank's own reason, when it refuses
  std::string verdict;
  auto body = [&] {
    std::unique_ptr<cuda::CudaIpcEngine> engine;
    std::vector<uint8_t> handles;
    if (!opts.enabled) {
      why = "BRAID_CUDA_IPC=0";
    } else if (cuda::cuda_ipc_supported(device, &why)) {
      try {
        engine = std::make_unique<cuda::CudaIpcEngine>(device, stream.stream(), rank, world, opts.slots,
                                                       opts.area_bytes);
        handles = engine->export_handles();
      } catch (const std::exception& ex) {
        why = ex.what();
        engine.reset();
      }
    }
    // Step 1: who can take part, with which layout (the scratch layout is part of the protocol).
    std::vector<int64_t> layout = {engine ? 1 : 0, opts.slots, static_cast<int64_t>(opts.area_bytes),
                                   static_cast<int64_t>(handles.size())};
    host_gather(c, kSetupLayoutTag, layout);
    for (int r = 0; r < world; ++r) {
      const int64_t* w = &layout[static_cast<size_t>(r) * 4];
      if (w[0] == 0) {
        verdict = "rank " + std::to_string(r) + " of the host could not set up CUDA IPC";
        if (r == rank) verdict += " (" + why + ")";
        return;
      }
      if (w[1] != opts.slots || w[2] != static_cast<int64_t>(opts.area_bytes) ||
          w[3] != static_cast<int64_t>(handles.size()))
        throw std::invalid_argument("BRAID_IPC_SLOTS / BRAID_IPC_AREA_BYTES differ between ranks: rank " +
                                    std::to_string(r) + " has " + std::to_string(w[1]) + " slots of " +
                                    std::to_string(w[2]) + " bytes, rank " + std::to_string(rank) + " " +
                                    std::to_string(opts.slots) + " of " + std::to_string(opts.area_bytes));
    }
    // Step 2: every rank's handles; step 3: whether every rank opened its peers'.
    std::vector<uint8_t> all;
    host_gather_bytes(c, kSetupHandlesTag, handles, all);
    std::vector<std::vector<uint8_t>> exports(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r)
      exports[static_cast<size_t>(r)].assign(all.begin() + static_cast<ptrdiff_t>(r * handles.size()),
                                             all.begin() + static_cast<ptrdiff_t>((r + 1) * handles.size()));
    bool opened = true;
    try {
      engine->open_peers(exports);
    } catch (const std::exception& ex) {
      why = ex.what();
      opened = false;
    }
    std::vector<int64_t> ok = {opened ? 1 : 0};
    host_gather(c, kSetupOpenedTag, ok);
    for (int r = 0; r < world; ++r)
      if (ok[static_cast<size_t>(r)] == 0) {
        verdict = "rank " + std::to_string(r) + " of the host could not open its peers' CUDA IPC handles";
        if (r == rank) verdict += " (" + why + ")";
        return;
      }
    made = std::make_shared<CudaIpcChannel>(std::move(engine), stream);
  };
  c.submit_task(body, nullptr, false);
  e.decided = true;
  e.channel = made;
  e.reason = verdict;
  if (made) c.set_close_hook([this, &c] { release(c); });
  if (!made) {
    std::fprintf(stderr,
                 "braid: rank %d: CUDA tensors between the ranks of this host go through pinned host memory: %s\n",
                 c.rank(), verdict.c_str());
  }
  return made;
}

void CudaIpcChannels::release(Communicator& c) {
  std::vector<std::shared_ptr<CudaIpcChannel>> channels;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [device, e] : by_device_)
      if (e.channel) channels.push_back(e.channel);
  }
  if (channels.empty()) return;
  std::vector<int64_t> word = {static_cast<int64_t>(channels.size())};
  host_gather(c, kReleaseTag, word);
  for (const auto& ch : channels) ch->release();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [device, e] : by_device_) e.channel.reset();
}

std::string CudaIpcChannels::path(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_device_.find(device);
  if (it == by_device_.end() || !it->second.decided) return "";
  if (it->second.channel) return "ipc";
  return "staged: " + it->second.reason;
}

CudaIpcChannels& ipc_channels_of(Communicator& c) { return stagers_of(c).ipc(); }

std::shared_ptr<Work> submit_ipc_call(Communicator& comm, CudaIpcChannel& ch, std::vector<Request> requests,
                                      std::vector<at::Tensor> used, std::function<void()> finish, bool async) {
  const int rank = comm.scope_rank(Scope::kHost), world = comm.scope_size(Scope::kHost);
  CudaIpcChannel* channel = &ch;
  // The flight recorder names the call by its first request (its host steps are recorded too,
  // as all_gathers of the host's ranks).
  TaskTrace trace;
  if (!requests.empty()) {
    trace.label = ipc_label(requests.front().kind);
    trace.dtype = requests.front().dtype;
    trace.count = requests.front().count;
  }
  auto run = [channel, rank, world, requests = std::move(requests)](const IpcHostStep& step) {
    for (const Request& r : requests) run_ipc(channel->engine(), channel->sequence(), r, rank, world, step);
  };
  return submit_ipc_task(comm, ch, std::move(run), std::move(used), std::move(finish), async, trace);
}

std::shared_ptr<Work> submit_ipc_all_to_all_v(Communicator& comm, CudaIpcChannel& ch, DType dtype, const void* in,
                                              void* out, const SplitCounts& counts, std::vector<at::Tensor> used,
                                              std::function<void()> finish, bool async) {
  const int rank = comm.scope_rank(Scope::kHost), world = comm.scope_size(Scope::kHost);
  std::vector<int64_t> send_off(static_cast<size_t>(world), 0), recv_off(static_cast<size_t>(world), 0);
  for (size_t j = 1; j < send_off.size(); ++j) {
    send_off[j] = send_off[j - 1] + counts.send[j - 1];
    recv_off[j] = recv_off[j - 1] + counts.recv[j - 1];
  }
  CudaIpcChannel* channel = &ch;
  TaskTrace trace;
  trace.label = "ipc all_to_all_v";
  trace.dtype = dtype;
  trace.count = static_cast<uint64_t>(std::accumulate(counts.send.begin(), counts.send.end(), int64_t{0}));
  auto run = [=, sc = counts.send, rc = counts.recv, so = std::move(send_off),
              ro = std::move(recv_off)](const IpcHostStep& step) {
    run_ipc_all_to_all_v(channel->engine(), channel->sequence(), dtype, in, out, sc, so, rc, ro, rank, world, step);
  };
  return submit_ipc_task(comm, ch, std::move(run), std::move(used), std::move(finish), async, trace);
}

}  // namespace braid

#endif  // BRAID_WITH_CUDA
