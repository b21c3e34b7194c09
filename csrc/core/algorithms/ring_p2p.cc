// Ring all-reduce, reduce-scatter and all-gather over any Transport (between hosts): one
// neighbour each way, pieces pipelined within each step; the all-reduce is a reduce-scatter then
// an all-gather around the ring.
//
//   reduce-scatter step s (0 .. n-2): send chunk (me - s) to the right (my input at s = 0, the
//     partial received at step s - 1 plus my input after), receive chunk (me - s - 1) from the
//     left and add my input to it. After step n - 2 the chunk (me + 1) is complete: it is
//     finalized (avg) into the output.
//   all-gather step t (0 .. n-2): send chunk (me + 1 - t) to the right (the complete chunk at
//     t = 0, the one received at step t - 1 after), receive chunk (me - t) into the output.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "../reduce.h"
#include "direct.h"
#include "transfers.h"

namespace braid {

void ring_all_reduce(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count, int divisor,
                     size_t piece_bytes) {
  const int n = g.size(), me = g.me;
  const size_t es = dtype_size(dt), as = acc_size(dt);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (n == 1) {
    const Operand s{src, false};
    reduce_n(dt, op, &s, 1, ReduceDst::result(dst, divisor), count);
    return;
  }
  auto chunk_lo = [&](int c) { return count * static_cast<size_t>((c % n + n) % n) / static_cast<size_t>(n); };
  auto chunk_len = [&](int c) {
    const int k = (c % n + n) % n;
    return count * static_cast<size_t>(k + 1) / static_cast<size_t>(n) - chunk_lo(k);
  };
  const size_t piece = std::max<size_t>(1, piece_bytes / as);
  auto pieces = [&](size_t len) { return std::max<size_t>(1, (len + piece - 1) / piece); };
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  const int steps = n - 1;
  // Partial sums (accumulator type) received at each reduce-scatter step, and the ones sent on.
  const size_t max_chunk = count / static_cast<size_t>(n) + 1;
  const size_t region = static_cast<size_t>(steps) * max_chunk * as;
  std::unique_ptr<char[]> owned;
  char* scratch = g.scratch != nullptr ? g.scratch->get(0, 2 * region) : (owned.reset(new char[2 * region]), owned.get());
  auto got_at = [&](int s) { return scratch + static_cast<size_t>(s) * max_chunk * as; };
  auto partial_at = [&](int s) { return scratch + region + static_cast<size_t>(s) * max_chunk * as; };

  Transfers t(g);
  auto add = [&](int member, bool send, void* data, size_t bytes) { return &t.add(member, send, data, bytes); };
  // Every receive is posted up front, in the order the left neighbour sends.
  struct Piece {
    int step;  // 0 .. 2n-3: reduce-scatter steps, then all-gather steps
    size_t a, b;
    P2POp* recv;
  };
  std::vector<Piece> incoming;
  for (int s = 0; s < 2 * steps; ++s) {
    const bool rs = s < steps;
    const int c = rs ? me - s - 1 : me - (s - steps);
    const size_t len = chunk_len(c);
    for (size_t k = 0; k < pieces(len); ++k) {
      const size_t a = std::min(len, k * piece), b = std::min(len, (k + 1) * piece);
      char* to = rs ? got_at(s) + a * as : dst + (chunk_lo(c) + a) * es;
      incoming.push_back({s, a, b, add(left, false, to, (b - a) * (rs ? as : es))});
    }
  }
  // Step 0 of the reduce-scatter sends my own chunk `me` (as the accumulator type).
  {
    const size_t len = chunk_len(me);
    const Operand own{src + chunk_lo(me) * es, false};
    reduce_n(dt, ReduceOp::kSum, &own, 1, ReduceDst::partial(partial_at(0)), len);
    for (size_t k = 0; k < pieces(len); ++k) {
      const size_t a = std::min(len, k * piece), b = std::min(len, (k + 1) * piece);
      add(right, true, partial_at(0) + a * as, (b - a) * as);
    }
  }
  // Handle the received pieces strictly in order, so that the sends they cause join the lane to
  // the right in the order the neighbour posted its receives; move the transfers in between.
  size_t handled = 0;
  for (;;) {
    for (; handled < incoming.size() && incoming[handled].recv->done; ++handled) {
      const Piece& p = incoming[handled];
      if (p.step < steps) {
        const int c = me - p.step - 1;
        const Operand s2[2] = {{got_at(p.step) + p.a * as, true}, {src + (chunk_lo(c) + p.a) * es, false}};
        if (p.step < steps - 1) {  // add my input, pass the partial on
          reduce_n(dt, op, s2, 2, ReduceDst::partial(partial_at(p.step + 1) + p.a * as), p.b - p.a);
          add(right, true, partial_at(p.step + 1) + p.a * as, (p.b - p.a) * as);
        } else {  // complete: into the output, and around the ring again
          char* final_piece = dst + (chunk_lo(c) + p.a) * es;
          reduce_n(dt, op, s2, 2, ReduceDst::result(final_piece, divisor), p.b - p.a);
          add(right, true, final_piece, (p.b - p.a) * es);
        }
      } else if (p.step < 2 * steps - 1) {  // forward what the all-gather brought
        const int c = me - (p.step - steps);
        add(right, true, dst + (chunk_lo(c) + p.a) * es, (p.b - p.a) * es);
      }
    }
    if (!t.step() && handled == incoming.size()) return;
  }
}

// Reduce-scatter around the ring: block b (counts[b] elements at its offset) starts at member
// b + 1 (its input, in the accumulator type), each member to the right adds its own input of the
// block and passes the partial on, and member b adds its own last, writing the finished block
// (rounded, avg divided) to `out`. In step s (0 .. n-2) a member sends block (me - s - 1) and
// receives block (me - s - 2); pieces travel on as soon as they are reduced.
void ring_reduce_scatter(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out,
                         const std::vector<size_t>& counts, int divisor, size_t piece_bytes) {
  const int n = g.size(), me = g.me;
  const size_t es = dtype_size(dt), as = acc_size(dt);
  const char* src = static_cast<const char*>(in);
  std::vector<size_t> lo(static_cast<size_t>(n) + 1, 0);
  for (int m = 0; m < n; ++m) lo[static_cast<size_t>(m) + 1] = lo[static_cast<size_t>(m)] + counts[static_cast<size_t>(m)];
  auto block = [&](int b) { return static_cast<size_t>((b % n + n) % n); };
  auto len_of = [&](int b) { return counts[block(b)]; };
  auto input_of = [&](int b) { return src + lo[block(b)] * es; };
  if (n == 1) {
    const Operand s{src, false};
    reduce_n(dt, op, &s, 1, ReduceDst::result(out, divisor), counts[0]);
    return;
  }
  const size_t piece = std::max<size_t>(1, piece_bytes / as);
  auto pieces = [&](size_t len) { return std::max<size_t>(1, (len + piece - 1) / piece); };
  const int right = (me + 1) % n, left = (me + n - 1) % n, steps = n - 1;
  const size_t max_block = *std::max_element(counts.begin(), counts.end());
  const size_t region = static_cast<size_t>(steps) * max_block * as;
  std::unique_ptr<char[]> owned;
  char* scratch = g.scratch != nullptr ? g.scratch->get(0, 2 * region + 1)
                                       : (owned.reset(new char[2 * region + 1]), owned.get());
  auto got_at = [&](int s) { return scratch + static_cast<size_t>(s) * max_block * as; };
  auto partial_at = [&](int s) { return scratch + region + static_cast<size_t>(s) * max_block * as; };

  Transfers t(g);
  struct Piece {
    int step;
    size_t a, b;
    P2POp* recv;
  };
  std::vector<Piece> incoming;  // every receive posted up front, in the order the left sends
  for (int s = 0; s < steps; ++s) {
    const size_t len = len_of(me - s - 2);
    for (size_t k = 0; k < pieces(len); ++k) {
      const size_t a = std::min(len, k * piece), b = std::min(len, (k + 1) * piece);
      incoming.push_back({s, a, b, &t.add(left, false, got_at(s) + a * as, (b - a) * as)});
    }
  }
  {  // step 0: this member starts block me - 1 with its own input
    const size_t len = len_of(me - 1);
    const Operand own{input_of(me - 1), false};
    reduce_n(dt, ReduceOp::kSum, &own, 1, ReduceDst::partial(partial_at(0)), len);
    for (size_t k = 0; k < pieces(len); ++k) {
      const size_t a = std::min(len, k * piece), b = std::min(len, (k + 1) * piece);
      t.add(right, true, partial_at(0) + a * as, (b - a) * as);
    }
  }
  size_t handled = 0;
  for (;;) {
    for (; handled < incoming.size() && incoming[handled].recv->done; ++handled) {
      const Piece& p = incoming[handled];
      const int c = me - p.step - 2;
      const Operand s2[2] = {{got_at(p.step) + p.a * as, true}, {input_of(c) + p.a * es, false}};
      if (p.step < steps - 1) {  // add my input, pass the partial on
        reduce_n(dt, op, s2, 2, ReduceDst::partial(partial_at(p.step + 1) + p.a * as), p.b - p.a);
        t.add(right, true, partial_at(p.step + 1) + p.a * as, (p.b - p.a) * as);
      } else {  // block me, complete
        reduce_n(dt, op, s2, 2, ReduceDst::result(static_cast<char*>(out) + p.a * es, divisor), p.b - p.a);
      }
    }
    if (!t.step() && handled == incoming.size()) return;
  }
}

// All-gather around the ring: in step s (0 .. n-2) a member sends the right neighbour block
// (me - s) (its own at s = 0, after that the one it received at step s - 1) and receives block
// (me - s - 1) from the left, piece by piece, each piece passed on as soon as it is in.
void ring_all_gather(const PeerGroup& g, const void* in, void* out, const std::vector<size_t>& bytes,
                     size_t piece_bytes) {
  const int n = g.size(), me = g.me;
  std::vector<size_t> offset(static_cast<size_t>(n) + 1, 0);
  for (int m = 0; m < n; ++m) offset[static_cast<size_t>(m) + 1] = offset[static_cast<size_t>(m)] + bytes[static_cast<size_t>(m)];
  char* dst = static_cast<char*>(out);
  char* own = dst + offset[static_cast<size_t>(me)];
  if (own != in && bytes[static_cast<size_t>(me)] > 0) std::memmove(own, in, bytes[static_cast<size_t>(me)]);
  if (n == 1) return;
  const size_t piece = std::max<size_t>(1, piece_bytes);
  auto pieces = [&](size_t len) { return std::max<size_t>(1, (len + piece - 1) / piece); };
  const int right = (me + 1) % n, left = (me + n - 1) % n;
  Transfers t(g);
  struct Piece {
    int step;
    char* data;
    size_t len;
    P2POp* recv;
  };
  std::vector<Piece> incoming;
  for (int s = 0; s < n - 1; ++s) {
    const size_t blk = static_cast<size_t>(((me - s - 1) % n + n) % n), len = bytes[blk];
    for (size_t k = 0; k < pieces(len); ++k) {
      const size_t a = std::min(len, k * piece), b = std::min(len, (k + 1) * piece);
      incoming.push_back({s, dst + offset[blk] + a, b - a, &t.add(left, false, dst + offset[blk] + a, b - a)});
    }
  }
  const size_t mine = bytes[static_cast<size_t>(me)];
  for (size_t k = 0; k < pieces(mine); ++k) {
    const size_t a = std::min(mine, k * piece), b = std::min(mine, (k + 1) * piece);
    t.add(right, true, own + a, b - a);
  }
  size_t handled = 0;
  for (;;) {
    for (; handled < incoming.size() && incoming[handled].recv->done; ++handled) {
      const Piece& p = incoming[handled];
      if (p.step < n - 2) t.add(right, true, p.data, p.len);
    }
    if (!t.step() && handled == incoming.size()) return;
  }
}

}  // namespace braid
