// Direct collectives over a Transport: every member sends to every other, transfers of all pairs
// in flight together, reductions done as the pieces they need arrive.
#include "direct.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "../reduce.h"

namespace braid {

namespace {

// A set of transfers moved together: lanes in issue order, new ones may be added while the
// others run (a reduced piece's sends).
class Transfers {
 public:
  explicit Transfers(const PeerGroup& g) : g_(g) {}

  P2POp& add(int member, bool send, void* data, size_t bytes) {
    auto op = std::make_unique<P2POp>();
    op->peer = g_.members[static_cast<size_t>(member)];
    op->send = send;
    op->data = static_cast<char*>(data);
    op->bytes = bytes;
    op->dtype = DType::kUInt8;
    op->channel = Channel::kCollective;
    op->desc = g_.desc;
    ops_.push_back(std::move(op));
    return *ops_.back();
  }

  // Advances every lane head; waits when nothing could move. Returns false once all are done.
  bool step() {
    bool moved = false, left = false;
    heads_.clear();
    for (size_t i = 0; i < ops_.size(); ++i) {
      P2POp& op = *ops_[i];
      if (op.done || !lane_head(i)) continue;
      const size_t before = op.off;
      if (g_.transport->advance(op)) {
        moved = true;
        continue;
      }
      left = true;
      moved = moved || op.off != before;
      heads_.push_back(&op);
    }
    if (!left) {
      for (const auto& op : ops_)
        if (!op->done) return true;  // a lane's next op: loop again
      return false;
    }
    if (!moved) g_.transport->wait(heads_.data(), static_cast<int>(heads_.size()), [] { return false; });
    return true;
  }

  void run() {
    while (step()) {
    }
  }

 private:
  bool lane_head(size_t i) const {
    const P2POp& a = *ops_[i];
    for (size_t j = 0; j < i; ++j) {
      const P2POp& b = *ops_[j];
      if (!b.done && b.peer == a.peer && b.send == a.send) return false;
    }
    return true;
  }

