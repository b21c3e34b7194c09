// All-to-all over shared memory: rank r ends up with every rank's chunk r, in rank order. It is
// the reduce-scatter pattern without the reduction, which compressed all-reduce needs: chunks
// are reduced only after they are decompressed, so the transport must deliver them untouched.
#include <algorithm>

#include "algorithms.h"
#include "oneshot_sources.h"
#include "scatter_pipeline.h"

namespace braid {

// One-shot: every rank publishes the chunks its peers need (its own stays private) with the
// arrival step, then copies chunk `me` out of every peer's buffer.
void oneshot_all_to_all(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const size_t n = static_cast<size_t>(g.world_size()), me = static_cast<size_t>(g.rank());
  const size_t part = d.count * dtype_size(static_cast<DType>(d.dtype));
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  char* mine = g.oneshot(g.rank(), d.seq);
  const char* data[kMaxLocalRanks];
  const bool windows = oneshot_arrive(g, d, in, part * n, [&] {
    for (size_t j = 0; j < n; ++j)
      if (j != me) copy_bytes(mine + j * part, src + j * part, part);
  }, data);
  for (size_t r = 0; r < n; ++r) {
    const char* from = r == me ? src + me * part
                               : (windows ? data[r] : g.oneshot(static_cast<int>(r), d.seq)) + me * part;
    if (dst + r * part != from) copy_bytes(dst + r * part, from, part);
  }
  if (windows) close_windows(g);
}

// Pipelined: as pipelined_reduce_scatter, slot k holds one piece per peer (my chunk j's piece
// of this round for rank j); after step A every rank copies its pieces out; step G frees the slot.
void pipelined_all_to_all(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const size_t es = dtype_size(static_cast<DType>(d.dtype));
  const int n = g.world_size(), me = g.rank();
  const size_t chunk = slot_elems(g.layout().slot_bytes, static_cast<size_t>(n), es);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const size_t m = d.count;
  const bool stream = g.streaming(m * es * static_cast<size_t>(n));  // the output, as the gathers'
  scatter_pipeline(
      g, d, src, chunk,
      [&](size_t off, size_t len) {  // own chunk while the peers publish (skipped when in place)
        char* own = dst + (me * m + off) * es;
        if (own != src + (me * m + off) * es) copy_output(own, src + (me * m + off) * es, len * es, stream);
      },
      [&](size_t off, size_t len, int k) {
        for (int r = 0; r < n; ++r)
          if (r != me) copy_output(dst + (r * m + off) * es, g.slot(r, k) + me * chunk * es, len * es, stream);
      });
}

}  // namespace braid
