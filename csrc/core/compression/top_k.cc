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

// Aim the sampled threshold at 1.25 k candidates (see kTopKSample).
constexpr double kAim = 1.25;

using Candidate = TopKCandidate;
template <class T>
void gather_above(const T* in, size_t count, float thr, size_t cap, std::vector<Candidate>& out) {
  // Blocks of 256 magnitudes; hits counted per group of 16 in vectorized loops, and only groups
  // with a hit scanned element by element (at k = 1% about one group in seven).
  constexpr size_t kBlock = 256, kGroup = 16;
  alignas(64) float mags[kBlock];
  int32_t hits[kBlock / kGroup];
  // Room for `cap` candidates plus one block: the scan below writes every element of a group and
  // advances only past the hits (no branch to mispredict), so it may write one group past the end.
  out.resize(cap + kBlock);
  size_t n = 0;
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    const T* __restrict src = in + base;
    for (size_t j = 0; j < len; ++j) mags[j] = std::fabs(load_f32(src[j]));
    for (size_t j = len; j < kBlock; ++j) mags[j] = -1.0f;  // the tail of the last block never hits
    int32_t total = 0;
    for (size_t g = 0; g < kBlock / kGroup; ++g) {
      int32_t h = 0;
      for (size_t j = 0; j < kGroup; ++j) h += mags[g * kGroup + j] >= thr ? 1 : 0;
      hits[g] = h;
      total += h;
    }
    if (total == 0) continue;
    if (n + static_cast<size_t>(total) > cap) {
      out.clear();
      return;  // too many: the caller falls back to the exact path
    }
    for (size_t g = 0; g < kBlock / kGroup; ++g) {
      if (hits[g] == 0) continue;
      for (size_t j = g * kGroup; j < (g + 1) * kGroup; ++j) {
        out[n] = {mags[j], static_cast<int32_t>(base + j)};
        n += mags[j] >= thr ? 1 : 0;
      }
    }
  }
  out.resize(n);
}

template <class T>
TopKPath select_typed(const T* in, size_t count, size_t k, float* values, int32_t* indices) {
  std::vector<Candidate> cand;
  TopKPath path = TopKPath::kExact;
  size_t r = 0, stride = 0;
  if (top_k_sampled(count, k, &r, &stride)) {
    std::vector<float> s(kTopKSample);
    for (size_t j = 0; j < kTopKSample; ++j) s[j] = std::fabs(load_f32(in[top_k_sample_index(j, stride)]));
    std::nth_element(s.begin(), s.begin() + r, s.end(), std::greater<float>());
    gather_above(in, count, s[r], kTopKMaxOverselect * k, cand);
    if (cand.size() >= k) path = TopKPath::kSampled;
  }
  if (path == TopKPath::kExact) {
    cand.resize(count);
    for (size_t i = 0; i < count; ++i) cand[i] = {std::fabs(load_f32(in[i])), static_cast<int32_t>(i)};
  }
  top_k_trim(cand, k);
  for (size_t j = 0; j < k; ++j) {
    indices[j] = cand[j].index;
    values[j] = load_f32(in[cand[j].index]);
  }
  return path;
}

}  // namespace

bool top_k_sampled(size_t count, size_t k, size_t* sample_rank, size_t* stride) {
  // Only when the sample holds at least 8 expected winners and the input is well over the sample.
  if (count <= 2 * kTopKSample || k * kTopKSample < 8 * count) return false;
  const double want = kAim * static_cast<double>(k) * kTopKSample / static_cast<double>(count);
  *sample_rank = std::min(kTopKSample - 1, static_cast<size_t>(want));
  *stride = count / kTopKSample;
  return true;
}

void top_k_trim(std::vector<TopKCandidate>& cand, size_t k) {
  // The k-th largest magnitude t; then one pass in index order keeps everything above t and the
  // lowest-index elements equal to t. The candidates stay in index order: no sort needed.
  std::vector<float> mags(cand.size());
  for (size_t i = 0; i < cand.size(); ++i) mags[i] = cand[i].mag;
  std::nth_element(mags.begin(), mags.begin() + (k - 1), mags.end(), std::greater<float>());
  const float t = mags[k - 1];
  size_t above = 0;
  for (const Candidate& c : cand) above += c.mag > t ? 1 : 0;
  size_t ties = k - above, kept = 0;
  for (const Candidate& c : cand) {
    const bool keep = c.mag > t || (c.mag == t && ties > 0);
    if (c.mag == t && keep) --ties;
    if (keep) cand[kept++] = c;
  }
  cand.resize(kept);
}

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
