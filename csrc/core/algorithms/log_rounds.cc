// Collectives in log2 n rounds over any Transport, for many members (host leaders across many
// hosts): each member talks to about log2 n others, not n - 1, and a message's latency is paid
// log2 n times instead of the root's or every member's uplink carrying n - 1 copies.
//
// Recursive-doubling all-reduce (small messages): in
// round k each member exchanges its whole partial with the member 2^k away and combines the two,
// the lower block's partial first, so ceil(log2 n) rounds (two more when n is not a power of
// two) instead of the one-shot's n - 1 messages per member, and each member talks to log2 n
// others, not n - 1.
//
//   n = p + e, p the largest power of two <= n: members p .. n-1 first send their input to members
//   0 .. e-1 (member m's to m - p), which fold it in after their own; members 0 .. p-1 then run the
//   rounds; member m - p finally sends the result to member m.
//
// Both members of a pair combine the same two partials in the same order, so by induction every
// member ends with the same bits: the reduction tree is fixed, ((m0 m4) (m2 m6)) ((m1 m5) (m3 m7))
// style. Partials of float16/bfloat16 travel as float32 (rounded once, at the end).
#include <memory>
#include <vector>

#include "../reduce.h"
#include "direct.h"
#include "transfers.h"

namespace braid {

void doubling_all_reduce(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count,
                         int divisor) {
  const int n = g.size(), me = g.me;
  const size_t es = dtype_size(dt), as = acc_size(dt);
  const Operand own{static_cast<const char*>(in), false};
  char* dst = static_cast<char*>(out);
  if (n == 1) {
    reduce_n(dt, op, &own, 1, ReduceDst::result(dst, divisor), count);
    return;
  }
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const size_t bytes = count * as;
  std::unique_ptr<char[]> owned;
  char* scratch = g.scratch != nullptr ? g.scratch->get(0, 2 * bytes) : (owned.reset(new char[2 * bytes]), owned.get());
  char* mine = scratch;
  char* theirs = scratch + bytes;
  reduce_n(dt, ReduceOp::kSum, &own, 1, ReduceDst::partial(mine), count);  // into the accumulator type
  auto exchange = [&](int partner, bool send, bool recv) {
    Transfers t(g);
    if (recv) t.add(partner, false, theirs, bytes);
    if (send) t.add(partner, true, mine, bytes);
    t.run();
  };
  // Combines this member's partial with `partner`'s just received, the lower member's first.
  auto combine = [&](int partner) {
    const Operand lower_first[2] = {{mine, true}, {theirs, true}}, upper_first[2] = {{theirs, true}, {mine, true}};
    reduce_n(dt, op, me < partner ? lower_first : upper_first, 2, ReduceDst::partial(mine), count);
  };
  if (me >= p) {  // an extra member: its input to its partner below, the result back
    exchange(me - p, true, false);
    Transfers t(g);
    t.add(me - p, false, dst, count * es);
    t.run();
    return;
  }
  if (me < n - p) {
    exchange(me + p, false, true);
    combine(me + p);
  }
  for (int mask = 1; mask < p; mask <<= 1) {
    exchange(me ^ mask, true, true);
    combine(me ^ mask);
  }
  const Operand total{mine, true};
  reduce_n(dt, op, &total, 1, ReduceDst::result(dst, divisor), count);
  if (me < n - p) {
    Transfers t(g);
    t.add(me + p, true, dst, count * es);
    t.run();
  }
}

// Binomial tree from `root`: in the round of distance d (1, 2, 4, ...) the members that hold the
// data (relative ranks below d) send it d further on.
void tree_broadcast(const PeerGroup& g, void* data, size_t bytes, int root) {
  const int n = g.size(), v = (g.me - root + n) % n;
  for (int d = 1; d < n; d <<= 1) {
    if (v < d && v + d < n) {
      Transfers t(g);
      t.add((v + d + root) % n, true, data, bytes);
      t.run();
    } else if (v >= d && v < 2 * d) {
      Transfers t(g);
      t.add((v - d + root) % n, false, data, bytes);
      t.run();
    }
  }
}

// Dissemination barrier: in the round of distance d each member signals the member d ahead and
// waits for the one d behind; after ceil(log2 n) rounds every member has heard, through some
// chain, from every other.
void dissemination_barrier(const PeerGroup& g) {
  const int n = g.size();
  for (int d = 1; d < n; d <<= 1) {
    Transfers t(g);
    t.add((g.me + d) % n, true, nullptr, 0);
    t.add((g.me - d + n) % n, false, nullptr, 0);
    t.run();
  }
}

}  // namespace braid
