// Direct collectives over a Transport: every member sends to every other, transfers of all pairs
// in flight together, reductions done as the pieces they need arrive.
#include "direct.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "../reduce.h"
#include "transfers.h"

namespace braid {

namespace {

// Member m's part of `count` elements: [begin(m), begin(m + 1)).
size_t part_begin(size_t count, int n, int m) { return count * static_cast<size_t>(m) / static_cast<size_t>(n); }

// The reduction that all-reduce and reduce-scatter share: member m reduces elements [lo[m], hi[m])
// of every member's input. The others send it theirs in pieces (in the lane order the owner
// receives them), and it reduces each piece, in member order, as soon as every member's copy
// has arrived, into `dst` (element 0: its own lo).
class OwnerReduce {
 public:
  OwnerReduce(const PeerGroup& g, Transfers& t, DType dt, ReduceOp op, const char* src, std::vector<size_t> lo,
              std::vector<size_t> hi, char* dst, int divisor, size_t piece_bytes)
      : g_(g), dt_(dt), op_(op), es_(dtype_size(dt)), src_(src), lo_(std::move(lo)), hi_(std::move(hi)), dst_(dst),
        divisor_(divisor) {
    const int n = g.size(), me = g.me;
    piece_ = std::max<size_t>(1, piece_bytes / es_);
    mine_ = hi_[static_cast<size_t>(me)] - lo_[static_cast<size_t>(me)];
    npieces_ = pieces(mine_);
    const size_t scratch_bytes = static_cast<size_t>(n) * mine_ * es_;
    scratch_ = g.scratch != nullptr ? g.scratch->get(0, scratch_bytes) : (owned_.resize(scratch_bytes), owned_.data());
    incoming_.resize(static_cast<size_t>(n));
    for (int m = 0; m < n; ++m) {
      if (m == me) continue;
      const size_t mlo = lo_[static_cast<size_t>(m)], len = hi_[static_cast<size_t>(m)] - mlo;
      for (size_t k = 0; k < pieces(len); ++k)
        t.add(m, true, const_cast<char*>(src) + (mlo + begin(len, k)) * es_, (begin(len, k + 1) - begin(len, k)) * es_);
      for (size_t k = 0; k < npieces_; ++k)
        incoming_[static_cast<size_t>(m)].push_back(
            &t.add(m, false, scratch_ + (static_cast<size_t>(m) * mine_ + begin(mine_, k)) * es_,
                   (begin(mine_, k + 1) - begin(mine_, k)) * es_));
    }
  }

  size_t pieces(size_t len) const { return std::max<size_t>(1, (len + piece_ - 1) / piece_); }
  size_t begin(size_t len, size_t k) const { return std::min(len, k * piece_); }
  bool done() const { return reduced_ == npieces_; }

  // Reduces the pieces whose inputs have all arrived; `reduced(a, b)` follows each (elements
  // [a, b) of this member's part).
  template <class OnPiece>
  void reduce_ready(const OnPiece& reduced) {
    const int n = g_.size(), me = g_.me;
    std::vector<Operand> srcs(static_cast<size_t>(n));
    for (; reduced_ < npieces_; ++reduced_) {
      for (int m = 0; m < n; ++m)
        if (m != me && !incoming_[static_cast<size_t>(m)][reduced_]->done) return;
      const size_t a = begin(mine_, reduced_), b = begin(mine_, reduced_ + 1);
      for (int m = 0; m < n; ++m)
        srcs[static_cast<size_t>(m)] = {
            m == me ? src_ + (lo_[static_cast<size_t>(me)] + a) * es_ : scratch_ + (static_cast<size_t>(m) * mine_ + a) * es_,
            false};
      // dst may alias this member's own input range: reduce_n reads each block before writing
      // it, and no transfer reads that range (the others' parts only).
      reduce_n(dt_, op_, srcs.data(), n, ReduceDst::result(dst_ + a * es_, divisor_), b - a);
      reduced(a, b);
    }
  }

