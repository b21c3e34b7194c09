// Reduction kernels (braid::reduce_n) against the scalar references, bit for bit.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "core/half.h"
#include "core/reduce.h"
#include "reference.h"

using braid::DType;
using braid::Operand;
using braid::ReduceOp;
using namespace braid_test;

namespace {

// Counts around the kernel's 512-element block, and ones that are not multiples of it.
constexpr size_t kCounts[] = {0, 1, 7, 511, 512, 513, 1000, 1537};

// Random values of the element type: any float in [-4, 4] (products of five stay far from
// overflow), integers small enough that no sum or product of five overflows. Every 97th element
// of the second source is NaN so that propagation is checked too.
template <class R>
std::vector<typename R::T> random_elems(std::mt19937_64& rng, size_t count, ReduceOp op, bool with_nan) {
  std::vector<typename R::T> v(count);
  for (size_t i = 0; i < count; ++i) {
    using T = typename R::T;
    using Acc = typename R::Acc;
    if constexpr (std::is_floating_point_v<Acc>) {
      Acc x = std::uniform_real_distribution<Acc>(-4, 4)(rng);
      if (with_nan && i % 97 == 5) x = std::numeric_limits<Acc>::quiet_NaN();
      v[i] = R::store(x);
    } else {
      const T bound = op == ReduceOp::kProd ? 5 : 100000;
      v[i] = std::uniform_int_distribution<T>(-bound, bound)(rng);
    }
  }
  return v;
}

// Partial results (the accumulator type) as the ring produces them: not representable in a
// half type, which is what they are for.
template <class R>
std::vector<typename R::Acc> random_accs(std::mt19937_64& rng, size_t count, ReduceOp op) {
  using Acc = typename R::Acc;
  std::vector<Acc> v(count);
  for (auto& x : v) {
    if constexpr (std::is_floating_point_v<Acc>) {
      x = std::uniform_real_distribution<Acc>(-4, 4)(rng);
    } else {
      const Acc bound = op == ReduceOp::kProd ? 5 : 100000;
      x = std::uniform_int_distribution<Acc>(-bound, bound)(rng);
    }
  }
  return v;
}

enum class Variant {
  kPlain,     // element-type sources and destination
  kFinalize,  // the last step of avg (division by the world size) applied
  kAccIn,     // the first source holds partial results in the accumulator type
  kAccOut,    // the destination receives the accumulator type (a partial result)
  kDst2,      // a second destination receives the same values
  kInPlace,   // the destination is the last source
};
constexpr Variant kVariants[] = {Variant::kPlain, Variant::kFinalize, Variant::kAccIn,
                                 Variant::kAccOut, Variant::kDst2, Variant::kInPlace};

template <class R>
void check_reduce(DType dt, ReduceOp op, int nsrc, size_t count, Variant variant, std::mt19937_64& rng) {
  using T = typename R::T;
  using Acc = typename R::Acc;
  constexpr int kWorld = 3;  // avg divides by 3: inexact in binary, so the rounding shows
  const bool acc_in = variant == Variant::kAccIn, acc_out = variant == Variant::kAccOut;
  const bool finalize = variant == Variant::kFinalize;

  std::vector<std::vector<T>> elems(nsrc);
  std::vector<Acc> accs;
  std::vector<Operand> srcs(nsrc);
  for (int j = 0; j < nsrc; ++j) {
    if (j == 0 && acc_in) {
      accs = random_accs<R>(rng, count, op);
      srcs[j] = {accs.data(), true};
    } else {
      elems[j] = random_elems<R>(rng, count, op, j == 1);
      srcs[j] = {elems[j].data(), false};
    }
  }

  // Left to right in the accumulator type, rounded once at the end.
  std::vector<Acc> want_acc(count);
  for (size_t i = 0; i < count; ++i) {
    Acc a = srcs[0].acc ? accs[i] : R::load(elems[0][i]);
    for (int j = 1; j < nsrc; ++j) a = ref_apply(op, a, R::load(elems[j][i]));
    if (finalize && op == ReduceOp::kAvg) a = a / static_cast<Acc>(kWorld);
    want_acc[i] = a;
  }

  const std::string where = std::string(braid::dtype_name(dt)) + " " + braid::reduce_op_name(op) +
                            " nsrc " + std::to_string(nsrc) + " count " + std::to_string(count) +
                            " variant " + std::to_string(static_cast<int>(variant));
  if (acc_out) {
    std::vector<Acc> got(count + 1);
    braid::reduce_n(dt, op, srcs.data(), nsrc, braid::ReduceDst::partial(got.data()), count);
    // The accumulator of a half type is float32, of the others the element type itself.
    const DType acc_dt = std::is_same_v<Acc, float> ? DType::kFloat32 : dt;
    const std::string diff = compare(acc_dt, got.data(), want_acc.data(), count);
    CHECK_MSG(diff.empty(), where + ": " + diff);
    return;
  }
  std::vector<T> want(count + 1);
  for (size_t i = 0; i < count; ++i) want[i] = R::store(want_acc[i]);

  std::vector<T> got(count + 1), got2(count + 1);
  void* dst = got.data();
  if (variant == Variant::kInPlace && nsrc > 1) dst = elems[nsrc - 1].data();
  braid::ReduceDst to;
  to.ptr = dst;
  to.copy = variant == Variant::kDst2 ? got2.data() : nullptr;
  to.finalize = finalize;
  to.world_size = kWorld;
  braid::reduce_n(dt, op, srcs.data(), nsrc, to, count);
  const std::string diff = compare(dt, dst, want.data(), count);
  CHECK_MSG(diff.empty(), where + ": " + diff);
  if (variant == Variant::kDst2) {
    const std::string diff2 = compare(dt, got2.data(), want.data(), count);
    CHECK_MSG(diff2.empty(), where + " (dst2): " + diff2);
  }
}

uint16_t bits16(const Buffer& b, size_t i) {
  uint16_t v;
  std::memcpy(&v, static_cast<const char*>(b.data()) + 2 * i, 2);
  return v;
}

// Reduces the given per-source scalars (one element each) and returns the result element.
Buffer reduce_scalars(DType dt, ReduceOp op, const std::vector<double>& values, int world, bool finalize) {
  std::vector<Buffer> ins;
  for (double v : values) {
    ins.emplace_back(dt, 1);
    ins.back().set(0, v);
  }
  std::vector<Operand> srcs;
  for (auto& b : ins) srcs.push_back({b.data(), false});
  Buffer out(dt, 1);
  braid::ReduceDst to;
  to.ptr = out.data();
  to.finalize = finalize;
  to.world_size = world;
  braid::reduce_n(dt, op, srcs.data(), static_cast<int>(srcs.size()), to, 1);
  return out;
}

}  // namespace

