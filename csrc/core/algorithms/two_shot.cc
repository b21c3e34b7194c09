// Two-shot all-reduce for large messages on one host: reduce-scatter then all-gather, pipelined
// round by round through the shared-memory slots so that the data in flight stays in cache.
//
// Round i uses slot k = i % nslots of every rank. A slot holds one "in" piece per rank (the parts
// of this rank's input that the peers reduce) and one "out" piece (this rank's reduced part).
// Each round has three phases:
//   A: copy my input's part j into my slot's piece j for every j != me.
//   R: once every peer did A, reduce part me over ranks 0..n-1 in rank order (own input read
//      from private memory, the others from their slots), writing to my output and to my slot's
//      out piece.
//   G: once every peer did R, copy each peer's out piece into my output (frees the slot).
// Before reusing slot k for round i a rank waits for every peer's G of round i - nslots. Each
// phase posts one step. Two schedules, the same on every rank:
//  - lockstep: A, R, G of round i, then round i + 1;
//  - skewed: iteration t runs G of round t - 2, R of round t - 1 and A of round t (empty phases
//    of the first and last iterations still post), so every wait is for work the peers finished
//    an iteration earlier and a rank that runs a little behind does not stall the others at each
//    phase. Faster when every rank has a core of its own; with more ranks than cores the
//    lockstep schedule is (measured: docs/results/2026-11-21-epyc-avx512-2vcpu.md,
//    "Skewed pipelines").
#include <algorithm>

#include "../reduce.h"
#include "algorithms.h"

namespace braid {

size_t slot_elems(size_t slot_bytes, size_t parts, size_t elem_bytes) {
  size_t e = slot_bytes / (parts * elem_bytes);
  if (e >= 64) e &= ~size_t(15);
  return e;
}

void twoshot_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const auto op = static_cast<ReduceOp>(d.op);
  const size_t es = dtype_size(dt);
  const int n = g.world_size(), me = g.rank();
  const size_t nslots = static_cast<size_t>(g.layout().nslots);
  const size_t chunk = slot_elems(g.layout().slot_bytes, static_cast<size_t>(n) + 1, es);
  const size_t out_piece = static_cast<size_t>(n) * chunk * es;  // offset of the out piece
  const size_t round_elems = static_cast<size_t>(n) * chunk;
  const size_t rounds = (d.count + round_elems - 1) / round_elems;
  const bool skewed = g.skewed_rounds();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);

  // Part j of round i is [off + begin(j), off + begin(j + 1)) with off = i * round_elems.
  struct Round {
    size_t off, per, block;
    size_t begin(int j) const { return std::min(static_cast<size_t>(j) * per, block); }
    size_t len(int j) const { return begin(j + 1) - begin(j); }
  };
  auto round_at = [&](size_t i) {
    const size_t off = i * round_elems;
    const size_t block = std::min(round_elems, d.count - off);
    return Round{off, (block + n - 1) / n, block};
  };

  const uint64_t base = g.arrive(d);
  // The step each phase of round i posts.
  enum Phase { kA, kR, kG };
  auto step_of = [&](Phase p, size_t i) -> uint64_t {
    if (!skewed) return base + 3 * i + 1 + p;
    switch (p) {
      case kA: return base + 3 * i + 3;
      case kR: return base + 3 * (i + 1) + 2;
      default: return base + 3 * (i + 2) + 1;
    }
  };

  auto publish = [&](size_t i) {  // A
    const Round r = round_at(i);
    if (i >= nslots) g.wait_all(step_of(kG, i - nslots));
    char* my_slot = g.slot(me, static_cast<int>(i % nslots));
    for (int j = 0; j < n; ++j)
      if (j != me) copy_bytes(my_slot + j * chunk * es, src + (r.off + r.begin(j)) * es, r.len(j) * es);
  };
  Operand srcs[kMaxLocalRanks];
  auto reduce = [&](size_t i) {  // R
    const Round r = round_at(i);
    const int k = static_cast<int>(i % nslots);
    g.wait_all(step_of(kA, i));
    for (int q = 0; q < n; ++q)
      srcs[q] = {q == me ? src + (r.off + r.begin(me)) * es : g.slot(q, k) + me * chunk * es, false};
    const ReduceDst to = ReduceDst::result(dst + (r.off + r.begin(me)) * es, n).with_copy(g.slot(me, k) + out_piece);
    reduce_n(dt, op, srcs, n, to, r.len(me));
  };
  auto gather = [&](size_t i) {  // G
    const Round r = round_at(i);
    const int k = static_cast<int>(i % nslots);
    g.wait_all(step_of(kR, i));
    for (int j = 0; j < n; ++j)
      if (j != me) copy_bytes(dst + (r.off + r.begin(j)) * es, g.slot(j, k) + out_piece, r.len(j) * es);
  };

  if (!skewed) {
    for (size_t i = 0; i < rounds; ++i) {
      publish(i);
      g.post_next();
      reduce(i);
      g.post_next();
      gather(i);
      g.post_next();
    }
    return;
  }
  for (size_t t = 0; t < rounds + 2; ++t) {
    if (t >= 2) gather(t - 2);
    g.post_next();
    if (t >= 1 && t <= rounds) reduce(t - 1);
    g.post_next();
    if (t < rounds) publish(t);
    g.post_next();
  }
}

}  // namespace braid