 private:
  const PeerGroup& g_;
  DType dt_;
  ReduceOp op_;
  size_t es_;
  const char* src_;
  std::vector<size_t> lo_, hi_;
  char* dst_;
  int divisor_;
  size_t piece_ = 1, mine_ = 0, npieces_ = 1, reduced_ = 0;
  char* scratch_ = nullptr;  // every other member's copy of this member's part, slot m for member m
  std::vector<char> owned_;  // the scratch when the group brings none
  std::vector<std::vector<P2POp*>> incoming_;
};

}  // namespace

void direct_all_reduce(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count,
                       int divisor, size_t piece_bytes, bool oneshot) {
  const int n = g.size(), me = g.me;
  const size_t es = dtype_size(dt);
  char* dst = static_cast<char*>(out);
  std::vector<size_t> lo(static_cast<size_t>(n)), hi(static_cast<size_t>(n));
  for (int m = 0; m < n; ++m) {
    // One-shot: every member reduces everything, from everyone's whole input.
    lo[static_cast<size_t>(m)] = oneshot ? 0 : part_begin(count, n, m);
    hi[static_cast<size_t>(m)] = oneshot ? count : part_begin(count, n, m + 1);
  }
  const size_t my_lo = lo[static_cast<size_t>(me)];
  Transfers t(g);
  OwnerReduce owner(g, t, dt, op, static_cast<const char*>(in), lo, hi, dst + my_lo * es, divisor,
                    oneshot ? count * es : piece_bytes);
  if (oneshot) {
    // In place, the result overwrites the input that the sends still read: reduce once all
    // transfers are done.
    t.run();
    owner.reduce_ready([](size_t, size_t) {});
    return;
  }
  // Each owner's reduced pieces back to every member, in the order the owner reduces them.
  for (int m = 0; m < n; ++m) {
    if (m == me) continue;
    const size_t mlo = lo[static_cast<size_t>(m)], len = hi[static_cast<size_t>(m)] - mlo;
    for (size_t k = 0; k < owner.pieces(len); ++k)
      t.add(m, false, dst + (mlo + owner.begin(len, k)) * es, (owner.begin(len, k + 1) - owner.begin(len, k)) * es);
  }
  auto send_on = [&](size_t a, size_t b) {
    for (int m = 0; m < n; ++m)
      if (m != me) t.add(m, true, dst + (my_lo + a) * es, (b - a) * es);
  };
  for (;;) {
    owner.reduce_ready(send_on);
    if (!t.step() && owner.done()) break;
  }
}

void direct_reduce_scatter(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count,
                           int divisor, size_t piece_bytes) {
  direct_reduce_scatter(g, dt, op, in, out, std::vector<size_t>(static_cast<size_t>(g.size()), count), divisor,
                        piece_bytes);
}

void direct_reduce_scatter(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out,
                           const std::vector<size_t>& counts, int divisor, size_t piece_bytes) {
  const int n = g.size();
  std::vector<size_t> lo(static_cast<size_t>(n)), hi(static_cast<size_t>(n));
  size_t at = 0;
  for (int m = 0; m < n; ++m) {
    lo[static_cast<size_t>(m)] = at;
    at += counts[static_cast<size_t>(m)];
    hi[static_cast<size_t>(m)] = at;
  }
  Transfers t(g);
  OwnerReduce owner(g, t, dt, op, static_cast<const char*>(in), lo, hi, static_cast<char*>(out), divisor, piece_bytes);
  for (;;) {
    owner.reduce_ready([](size_t, size_t) {});
    if (!t.step() && owner.done()) break;
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

void direct_exchange(const PeerGroup& g, const std::vector<DirectBlock>& sends, const std::vector<DirectBlock>& recvs) {
  Transfers t(g);
  for (const DirectBlock& b : sends) t.add(b.member, true, b.data, b.bytes);
  for (const DirectBlock& b : recvs) t.add(b.member, false, b.data, b.bytes);
  t.run();
}

}  // namespace braid
