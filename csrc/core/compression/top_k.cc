// Top-k by threshold: estimate the k-th largest magnitude from a sample, keep everything above
// it in one streaming pass, then trim the few extra candidates exactly. The full sort that an
// exact top-k needs is paid only when the sample was misleading.
#include "top_k.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "../half.h"
#include "counter_rng.h"

namespace braid {
namespace {

// Sample size: the k-th largest of 16384 draws estimates a 1% quantile within about 8% (its
// relative standard error is about 1/sqrt(k_sample) = 1/sqrt(164)), so a threshold aimed at
// 1.25 k keeps at least k candidates except on rare samples.
constexpr size_t kSample = 16384;
constexpr double kAim = 1.25;
// More candidates than this many times k means the threshold was far too low: exact path.
constexpr size_t kMaxOverselect = 4;

struct Candidate {
  float mag;
  int32_t index;
};
// Larger magnitude first; among equal magnitudes the lower index first.
inline bool before(const Candidate& a, const Candidate& b) {
  return a.mag > b.mag || (a.mag == b.mag && a.index < b.index);
}

template <class T>
void gather_above(const T* in, size_t count, float thr, size_t cap, std::vector<Candidate>& out) {
  out.clear();
  for (size_t i = 0; i < count; ++i) {
    const float m = std::fabs(load_f32(in[i]));
    if (m >= thr) {
      if (out.size() == cap) {
        out.clear();
        return;  // too many: the caller falls back to the exact path
      }
      out.push_back({m, static_cast<int32_t>(i)});
    }
  }
}

template <class T>
TopKPath select_typed(const T* in, size_t count, size_t k, float* values, int32_t* indices) {
  std::vector<Candidate> cand;
  TopKPath path = TopKPath::kExact;
  if (count > 2 * kSample && k * kSample >= 8 * count) {
    // Sampled threshold (only when the sample holds at least 8 expected winners). One draw per
    // stride of the input, at a hashed offset inside it, so periodic structure is not aliased.
    std::vector<float> s(kSample);
    const size_t stride = count / kSample;
    for (size_t j = 0; j < kSample; ++j)
      s[j] = std::fabs(load_f32(in[j * stride + mix32(static_cast<uint32_t>(j)) % stride]));
    const double want = kAim * static_cast<double>(k) * kSample / static_cast<double>(count);
    const size_t r = std::min(kSample - 1, static_cast<size_t>(want));
    std::nth_element(s.begin(), s.begin() + r, s.end(), std::greater<float>());
    gather_above(in, count, s[r], kMaxOverselect * k, cand);
    if (cand.size() >= k) path = TopKPath::kSampled;
  }
  if (path == TopKPath::kExact) {
    cand.resize(count);
    for (size_t i = 0; i < count; ++i) cand[i] = {std::fabs(load_f32(in[i])), static_cast<int32_t>(i)};
  }
  std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), before);
  cand.resize(k);
  std::sort(cand.begin(), cand.end(), [](const Candidate& a, const Candidate& b) { return a.index < b.index; });
  for (size_t j = 0; j < k; ++j) {
    indices[j] = cand[j].index;
    values[j] = load_f32(in[cand[j].index]);
  }
  return path;
}

}  // namespace

TopKPath top_k_select(DType dtype, const void* in, size_t count, size_t k, float* values, int32_t* indices) {
  k = std::min(k, count);
  if (k == 0) return TopKPath::kExact;
  switch (dtype) {
    case DType::kFloat32: return select_typed(static_cast<const float*>(in), count, k, values, indices);
    case DType::kBFloat16: return select_typed(static_cast<const BF16*>(in), count, k, values, indices);
    case DType::kFloat16: return select_typed(static_cast<const F16*>(in), count, k, values, indices);
    default: return TopKPath::kExact;
  }
}

void scatter_add(float* acc, const int32_t* indices, const float* values, size_t k) {
  for (size_t i = 0; i < k; ++i) acc[indices[i]] += values[i];
}

}  // namespace braid
