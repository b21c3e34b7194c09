// One-shot collectives for small messages: each rank copies its input into its own one-shot
// buffer, posts one step, and reads every peer's buffer directly. One synchronization in all.

#include "../reduce.h"
#include "algorithms.h"

namespace braid {

void oneshot_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const size_t bytes = d.count * dtype_size(dt);
  copy_bytes(g.oneshot(g.rank(), d.seq), in, bytes);
  g.arrive(d);
  // Own input is read from private memory: same values as the published copy, no cross-core trip.
  Operand srcs[kMaxLocalRanks];
  for (int r = 0; r < g.world_size(); ++r) srcs[r] = {r == g.rank() ? in : g.oneshot(r, d.seq), false};
  reduce_n(dt, static_cast<ReduceOp>(d.op), srcs, g.world_size(), ReduceDst::result(out, g.world_size()), d.count);
}

void oneshot_reduce_scatter(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const size_t es = dtype_size(dt), n = static_cast<size_t>(g.world_size()), me = static_cast<size_t>(g.rank());
  const size_t part = d.count * es;
  // Publish only the parts that peers reduce; this rank's own part stays private.
  char* mine = g.oneshot(g.rank(), d.seq);
  for (size_t j = 0; j < n; ++j)
    if (j != me) copy_bytes(mine + j * part, static_cast<const char*>(in) + j * part, part);
  g.arrive(d);
  Operand srcs[kMaxLocalRanks];
  for (size_t r = 0; r < n; ++r)
    srcs[r] = {r == me ? static_cast<const char*>(in) + me * part : g.oneshot(static_cast<int>(r), d.seq) + me * part, false};
  reduce_n(dt, static_cast<ReduceOp>(d.op), srcs, g.world_size(), ReduceDst::result(out, g.world_size()), d.count);
}

void oneshot_all_gather(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const size_t part = d.count * dtype_size(static_cast<DType>(d.dtype));
  copy_bytes(g.oneshot(g.rank(), d.seq), in, part);
  g.arrive(d);
  for (int r = 0; r < g.world_size(); ++r) {
    char* dst = static_cast<char*>(out) + static_cast<size_t>(r) * part;
    const void* src = r == g.rank() ? in : g.oneshot(r, d.seq);
    if (dst != src) copy_bytes(dst, src, part);
  }
}

void oneshot_broadcast(ShmGroup& g, const CollectiveDesc& d, void* data) {
  const size_t bytes = d.count * dtype_size(static_cast<DType>(d.dtype));
  const int root = static_cast<int>(d.root);
  if (g.rank() == root) copy_bytes(g.oneshot(root, d.seq), data, bytes);
  g.arrive(d);
  if (g.rank() != root) copy_bytes(data, g.oneshot(root, d.seq), bytes);
}

void barrier(ShmGroup& g, const CollectiveDesc& d) { g.arrive(d); }

}  // namespace braid
