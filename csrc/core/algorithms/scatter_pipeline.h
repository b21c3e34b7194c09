// The round structure reduce_scatter and all_to_all share for large messages: every rank
// publishes, per round, piece j of its input for each peer j in one slot, then reads the pieces
// the peers published for it.
#pragma once

#include <algorithm>

#include "algorithms.h"

namespace braid {

// Per round of `chunk` elements: publish this rank's pieces in slot k (phase A), run
// `while_waiting(off, len)`, wait for every peer's A of the round, run `take(off, len, k)` (piece
// r for this rank is at g.slot(r, k) + me * chunk * es; phase G). A slot is reused only after
// every rank finished G of the round that last used it. `d.count` is the length of one piece.
// Each phase posts one step. Lockstep, iteration t runs A and G of round t; skewed
// (g.skewed_rounds()), iteration t runs A of round t and G of round t - 1, so the wait before G
// is for a round the peers published an iteration earlier.
template <class WhileWaiting, class Take>
void scatter_pipeline(ShmGroup& g, const CollectiveDesc& d, const char* src, size_t chunk,
                      WhileWaiting while_waiting, Take take) {
  const size_t es = dtype_size(static_cast<DType>(d.dtype));
  const int n = g.world_size(), me = g.rank();
  const size_t nslots = static_cast<size_t>(g.layout().nslots);
  const size_t m = d.count;
  const size_t rounds = (m + chunk - 1) / chunk;
  const bool skewed = g.skewed_rounds();
  const uint64_t base = g.arrive(d);
  auto step_a = [&](size_t i) { return base + 2 * i + 1; };
  auto step_g = [&](size_t i) { return base + 2 * i + (skewed ? 4 : 2); };

  auto publish = [&](size_t i) {  // A, then the caller's work that needs no peer
    const size_t off = i * chunk, len = std::min(chunk, m - off);
    if (i >= nslots) g.wait_all(step_g(i - nslots));
    char* my_slot = g.slot(me, static_cast<int>(i % nslots));
    for (int j = 0; j < n; ++j)
      if (j != me) copy_bytes(my_slot + j * chunk * es, src + (j * m + off) * es, len * es);
    g.post_next();
    while_waiting(off, len);
  };
  auto gather = [&](size_t i) {  // G
    const size_t off = i * chunk, len = std::min(chunk, m - off);
    g.wait_all(step_a(i));
    take(off, len, static_cast<int>(i % nslots));
  };

  if (!skewed) {
    for (size_t i = 0; i < rounds; ++i) {
      publish(i);
      gather(i);
      g.post_next();
    }
    return;
  }
  for (size_t t = 0; t < rounds + 1; ++t) {
    if (t < rounds) {
      publish(t);
    } else {
      g.post_next();  // the last iteration's empty A
    }
    if (t >= 1) gather(t - 1);
    g.post_next();
  }
}

}  // namespace braid
