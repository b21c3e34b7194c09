// Reduce-scatter, all-gather and broadcast for large messages, pipelined through the slots.
// Each round: publish (step A), wait, consume (step G). A slot is reused only after every
// reader posted G for the round that last used it.
#include <algorithm>

#include "../reduce.h"
#include "algorithms.h"
#include "scatter_pipeline.h"

namespace braid {

// Reduce-scatter: slot k holds one piece per peer (my input's part j for rank j); rank j reduces
// part j of every rank's input in rank order, its own part read from private memory.
void pipelined_reduce_scatter(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const size_t es = dtype_size(dt);
  const int n = g.world_size(), me = g.rank();
  const size_t chunk = slot_elems(g.layout().slot_bytes, static_cast<size_t>(n), es);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const size_t m = d.count;
  const bool stream = g.streaming(m * es);
  Operand srcs[kMaxLocalRanks];
  scatter_pipeline(
      g, d, src, chunk, [](size_t, size_t) {},
      [&](size_t off, size_t len, int k) {
        for (int r = 0; r < n; ++r)
          srcs[r] = {r == me ? src + (me * m + off) * es : g.slot(r, k) + me * chunk * es, false};
        reduce_n(dt, static_cast<ReduceOp>(d.op), srcs, n, ReduceDst::result(dst + off * es, n).streamed(stream), len);
      });
}

// All-gather: slot k holds this rank's piece of the round; every peer copies it out.
void pipelined_all_gather(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const size_t es = dtype_size(static_cast<DType>(d.dtype));
  const int n = g.world_size(), me = g.rank(), nslots = g.layout().nslots;
  const size_t chunk = slot_elems(g.layout().slot_bytes, 1, es);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const size_t m = d.count;
  const bool stream = g.streaming(m * es * n);

  const uint64_t base = g.arrive(d);
  size_t round = 0;
  for (size_t off = 0; off < m; off += chunk, ++round) {
    const size_t len = std::min(chunk, m - off);
    const int k = static_cast<int>(round % nslots);
    const uint64_t step_a = base + 2 * round + 1;
    if (round >= static_cast<size_t>(nslots)) g.wait_all(step_a - 2 * nslots + 1);
    copy_bytes(g.slot(me, k), src + off * es, len * es);
    g.post_next();  // A
    // Own part while the peers publish theirs (skipped when in-place).
    char* own = dst + (me * m + off) * es;
    if (own != src + off * es) copy_output(own, src + off * es, len * es, stream);
    g.wait_all(step_a);
    for (int j = 0; j < n; ++j)
      if (j != me) copy_output(dst + (j * m + off) * es, g.slot(j, k), len * es, stream);
    g.post_next();  // G
  }
}

// Broadcast: the root fills its slots, the others copy out; only the root waits for readers.
void pipelined_broadcast(ShmGroup& g, const CollectiveDesc& d, void* data) {
  const size_t es = dtype_size(static_cast<DType>(d.dtype));
  const int root = static_cast<int>(d.root), me = g.rank(), nslots = g.layout().nslots;
  const size_t chunk = slot_elems(g.layout().slot_bytes, 1, es);
  char* buf = static_cast<char*>(data);
  const bool stream = g.streaming(d.count * es);

  const uint64_t base = g.arrive(d);
  size_t round = 0;
  for (size_t off = 0; off < d.count; off += chunk, ++round) {
    const size_t len = std::min(chunk, d.count - off);
    const int k = static_cast<int>(round % nslots);
    const uint64_t step_a = base + 2 * round + 1;
    if (me == root) {
      if (round >= static_cast<size_t>(nslots)) g.wait_all(step_a - 2 * nslots + 1);
      copy_bytes(g.slot(root, k), buf + off * es, len * es);
      g.post_next();  // A
      g.post_next();  // G (the root reads nothing; keeps every rank's counter in step)
    } else {
      g.post_next();  // A (nothing to publish)
      g.wait_peer(root, step_a);
      copy_output(buf + off * es, g.slot(root, k), len * es, stream);
      g.post_next();  // G
    }
  }
}

}  // namespace braid
