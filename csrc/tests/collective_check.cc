// Regenerable inputs, exact references and message sizes for the collective tests.
#include "collective_check.h"

#include <cstring>
#include <set>
#include <sstream>
#include <stdexcept>

#include "check.h"
#include "core/algorithms/algorithms.h"

namespace braid_test {
namespace {

using braid::CollKind;
using braid::ReduceOp;

// Outside every value a correct call can produce: a destination element that still holds
// kJunk was not written, a guard that no longer holds kGuard was overwritten.
constexpr double kJunk = 55, kGuard = 77;

// Small integers: every sum (|x| <= 4 * 9), product (|x| <= 2^4) and quotient of them is
// computed exactly, or rounded exactly once, in every dtype, whatever order the algorithm
// reduces in. So the references below are exact, and every rank must match them bit for bit.
double input_value(ReduceOp op, int rank, int call, size_t i) {
  uint64_t h = (static_cast<uint64_t>(rank) + 1) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(call) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(i) * 0x165667B19E3779F9ull;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  if (op == ReduceOp::kProd) {
    constexpr double kFactors[4] = {-2, -1, 1, 2};
    return kFactors[h % 4];
  }
  return static_cast<double>(h % 19) - 9;
}

void fill_input(Buffer& b, size_t at, const CallSpec& s, int rank, size_t from, size_t len) {
  for (size_t i = 0; i < len; ++i) b.set(at + i, input_value(s.op, rank, s.call, from + i));
}

void fill_value(Buffer& b, size_t at, size_t len, double v) {
  for (size_t i = 0; i < len; ++i) b.set(at + i, v);
}

// dst[at + i] = reduction over all ranks of their input element from + i, in the accumulator
// type, divided once for avg, rounded once.
void fill_reduction(Buffer& dst, size_t at, const CallSpec& s, int world, size_t from, size_t len) {
  visit_dtype(s.dtype, [&](auto ref) {
    using R = decltype(ref);
    using Acc = typename R::Acc;
    for (size_t i = 0; i < len; ++i) {
      Acc a{};
      for (int r = 0; r < world; ++r) {
        const Acc x = R::load(R::store(static_cast<Acc>(input_value(s.op, r, s.call, from + i))));
        a = r == 0 ? x : ref_apply(s.op, a, x);
      }
      if (s.op == ReduceOp::kAvg && world > 1) a = a / static_cast<Acc>(world);
      const typename R::T t = R::store(a);
      std::memcpy(dst.at(at + i), &t, sizeof(t));
    }
  });
}

}  // namespace

braid::Tunables tiny_tunables(braid::Algo algo) {
  braid::Tunables t;
  t.algo = algo;
  t.slot_bytes = 1024;
  t.oneshot_max_bytes = 256;
  t.nslots = 2;
  return t;
}

std::string describe(const CallSpec& s) {
  std::ostringstream o;
  o << braid::coll_kind_name(s.kind) << " call " << s.call << " " << braid::dtype_name(s.dtype) << " count "
    << s.count;
  if (s.kind == CollKind::kAllReduce || s.kind == CollKind::kReduceScatter) o << " op " << braid::reduce_op_name(s.op);
  if (s.kind == CollKind::kBroadcast) o << " root " << s.root;
  if (s.in_place) o << " in place";
  return o.str();
}

PreparedCall::PreparedCall(const CallSpec& spec, int rank, int world)
    : spec_(spec), rank_(rank), in_(spec.dtype, 0), out_(spec.dtype, 0), expected_(spec.dtype, 0), result_(&in_) {
  const braid::DType dt = spec.dtype;
  const size_t m = spec.count, n = static_cast<size_t>(world), me = static_cast<size_t>(rank);
  switch (spec.kind) {
    case CollKind::kAllReduce:
      in_ = Buffer(dt, m + 1);
      fill_input(in_, 0, spec, rank, 0, m);
      expected_ = Buffer(dt, m + 1);
      fill_reduction(expected_, 0, spec, world, 0, m);
      break;
    case CollKind::kReduceScatter:
      in_ = Buffer(dt, n * m + 1);
      fill_input(in_, 0, spec, rank, 0, n * m);
      if (spec.in_place) {
        // The other ranks' parts of the input must come out untouched.
        expected_ = in_;
        fill_reduction(expected_, me * m, spec, world, me * m, m);
      } else {
        expected_ = Buffer(dt, m + 1);
        fill_reduction(expected_, 0, spec, world, me * m, m);
      }
      break;
    case CollKind::kAllGather:
      out_ = Buffer(dt, n * m + 1);
      fill_value(out_, 0, n * m, kJunk);
      if (spec.in_place) {
        fill_input(out_, me * m, spec, rank, 0, m);
      } else {
        in_ = Buffer(dt, m + 1);
        fill_input(in_, 0, spec, rank, 0, m);
      }
      expected_ = Buffer(dt, n * m + 1);
      for (int j = 0; j < world; ++j) fill_input(expected_, static_cast<size_t>(j) * m, spec, j, 0, m);
      break;
    case CollKind::kAllToAll:
      // Chunk j of the output is rank j's input chunk `me` (never in place).
      in_ = Buffer(dt, n * m + 1);
      fill_input(in_, 0, spec, rank, 0, n * m);
      out_ = Buffer(dt, n * m + 1);
      fill_value(out_, 0, n * m, kJunk);
      expected_ = Buffer(dt, n * m + 1);
      for (int j = 0; j < world; ++j) fill_input(expected_, static_cast<size_t>(j) * m, spec, j, me * m, m);
      break;
    case CollKind::kBroadcast:
      in_ = Buffer(dt, m + 1);
      if (rank == spec.root) {
        fill_input(in_, 0, spec, rank, 0, m);
      } else {
        fill_value(in_, 0, m, kJunk);
      }
      expected_ = Buffer(dt, m + 1);
      fill_input(expected_, 0, spec, spec.root, 0, m);
      break;
    case CollKind::kBarrier:
      return;
    case CollKind::kSend:
    case CollKind::kRecv:
    case CollKind::kExchange:
      throw std::logic_error("point-to-point calls are checked in p2p_test.cc");
  }
  const bool reduces = spec.kind == CollKind::kAllReduce || spec.kind == CollKind::kReduceScatter;
  if (reduces && !spec.in_place) {
    out_ = Buffer(dt, m + 1);
    fill_value(out_, 0, m, kJunk);
  }
  const bool to_out = spec.kind == CollKind::kAllGather || spec.kind == CollKind::kAllToAll;
  Buffer& result = to_out || (reduces && !spec.in_place) ? out_ : in_;
  result.set(result.count() - 1, kGuard);
  expected_.set(expected_.count() - 1, kGuard);
  result_ = &result;
}

braid::Request PreparedCall::request() {
  braid::Request r;
  r.kind = spec_.kind;
  r.dtype = spec_.dtype;
  r.op = spec_.op;
  r.count = spec_.count;
  r.root = spec_.root;
  const size_t m = spec_.count, me = static_cast<size_t>(rank_);
  switch (spec_.kind) {
    case CollKind::kAllReduce:
      r.in = in_.data();
      r.out = spec_.in_place ? in_.data() : out_.data();
      break;
    case CollKind::kReduceScatter:
      r.in = in_.data();
      r.out = spec_.in_place ? in_.at(me * m) : out_.data();
      break;
    case CollKind::kAllGather:
      r.in = spec_.in_place ? out_.at(me * m) : in_.data();
      r.out = out_.data();
      break;
    case CollKind::kAllToAll:
      r.in = in_.data();
      r.out = out_.data();
      break;
    case CollKind::kBroadcast:
      r.in = in_.data();
      r.out = in_.data();
      break;
    case CollKind::kBarrier:
    case CollKind::kSend:
    case CollKind::kRecv:
    case CollKind::kExchange:
      break;
  }
  return r;
}

void PreparedCall::check() const {
  const std::string diff = compare(spec_.dtype, result_->data(), expected_.data(), expected_.count());
  CHECK_MSG(diff.empty(), describe(spec_) + " on rank " + std::to_string(rank_) + ": " + diff);
}

void run_and_check(braid::Communicator& comm, const CallSpec& spec) {
  PreparedCall call(spec, comm.rank(), comm.world_size());
  try {
    comm.submit(call.request(), false);
  } catch (const std::exception& e) {
    // The rank cannot go on after an error: its body ends here and reports this message.
    throw std::runtime_error(describe(spec) + " on rank " + std::to_string(comm.rank()) + " threw: " + e.what());
  }
  call.check();
}

std::vector<size_t> interesting_counts(CollKind kind, braid::Algo algo, braid::DType dtype, int world) {
  if (kind == CollKind::kBarrier) return {0};
  const braid::Tunables t = tiny_tunables(algo);
  const size_t es = braid::dtype_size(dtype), n = static_cast<size_t>(world);
  size_t oneshot_limit = t.oneshot_max_bytes / es, block = 0;
  switch (kind) {
    case CollKind::kAllReduce:
      // Forced one-shot falls back to two-shot above the limit, like auto.
      block = algo == braid::Algo::kRing ? n * braid::slot_elems(t.slot_bytes, 1, braid::acc_size(dtype))
                                         : n * braid::slot_elems(t.slot_bytes, n + 1, es);
      break;
    case CollKind::kReduceScatter:
    case CollKind::kAllToAll:
      oneshot_limit = t.oneshot_max_bytes / (es * n);
      block = braid::slot_elems(t.slot_bytes, n, es);
      break;
    default:
      block = braid::slot_elems(t.slot_bytes, 1, es);
      break;
  }
  std::set<size_t> counts = {0, 1, 2, 3, 5, 13, 61, 127};
  for (size_t c : {oneshot_limit - 1, oneshot_limit, oneshot_limit + 1}) counts.insert(c);
  for (size_t k : {size_t(1), static_cast<size_t>(t.nslots), static_cast<size_t>(t.nslots) + 1})
    for (size_t c : {k * block - 1, k * block, k * block + 1}) counts.insert(c);
  return {counts.begin(), counts.end()};
}

}  // namespace braid_test
