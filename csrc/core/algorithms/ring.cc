// Ring all-reduce: reduce-scatter then all-gather between neighbours only, chunked into rounds
// and pipelined through the slots. Each rank reads only its left neighbour's slots, which is
// exactly the traffic pattern of a point-to-point transport (TCP between hosts).
//
// A round splits its block into n chunks and runs 2n-1 phases, in lockstep around the ring:
//   phase 0:          send my chunk `me` (as the accumulator type) to the right.
//   phase j, 1..n-2:  receive chunk me-j from the left, add my input, send the partial on.
//   phase n-1:        receive chunk me+1, add my input: it is complete. Write it to the output
//                     and send it (element type) to start the all-gather.
//   phase j, n..2n-2: receive the complete chunk me-(j-n) and store it; forward it unless last.
// Partial sums of float16/bfloat16 travel as float32 so that the result is rounded once.
// Phases are numbered globally across rounds (p); a rank posts one step per phase, writes
// phase p into slot p % nslots, reads the left's phase p-1 after its post, and reuses a slot only
// once the right neighbour has finished phase p - nslots + 1 (it read the old contents then).
#include <algorithm>

#include "../reduce.h"
#include "algorithms.h"

namespace braid {

void ring_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const auto op = static_cast<ReduceOp>(d.op);
  const size_t es = dtype_size(dt);
  const int n = g.world_size(), me = g.rank();
  const int left = (me + n - 1) % n, right = (me + 1) % n;
  const int nslots = g.layout().nslots;
  const size_t chunk = slot_elems(g.layout().slot_bytes, 1, acc_size(dt));
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);

  const uint64_t base = g.arrive(d);
  const int phases = 2 * n - 1;
  uint64_t p = 0;  // global phase index; the post after phase p is base + 1 + p
  for (size_t off = 0; off < d.count; off += static_cast<size_t>(n) * chunk) {
    const size_t block = std::min(static_cast<size_t>(n) * chunk, d.count - off);
    const size_t per = (block + n - 1) / n;
    auto chunk_begin = [&](int c) { return off + std::min(static_cast<size_t>(c) * per, block); };
    auto chunk_len = [&](int c) { return chunk_begin(c + 1) - chunk_begin(c); };
    for (int j = 0; j < phases; ++j, ++p) {
      const bool reads = j >= 1, writes = j <= 2 * n - 3;
      if (reads) g.wait_peer(left, base + p);  // left posted phase p-1
      if (writes && p >= static_cast<uint64_t>(nslots)) g.wait_peer(right, base + 1 + p - nslots + 1);
      const char* from_left = reads ? g.slot(left, static_cast<int>((p - 1) % nslots)) : nullptr;
      char* to_right = g.slot(me, static_cast<int>(p % nslots));
      if (j == 0) {
        const Operand s{src + chunk_begin(me) * es, false};
        reduce_n(dt, op, &s, 1, ReduceDst::partial(to_right), chunk_len(me));
      } else if (j < n) {
        const int c = ((me - j) % n + n) % n;
        const Operand s[2] = {{from_left, true}, {src + chunk_begin(c) * es, false}};
        if (j < n - 1) {
          reduce_n(dt, op, s, 2, ReduceDst::partial(to_right), chunk_len(c));
        } else {
          reduce_n(dt, op, s, 2, ReduceDst::result(dst + chunk_begin(c) * es, n).with_copy(to_right), chunk_len(c));
        }
      } else {
        const int c = ((me - (j - n)) % n + n) % n;
        copy_bytes(dst + chunk_begin(c) * es, from_left, chunk_len(c) * es);
        if (writes) copy_bytes(to_right, from_left, chunk_len(c) * es);
      }
      g.post_next();
    }
  }
}

}  // namespace braid