// The references themselves, on values whose rounding is known by hand.
BRAID_TEST(half_references_round_to_nearest_even) {
  CHECK_EQ(ref_f32_to_f16(65504.0f), 0x7BFF);            // largest finite
  CHECK_EQ(ref_f32_to_f16(65519.0f), 0x7BFF);            // below the halfway point to 2^16
  CHECK_EQ(ref_f32_to_f16(65520.0f), 0x7C00);            // halfway: rounds to even, which is inf
  CHECK_EQ(ref_f32_to_f16(1.0f + 0x1p-11f), 0x3C00);      // tie, even neighbour below
  CHECK_EQ(ref_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3C02);  // tie, even neighbour above
  CHECK_EQ(ref_f32_to_f16(0x1p-24f), 0x0001);             // smallest subnormal
  CHECK_EQ(ref_f32_to_f16(0x1p-25f), 0x0000);             // tie with zero: even is zero
  CHECK_EQ(ref_f32_to_f16(-2.0f), 0xC000);
  CHECK_EQ(ref_f32_to_bf16(1.0f + 0x1p-8f), 0x3F80);
  CHECK_EQ(ref_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3F82);
  CHECK_EQ(ref_f32_to_bf16(3.3895314e38f), 0x7F7F);       // largest finite bf16 stays finite
  CHECK_EQ(ref_f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
  CHECK_EQ(ref_f32_to_bf16(-std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  // Every finite half value survives the round trip.
  int bad_f16 = 0, bad_bf16 = 0;
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const auto x = static_cast<uint16_t>(h);
    if ((x & 0x7C00) != 0x7C00 && ref_f32_to_f16(ref_f16_to_f32(x)) != x) ++bad_f16;
    if ((x & 0x7F80) != 0x7F80 && ref_f32_to_bf16(ref_bf16_to_f32(x)) != x) ++bad_bf16;
  }
  CHECK_EQ(bad_f16, 0);
  CHECK_EQ(bad_bf16, 0);
}

// The kernels' own float16 conversions (bit arithmetic that vectorizes) against the references:
// every float16 pattern one way; the other way every rounding case (just below, at and just above
// the halfway point, with both parities) for each of the 2^19 upper bit patterns of a float32,
// which covers every exponent (subnormal results, overflow, infinities and NaNs included), and a
// hashed sample of all the other low bits.
BRAID_TEST(float16_conversions_match_the_reference_bit_for_bit) {
  // float16 -> float32: the scalar function and the array one (F16C where built with it; an
  // odd count leaves a scalar tail).
  std::vector<uint16_t> halves(0x10000);
  for (uint32_t h = 0; h <= 0xFFFF; ++h) halves[h] = static_cast<uint16_t>(h);
  std::vector<float> wide(halves.size());
  braid::f16_to_f32_n(halves.data(), wide.data(), 0xFFFF);
  wide[0xFFFF] = braid::f16_to_f32(0xFFFF);
  int bad = 0;
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float want = ref_f16_to_f32(static_cast<uint16_t>(h));
    for (float got : {braid::f16_to_f32(static_cast<uint16_t>(h)), wide[h]})
      if (std::isnan(want) ? !std::isnan(got) : std::memcmp(&got, &want, 4) != 0) ++bad;
  }
  CHECK_EQ(bad, 0);
  // float32 -> float16, in batches through both functions.
  std::vector<float> batch;
  std::vector<uint16_t> narrow;
  auto flush = [&] {
    narrow.resize(batch.size());
    braid::f32_to_f16_n(batch.data(), narrow.data(), batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      const uint16_t want = ref_f32_to_f16(batch[i]);
      if (narrow[i] != want || braid::f32_to_f16(batch[i]) != want) ++bad;
    }
    batch.clear();
  };
  auto check = [&](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    batch.push_back(f);
    if (batch.size() == 4099) flush();
  };
  for (uint32_t hi = 0; hi < (1u << 19); ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x0FFFu, 0x1000u, 0x1001u, 0x1FFFu})
      check((hi << 13) | lo);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < (1 << 22); ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
    check(static_cast<uint32_t>(x >> 16));
  }
  flush();
  CHECK_EQ(bad, 0);
}

