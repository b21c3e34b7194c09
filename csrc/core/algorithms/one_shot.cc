// One-shot collectives for small messages: each rank copies its input into its own one-shot
// buffer, posts one step, and reads every peer's buffer directly. One synchronization in all.
// Where every rank's data lies in the same registered buffer (past kOneShotWindowMinBytes), no
// rank copies: each reads its peers' data in place, and a closing step follows (oneshot_sources.h).

#include "../reduce.h"
#include "algorithms.h"
#include "oneshot_sources.h"

namespace braid {

void oneshot_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const size_t bytes = d.count * dtype_size(dt);
  const int n = g.world_size(), me = g.rank();
  const char* data[kMaxLocalRanks];
  const bool windows = oneshot_arrive(
      g, d, in, bytes, [&] { copy_bytes(g.oneshot(me, d.seq), in, bytes); }, data);
  if (windows && in == out) {  // in place: every rank's buffer is written where peers read it
    window_all_reduce_arrived(g, d, data, out);
    return;
  }
  // Own input is read from private memory: same values as the published copy, no cross-core trip.
  Operand srcs[kMaxLocalRanks];
  for (int r = 0; r < n; ++r) srcs[r] = {r == me ? in : windows ? data[r] : g.oneshot(r, d.seq), false};
  reduce_n(dt, static_cast<ReduceOp>(d.op), srcs, n, ReduceDst::result(out, n), d.count);
  if (windows) close_windows(g);
}

void oneshot_reduce_scatter(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const size_t es = dtype_size(dt), n = static_cast<size_t>(g.world_size()), me = static_cast<size_t>(g.rank());
  const size_t part = d.count * es;
  const char* src = static_cast<const char*>(in);
  char* mine = g.oneshot(g.rank(), d.seq);
  const char* data[kMaxLocalRanks];
  // Publish only the parts that peers reduce; this rank's own part stays private.
  const bool windows = oneshot_arrive(g, d, in, part * n, [&] {
    for (size_t j = 0; j < n; ++j)
      if (j != me) copy_bytes(mine + j * part, src + j * part, part);
  }, data);
  Operand srcs[kMaxLocalRanks];
  for (size_t r = 0; r < n; ++r) {
    const char* from = windows ? data[r] : g.oneshot(static_cast<int>(r), d.seq);
    srcs[r] = {r == me ? src + me * part : from + me * part, false};
  }
  reduce_n(dt, static_cast<ReduceOp>(d.op), srcs, g.world_size(), ReduceDst::result(out, g.world_size()), d.count);
  if (windows) close_windows(g);
}

void oneshot_all_gather(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const size_t part = d.count * dtype_size(static_cast<DType>(d.dtype));
  const char* data[kMaxLocalRanks];
  const bool windows = oneshot_arrive(
      g, d, in, part, [&] { copy_bytes(g.oneshot(g.rank(), d.seq), in, part); }, data);
  for (int r = 0; r < g.world_size(); ++r) {
    char* dst = static_cast<char*>(out) + static_cast<size_t>(r) * part;
    const void* src = r == g.rank() ? in : windows ? data[r] : g.oneshot(r, d.seq);
    if (dst != src) copy_bytes(dst, src, part);
  }
  if (windows) close_windows(g);
}

void oneshot_broadcast(ShmGroup& g, const CollectiveDesc& d, void* data) {
  const size_t bytes = d.count * dtype_size(static_cast<DType>(d.dtype));
  const int root = static_cast<int>(d.root);
  const char* at[kMaxLocalRanks];
  const bool windows = oneshot_arrive(g, d, data, bytes, [&] {
    if (g.rank() == root) copy_bytes(g.oneshot(root, d.seq), data, bytes);
  }, at);
  if (g.rank() != root) copy_bytes(data, windows ? at[root] : g.oneshot(root, d.seq), bytes);
  if (windows) close_windows(g);
}

void barrier(ShmGroup& g, const CollectiveDesc& d) { g.arrive(d); }

}  // namespace braid