  const PeerGroup& g_;
  std::vector<std::unique_ptr<P2POp>> ops_;
  std::vector<P2POp*> heads_;
};

// Member m's part of `count` elements: [begin(m), begin(m + 1)).
size_t part_begin(size_t count, int n, int m) { return count * static_cast<size_t>(m) / static_cast<size_t>(n); }

}  // namespace

void direct_all_reduce(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count,
                       int divisor, size_t piece_bytes, bool oneshot) {
  const int n = g.size(), me = g.me;
  const size_t es = dtype_size(dt);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // What this member reduces: its part, or (one-shot) everything.
  const size_t lo = oneshot ? 0 : part_begin(count, n, me);
  const size_t hi = oneshot ? count : part_begin(count, n, me + 1);
  const size_t mine = hi - lo;
  const size_t piece = std::max<size_t>(1, piece_bytes / es);
  const size_t npieces = oneshot ? 1 : std::max<size_t>(1, (mine + piece - 1) / piece);
  auto piece_lo = [&](size_t k) { return oneshot ? 0 : std::min(mine, k * piece); };
  auto piece_hi = [&](size_t k) { return oneshot ? mine : std::min(mine, (k + 1) * piece); };
  // Every other member's contribution to what this member reduces, slot j for member j.
  std::vector<char> scratch(static_cast<size_t>(n) * mine * es);
  Transfers t(g);
  // Stage 1: my input of every other member's part to that member (in pieces, so that the owner
  // reduces the first piece while the next ones travel), and theirs of mine to me.
  std::vector<std::vector<P2POp*>> incoming(static_cast<size_t>(n));
  for (int m = 0; m < n; ++m) {
    if (m == me) continue;
    const size_t mlo = oneshot ? 0 : part_begin(count, n, m), mhi = oneshot ? count : part_begin(count, n, m + 1);
    const size_t mpieces = oneshot ? 1 : std::max<size_t>(1, (mhi - mlo + piece - 1) / piece);
    for (size_t k = 0; k < mpieces; ++k) {
      const size_t a = oneshot ? 0 : std::min(mhi - mlo, k * piece), b = oneshot ? mhi - mlo : std::min(mhi - mlo, (k + 1) * piece);
      t.add(m, true, const_cast<char*>(src) + (mlo + a) * es, (b - a) * es);
    }
    for (size_t k = 0; k < npieces; ++k)
      incoming[static_cast<size_t>(m)].push_back(
          &t.add(m, false, scratch.data() + (static_cast<size_t>(m) * mine + piece_lo(k)) * es,
                 (piece_hi(k) - piece_lo(k)) * es));
  }
  // Stage 2 (not one-shot): each owner's reduced pieces back to every member.
  if (!oneshot)
    for (int m = 0; m < n; ++m) {
      if (m == me) continue;
      const size_t mlo = part_begin(count, n, m), mhi = part_begin(count, n, m + 1);
      const size_t mpieces = std::max<size_t>(1, (mhi - mlo + piece - 1) / piece);
      for (size_t k = 0; k < mpieces; ++k) {
        const size_t a = std::min(mhi - mlo, k * piece), b = std::min(mhi - mlo, (k + 1) * piece);
        t.add(m, false, dst + (mlo + a) * es, (b - a) * es);
      }
    }
  std::vector<Operand> srcs(static_cast<size_t>(n));
  size_t reduced = 0;  // pieces of mine reduced so far
  auto reduce_ready = [&] {
    for (; reduced < npieces; ++reduced) {
      for (int m = 0; m < n; ++m)
        if (m != me && !incoming[static_cast<size_t>(m)][reduced]->done) return;
      const size_t a = piece_lo(reduced), b = piece_hi(reduced);
      for (int m = 0; m < n; ++m)
        srcs[static_cast<size_t>(m)] = {m == me ? src + (lo + a) * es : scratch.data() + (static_cast<size_t>(m) * mine + a) * es,
                                        false};
      // The output may alias the input: reduce_n reads each block before writing it, and no
      // transfer reads this range of my input (the others' parts only).
      reduce_n(dt, op, srcs.data(), n, dst + (lo + a) * es, false, nullptr, b - a, divisor, true);
      if (!oneshot)
        for (int m = 0; m < n; ++m)
          if (m != me) t.add(m, true, dst + (lo + a) * es, (b - a) * es);
    }
  };
  if (oneshot) {
    // In place, the result overwrites the input that the sends still read: reduce once all
    // transfers are done.
    t.run();
    reduce_ready();
    return;
  }
  for (;;) {
    reduce_ready();
    if (!t.step() && reduced == npieces) break;
  }
}

void direct_all_gather(const PeerGroup& g, const void* in, void* out, const std::vector<size_t>& bytes) {
  const int n = g.size(), me = g.me;
  std::vector<size_t> offset(static_cast<size_t>(n) + 1, 0);
  for (int m = 0; m < n; ++m) offset[static_cast<size_t>(m) + 1] = offset[static_cast<size_t>(m)] + bytes[static_cast<size_t>(m)];
  char* dst = static_cast<char*>(out);
  Transfers t(g);
  for (int m = 0; m < n; ++m) {
    if (m == me) continue;
    t.add(m, true, const_cast<void*>(in), bytes[static_cast<size_t>(me)]);
    t.add(m, false, dst + offset[static_cast<size_t>(m)], bytes[static_cast<size_t>(m)]);
  }
  char* own = dst + offset[static_cast<size_t>(me)];
  if (own != in && bytes[static_cast<size_t>(me)] > 0) std::memmove(own, in, bytes[static_cast<size_t>(me)]);
  t.run();
}

void direct_broadcast(const PeerGroup& g, void* data, size_t bytes, int root) {
  Transfers t(g);
  if (g.me == root) {
    for (int m = 0; m < g.size(); ++m)
      if (m != root) t.add(m, true, data, bytes);
  } else {
    t.add(root, false, data, bytes);
  }
  t.run();
}

void direct_barrier(const PeerGroup& g) {
  std::vector<DirectBlock> both;
  for (int m = 0; m < g.size(); ++m)
    if (m != g.me) both.push_back({m, nullptr, 0});
  direct_exchange(g, both, both);
}

void direct_exchange(const PeerGroup& g, const std::vector<DirectBlock>& sends, const std::vector<DirectBlock>& recvs) {
  Transfers t(g);
  for (const DirectBlock& b : sends) t.add(b.member, true, b.data, b.bytes);
  for (const DirectBlock& b : recvs) t.add(b.member, false, b.data, b.bytes);
  t.run();
}

}  // namespace braid
