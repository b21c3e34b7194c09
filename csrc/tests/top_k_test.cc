// Top-k selection (braid::top_k_select, braid::top_k_trim) against a sort, bit for bit, on both
// paths (sampled threshold and exact), at sizes around the candidate pass's groups and blocks,
// with ties, zeros, infinities and NaNs, for float32, bfloat16 and float16 inputs. Under the sanitizer
// builds this also covers the vector loops' slack and masked stores.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "check.h"
#include "core/compression/top_k.h"
#include "core/half.h"

using braid::DType;
using braid::TopKPath;
using namespace braid_test;

namespace {

uint32_t mag_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b & 0x7fffffffu;
}

// The k largest magnitudes of x (ties to the lower index), as indices in ascending order.
std::vector<int32_t> reference_top_k(const std::vector<float>& x, size_t k) {
  std::vector<int32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return mag_bits(x[a]) > mag_bits(x[b]); });
  order.resize(std::min(k, x.size()));
  std::sort(order.begin(), order.end());
  return order;
}

// Values of one of several shapes: normal with a per-block scale, many ties, mostly zeros,
// normal with a few infinities, or normal with a few NaNs (which rank above every number).
std::vector<float> make_values(std::mt19937_64& rng, size_t count, int shape) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> u;
  std::vector<float> x(count);
  for (size_t i = 0; i < count; ++i) {
    float v = normal(rng) * static_cast<float>(1 + (i / 256) % 5);
    if (shape == 1) v = std::round(v * 2) / 2;
    if (shape == 2 && u(rng) < 0.9f) v = (u(rng) < 0.5f) ? 0.0f : -0.0f;
    if (shape == 3 && u(rng) < 0.001f) v = u(rng) < 0.5f ? INFINITY : -INFINITY;
    if (shape == 4 && u(rng) < 0.002f) v = u(rng) < 0.5f ? NAN : -NAN;
    x[i] = v;
  }
  return x;
}

// Checks one selection from `in` (of dtype dt) whose float32 values are x.
void check_selection(DType dt, const void* in, const std::vector<float>& x, size_t k, const char* what,
                     int* sampled) {
  const size_t kk = std::min(k, x.size());
  // One spare element on each side, to catch writes outside [0, k).
  std::vector<float> values(kk + 2, 123.0f);
  std::vector<int32_t> indices(kk + 2, -7);
  const TopKPath path = braid::top_k_select(dt, in, x.size(), k, values.data() + 1, indices.data() + 1);
  *sampled += path == TopKPath::kSampled;
  const std::vector<int32_t> want = reference_top_k(x, k);
  bool same = true;
  for (size_t j = 0; j < kk && same; ++j) {
    same = indices[j + 1] == want[j] && mag_bits(values[j + 1]) == mag_bits(x[want[j]]) &&
           std::signbit(values[j + 1]) == std::signbit(x[want[j]]);
  }
  CHECK_MSG(same, std::string(what) + ": selection differs from the sort");
  CHECK_MSG(values[0] == 123.0f && values[kk + 1] == 123.0f && indices[0] == -7 && indices[kk + 1] == -7,
            std::string(what) + ": wrote outside the output");
}

}  // namespace

BRAID_TEST(top_k_matches_a_sort_on_both_paths) {
  std::mt19937_64 rng(42);
  const size_t counts[] = {1, 15, 16, 17, 255, 256, 257, 4099, 40000, 65537, 200003};
  const double ratios[] = {0.001, 0.01, 0.05, 0.3, 1.0};
  int sampled = 0, cases = 0;
  for (int shape = 0; shape < 5; ++shape) {
    for (size_t count : counts) {
      for (double ratio : ratios) {
        const size_t k = std::max<size_t>(1, static_cast<size_t>(ratio * static_cast<double>(count)));
        std::vector<float> x = make_values(rng, count, shape);
        const std::string what = "shape " + std::to_string(shape) + " count " + std::to_string(count) + " k " +
                                 std::to_string(k);
        check_selection(DType::kFloat32, x.data(), x, k, (what + " float32").c_str(), &sampled);
        // 16-bit inputs: the selection is over their float32 values.
        std::vector<uint16_t> b(count), h(count);
        std::vector<float> xb(count), xh(count);
        for (size_t i = 0; i < count; ++i) {
          b[i] = braid::f32_to_bf16(x[i]);
          h[i] = braid::f32_to_f16(x[i]);
          xb[i] = braid::bf16_to_f32(b[i]);
          xh[i] = braid::f16_to_f32(h[i]);
        }
        check_selection(DType::kBFloat16, b.data(), xb, k, (what + " bfloat16").c_str(), &sampled);
        check_selection(DType::kFloat16, h.data(), xh, k, (what + " float16").c_str(), &sampled);
        cases += 3;
      }
    }
  }
  // Both paths ran: the sampled threshold on the larger inputs, the exact one elsewhere.
  CHECK_MSG(sampled > 20 && sampled < cases - 20, "sampled " + std::to_string(sampled) + " of " +
                                                       std::to_string(cases));
}

BRAID_TEST(top_k_trim_keeps_ties_at_the_lowest_indices) {
  // Magnitudes 3, 2, 2, 2, 1 at indices 10..14 (signs mixed): k = 3 keeps 3 and the first two 2s.
  const float v[] = {-3.0f, 2.0f, -2.0f, 2.0f, 1.0f};
  const int32_t idx[] = {10, 11, 12, 13, 14};
  float out_v[3];
  int32_t out_i[3];
  braid::top_k_trim(v, idx, 5, 3, out_v, out_i);
  CHECK_EQ(out_i[0], 10);
  CHECK_EQ(out_i[1], 11);
  CHECK_EQ(out_i[2], 12);
  CHECK_EQ(out_v[2], -2.0f);
  // k >= c copies everything.
  float all_v[5];
  int32_t all_i[5];
  braid::top_k_trim(v, idx, 5, 9, all_v, all_i);
  CHECK(std::equal(all_i, all_i + 5, idx) && std::memcmp(all_v, v, sizeof v) == 0);
}
