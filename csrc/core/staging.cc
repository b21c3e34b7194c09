// The staging pipeline: device buffers through pinned host memory in chunks, each chunk's host
// collective overlapped with the copies of its neighbours.
#include "staging.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "tunables.h"

namespace braid {
namespace {

constexpr size_t kMaxStagingChunkBytes = size_t(1) << 30;
constexpr int kMaxStagingSlots = 64;
// Parts start on this boundary in pinned memory (a cache line; copies and kernels like it).
constexpr size_t kPartAlign = 64;

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace

StagingOptions StagingOptions::from_env() {
  StagingOptions o;
  o.chunk_bytes = env_bytes("BRAID_STAGING_CHUNK_BYTES", o.chunk_bytes);
  // Saturated rather than wrapped: validate() then names the variable and its range.
  o.slots = static_cast<int>(std::min<size_t>(env_bytes("BRAID_STAGING_SLOTS", static_cast<size_t>(o.slots)),
                                              static_cast<size_t>(kMaxStagingSlots) + 1));
  return o;
}

void StagingOptions::validate() const {
  if (chunk_bytes < 1 || chunk_bytes > kMaxStagingChunkBytes)
    throw std::invalid_argument("staging_chunk_bytes (BRAID_STAGING_CHUNK_BYTES) must be between 1 byte and 1 GiB, got " +
                                std::to_string(chunk_bytes));
  if (slots < 1 || slots > kMaxStagingSlots)
    throw std::invalid_argument("staging_slots (BRAID_STAGING_SLOTS) must be between 1 and " +
                                std::to_string(kMaxStagingSlots) + ", got " + std::to_string(slots));
}

StagingLayout staging_layout(const Request& r, int rank, int world) {
  StagingLayout l;
  l.elem_size = dtype_size(r.dtype);
  l.count = r.count;
  const int n = world;
  switch (r.kind) {
    case CollKind::kAllReduce:
      l.in_place = true;
      break;
    case CollKind::kBroadcast:
      l.in_place = true;
      l.in_parts = rank == r.root ? 1 : 0;  // the other ranks' data is overwritten unread
      break;
    case CollKind::kAllGather:
      l.out_parts = n;
      break;
    case CollKind::kReduceScatter:
      l.in_parts = n;
      break;
    case CollKind::kAllToAll:
      l.in_parts = n;
      l.out_parts = n;
      break;
    case CollKind::kBarrier:
      l.in_parts = 0;
      l.out_parts = 0;
      l.count = 0;
      break;
    default:
      throw std::invalid_argument(std::string(coll_kind_name(r.kind)) + " has no staged form for device buffers");
  }
  l.in_stride = l.count;
  l.out_stride = l.count;
  return l;
}

// Slot s holds chunk c when c % slots == s: its input parts, then its output parts (one area for
// both when in place). Per slot, event staging_event(kToHost, s) marks its copy to the host done
// and staging_event(kToDevice, s) its copy back. What orders each access to a slot:
//  - the step of chunk c reads what the copy to the host wrote: synchronize(kToHost event);
//  - the copy to the host of chunk c is queued after the kToHost lane waits, on the device, for
//    the slot's last copy back (chunk c - slots, or a chunk of an earlier call), so it cannot
//    overwrite what that copy still reads (in place), and the step of chunk c, which waits for
//    it, cannot write the output area under that copy either;
//  - a call starts with that lane waiting for every slot's last copy back: an earlier call's
//    slots may be cut differently (another layout, another chunk count);
//  - the copy to the host of chunk c + slots is queued only after the step of chunk c returned,
//    so it cannot overwrite an input the step still reads.
// The host blocks only for the copy to the host of the chunk it is about to reduce: the copies
// back are ordered on the device.
void run_staged(CopyEngine& engine, const StagingLayout& layout, const void* in, void* out,
                const StagingOptions& opts, const std::function<void(const StagedChunk&)>& step,
                bool wait_copies_back) {
  const size_t es = layout.elem_size;
  const size_t chunk = std::max<size_t>(1, opts.chunk_bytes / es);
  const size_t nchunks = std::max<size_t>(1, (layout.count + chunk - 1) / chunk);
  const int slots = static_cast<int>(std::min<size_t>(static_cast<size_t>(opts.slots), nchunks));
  const size_t part = align_up(std::min(chunk, layout.count) * es, kPartAlign);
  const size_t in_bytes = part * static_cast<size_t>(layout.in_parts);
  const size_t out_bytes = part * static_cast<size_t>(layout.out_parts);
  const size_t slot_bytes = layout.in_place ? std::max(in_bytes, out_bytes) : in_bytes + out_bytes;
  const auto* dev_in = static_cast<const char*>(in);
  auto* dev_out = static_cast<char*>(out);

  try {
    char* host = engine.prepare(std::max<size_t>(1, slot_bytes * static_cast<size_t>(slots)), 2 * opts.slots);
    for (int s = 0; s < opts.slots; ++s) engine.wait(Lane::kToHost, staging_event(Lane::kToDevice, s));
    auto len_of = [&](size_t c) { return std::min(chunk, layout.count - std::min(layout.count, c * chunk)); };
    auto in_area = [&](int s) { return host + static_cast<size_t>(s) * slot_bytes; };
    auto out_area = [&](int s) { return layout.in_place ? in_area(s) : in_area(s) + in_bytes; };

    auto copy_to_host = [&](size_t c) {
      const int s = static_cast<int>(c % static_cast<size_t>(slots));
      const size_t off = c * chunk, len = len_of(c);
      engine.wait(Lane::kToHost, staging_event(Lane::kToDevice, s));
      for (int p = 0; p < layout.in_parts && len > 0; ++p)
        engine.copy(Lane::kToHost, in_area(s) + static_cast<size_t>(p) * len * es,
                    dev_in + (static_cast<size_t>(p) * layout.in_stride + off) * es, len * es);
      engine.record(staging_event(Lane::kToHost, s), Lane::kToHost);
    };
    auto copy_back = [&](size_t c) {
      const int s = static_cast<int>(c % static_cast<size_t>(slots));
      const size_t off = c * chunk, len = len_of(c);
      for (int p = 0; p < layout.out_parts && len > 0; ++p)
        engine.copy(Lane::kToDevice, dev_out + (static_cast<size_t>(p) * layout.out_stride + off) * es,
                    out_area(s) + static_cast<size_t>(p) * len * es, len * es);
      engine.record(staging_event(Lane::kToDevice, s), Lane::kToDevice);
    };

    // Fill the pipeline: the copies to the host of the first `slots` chunks.
    for (size_t c = 0; c < static_cast<size_t>(slots); ++c) copy_to_host(c);
    for (size_t c = 0; c < nchunks; ++c) {
      const int s = static_cast<int>(c % static_cast<size_t>(slots));
      engine.synchronize(staging_event(Lane::kToHost, s));
      step(StagedChunk{c, c * chunk, len_of(c), in_area(s), out_area(s)});
      copy_back(c);
      if (c + static_cast<size_t>(slots) < nchunks) copy_to_host(c + static_cast<size_t>(slots));
    }
    if (wait_copies_back)
      for (int s = 0; s < slots; ++s) engine.synchronize(staging_event(Lane::kToDevice, s));
  } catch (...) {
    engine.drain();
    throw;
  }
}

std::shared_ptr<Work> submit_staged(Communicator& comm, std::shared_ptr<CopyEngine> engine, Request r,
                                    StagingOptions opts, StagedHooks hooks, std::shared_ptr<void> keepalive,
                                    bool async) {
  const StagingLayout layout = staging_layout(r, comm.rank(), comm.world_size());
  Communicator* c = &comm;
  auto body = [c, engine = std::move(engine), r = std::move(r), opts, hooks = std::move(hooks), layout] {
    bool in_step = false;  // a failure inside a chunk's collective already poisoned the communicator
    try {
      if (hooks.before) hooks.before();
      run_staged(*engine, layout, r.in, r.out, opts, [&](const StagedChunk& chunk) {
        Request h;
        h.kind = r.kind;
        h.dtype = r.dtype;
        h.op = r.op;
        h.count = chunk.len;
        h.root = r.root;
        h.tag = r.tag;
        h.in = chunk.in;
        h.out = chunk.out;
        in_step = true;
        c->run_collective(h);
        in_step = false;
      });
      if (hooks.after) hooks.after();
    } catch (...) {
      // This rank cannot take part in the rest of the call: its peers would wait for it until the
      // timeout. Aborting tells them now (from the executing thread it poisons and wakes them,
      // leaving the communicator open), and every later call fails at once.
      if (!in_step) c->abort();
      throw;
    }
  };
  return comm.submit_task(std::move(body), std::move(keepalive), async);
}

}  // namespace braid
