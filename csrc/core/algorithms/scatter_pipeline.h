// The round structure reduce_scatter and all_to_all share for large messages: every rank
// publishes, per round, piece j of its input for each peer j in one slot, then reads the pieces
// the peers published for it.
#pragma once

#include <algorithm>

#include "algorithms.h"

namespace braid {

// Per round of `chunk` elements: publish this rank's pieces in slot k (step A), run
// `while_waiting(off, len)`, wait for every peer's step A, run `take(off, len, k)` (piece r for
// this rank is at g.slot(r, k) + me * chunk * es), post step G. A slot is reused only after every
// rank posted G for the round that last used it. `d.count` is the length of one piece.
template <class WhileWaiting, class Take>
void scatter_pipeline(ShmGroup& g, const CollectiveDesc& d, const char* src, size_t chunk,
                      WhileWaiting while_waiting, Take take) {
  const size_t es = dtype_size(static_cast<DType>(d.dtype));
  const int n = g.world_size(), me = g.rank(), nslots = g.layout().nslots;
  const size_t m = d.count;
  const uint64_t base = g.arrive(d);
  size_t round = 0;
  for (size_t off = 0; off < m; off += chunk, ++round) {
    const size_t len = std::min(chunk, m - off);
    const int k = static_cast<int>(round % nslots);
    const uint64_t step_a = base + 2 * round + 1;
    if (round >= static_cast<size_t>(nslots)) g.wait_all(step_a - 2 * nslots + 1);
    char* my_slot = g.slot(me, k);
    for (int j = 0; j < n; ++j)
      if (j != me) copy_bytes(my_slot + j * chunk * es, src + (j * m + off) * es, len * es);
    g.post_next();  // A
    while_waiting(off, len);
    g.wait_all(step_a);
    take(off, len, k);
    g.post_next();  // G
  }
}

}  // namespace braid