BRAID_TEST(reduce_n_matches_reference_for_every_dtype_and_op) {
  std::mt19937_64 rng(1234);
  for (DType dt : kAllDTypes)
    for (ReduceOp op : kAllOps)
      for (int nsrc : {1, 2, 3, 5})
        for (size_t count : kCounts)
          for (Variant v : kVariants)
            visit_dtype(dt, [&](auto r) { check_reduce<decltype(r)>(dt, op, nsrc, count, v, rng); });
}

BRAID_TEST(bitwise_ops_match_reference_for_integers) {
  std::mt19937_64 rng(4321);
  for (DType dt : {DType::kInt32, DType::kInt64})
    for (ReduceOp op : kBitwiseOps)
      for (int nsrc : {1, 2, 3, 5})
        for (size_t count : kCounts)
          for (Variant v : kVariants)
            visit_dtype(dt, [&](auto r) { check_reduce<decltype(r)>(dt, op, nsrc, count, v, rng); });
}

// Rounding each partial sum to the half type would lose the +1s; float32 accumulation keeps them.
BRAID_TEST(half_types_accumulate_in_float32_and_round_once) {
  const Buffer bf = reduce_scalars(DType::kBFloat16, ReduceOp::kSum, {256, 1, 1}, 3, true);
  CHECK_EQ(bf.get(0), 258.0);  // stepwise bf16: 256 + 1 -> 256 (tie to even), + 1 -> 256
  const Buffer h = reduce_scalars(DType::kFloat16, ReduceOp::kSum, {2048, 1, 1}, 3, true);
  CHECK_EQ(h.get(0), 2050.0);
  // avg divides the float32 sum, then rounds: 5 / 3 = 1.66666663f -> bf16 1.6640625 (0x3FD5).
  const Buffer avg = reduce_scalars(DType::kBFloat16, ReduceOp::kAvg, {1, 2, 2}, 3, true);
  CHECK_EQ(bits16(avg, 0), 0x3FD5);
}

