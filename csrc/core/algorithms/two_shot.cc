// Two-shot all-reduce for large messages on one host: reduce-scatter then all-gather, pipelined
// round by round through the shared-memory slots so that the data in flight stays in cache.
//
// Round i uses slot k = i % nslots of every rank. A slot holds one "in" piece per rank (the parts
// of this rank's input that the peers reduce) and one "out" piece (this rank's reduced part).
//   step A: copy my input's part j into my slot's piece j for every j != me; post.
//   step R: wait for every A; reduce part me over ranks 0..n-1 in rank order (own input read
//           from private memory, the others from their slots), writing to my output and to my
//           slot's out piece; post.
//   step G: wait for every R; copy each peer's out piece into my output; post (slot free).
// Before reusing slot k in round i a rank waits for every peer's G of round i - nslots.
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
  const int nslots = g.layout().nslots;
  const size_t chunk = slot_elems(g.layout().slot_bytes, static_cast<size_t>(n) + 1, es);
  const size_t out_piece = static_cast<size_t>(n) * chunk * es;  // offset of the out piece
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);

  const uint64_t base = g.arrive(d);
  Operand srcs[kMaxLocalRanks];
  size_t round = 0;
  for (size_t off = 0; off < d.count; off += static_cast<size_t>(n) * chunk, ++round) {
    const size_t block = std::min(static_cast<size_t>(n) * chunk, d.count - off);
    const size_t per = (block + n - 1) / n;  // part j covers [j*per, min((j+1)*per, block))
    auto part_begin = [&](int j) { return std::min(static_cast<size_t>(j) * per, block); };
    auto part_len = [&](int j) { return part_begin(j + 1) - part_begin(j); };
    const int k = static_cast<int>(round % nslots);
    const uint64_t step_a = base + 3 * round + 1;
    if (round >= static_cast<size_t>(nslots)) g.wait_all(step_a - 3 * nslots + 2);  // G, round - nslots

    char* my_slot = g.slot(me, k);
    for (int j = 0; j < n; ++j)
      if (j != me) copy_bytes(my_slot + j * chunk * es, src + (off + part_begin(j)) * es, part_len(j) * es);
    g.post_next();  // A
    g.wait_all(step_a);

    for (int r = 0; r < n; ++r)
      srcs[r] = {r == me ? src + (off + part_begin(me)) * es : g.slot(r, k) + me * chunk * es, false};
    reduce_n(dt, op, srcs, n, dst + (off + part_begin(me)) * es, false, my_slot + out_piece,
             part_len(me), n, true);
    g.post_next();  // R
    g.wait_all(step_a + 1);

    for (int j = 0; j < n; ++j)
      if (j != me) copy_bytes(dst + (off + part_begin(j)) * es, g.slot(j, k) + out_piece, part_len(j) * es);
    g.post_next();  // G
  }
}

}  // namespace braid