BRAID_TEST(bfloat16_nan_becomes_0x7FC0) {
  std::vector<uint16_t> a = {0xFFC1, 0x7F80, 0x3F80}, b = {0x3F80, 0xFF80, 0x7FA0};  // -NaN, inf/-inf, sNaN
  const Operand srcs[2] = {{a.data(), false}, {b.data(), false}};
  std::vector<uint16_t> out(3);
  braid::reduce_n(DType::kBFloat16, ReduceOp::kSum, srcs, 2, braid::ReduceDst::result(out.data(), 2), 3);
  for (uint16_t v : out) CHECK_EQ(v, 0x7FC0);
}

// One operand reduced in place with avg: the finalization alone divides by the world size.
BRAID_TEST(avg_of_one_operand_in_place_divides_by_world_size) {
  std::mt19937_64 rng(99);
  for (DType dt : kAllDTypes)
    for (size_t count : kCounts)
      visit_dtype(dt, [&](auto r) {
        using R = decltype(r);
        using Acc = typename R::Acc;
        auto data = random_elems<R>(rng, count, ReduceOp::kSum, false);
        std::vector<typename R::T> want(count + 1);
        for (size_t i = 0; i < count; ++i) want[i] = R::store(R::load(data[i]) / static_cast<Acc>(3));
        const Operand self{data.data(), false};
        braid::reduce_n(dt, ReduceOp::kAvg, &self, 1, braid::ReduceDst::result(data.data(), 3), count);
        const std::string diff = compare(dt, data.data(), want.data(), count);
        CHECK_MSG(diff.empty(), std::string(braid::dtype_name(dt)) + " count " + std::to_string(count) + ": " + diff);
      });
}

// Integer sums wrap around like torch's. Signed overflow is undefined behaviour in C++, so the
// kernel must not rely on it: UBSan (make sanitize) reports it when it does.
BRAID_TEST(integer_sum_wraps_on_overflow) {
  const int32_t a32[2] = {std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  const int32_t b32[2] = {1, -1};
  const Operand s32[2] = {{a32, false}, {b32, false}};
  int32_t o32[2];
  braid::reduce_n(DType::kInt32, ReduceOp::kSum, s32, 2, braid::ReduceDst::result(o32, 2), 2);
  CHECK_EQ(o32[0], std::numeric_limits<int32_t>::min());
  CHECK_EQ(o32[1], std::numeric_limits<int32_t>::max());
  const int64_t a64[1] = {std::numeric_limits<int64_t>::max()}, b64[1] = {1};
  const Operand s64[2] = {{a64, false}, {b64, false}};
  int64_t o64[1];
  braid::reduce_n(DType::kInt64, ReduceOp::kSum, s64, 2, braid::ReduceDst::result(o64, 2), 1);
  CHECK_EQ(o64[0], std::numeric_limits<int64_t>::min());
}
