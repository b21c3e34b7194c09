// Top-k by threshold: estimate the k-th largest magnitude from a sample, keep everything above
// it in one streaming pass, then trim the few extra candidates exactly. The full sort that an
// exact top-k needs is paid only when the sample was misleading.
#include "top_k.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../half.h"
#include "counter_rng.h"

namespace braid {
namespace {

// Aim the sampled threshold at 1.25 k candidates (see kTopKSample).
constexpr double kAim = 1.25;

using Candidate = TopKCandidate;
static_assert(sizeof(Candidate) == 8 && offsetof(Candidate, index) == 4, "take_group writes 64-bit pairs");

// Candidates are ordered by magnitude, compared as bit patterns with the sign cleared: for floats
// the order is the same (a NaN, whose pattern is above infinity's, counts as the largest).
inline uint32_t mag_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b & 0x7fffffffu;
}

#if !defined(__AVX512F__) && defined(__AVX2__)
// AVX2 has no compress: a table gives, for each 4-bit hit mask, the permutation of 32-bit lanes
// that moves the hit (value, index) pairs of four elements to the front, in order.
struct PairPermutations {
  alignas(32) int32_t lanes[16][8];
};
constexpr PairPermutations make_pair_permutations() {
  PairPermutations p{};
  for (int m = 0; m < 16; ++m) {
    int o = 0;
    for (int j = 0; j < 4; ++j) {
      if ((m >> j) & 1) {
        p.lanes[m][2 * o] = 2 * j;
        p.lanes[m][2 * o + 1] = 2 * j + 1;
        ++o;
      }
    }
  }
  return p;
}
constexpr PairPermutations kPairPerm = make_pair_permutations();

// Appends the hit pairs of four elements held as interleaved (value, index) 32-bit lanes.
inline size_t take_quad(__m256i pairs, unsigned mask4, Candidate* out) {
  const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPairPerm.lanes[mask4]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(pairs, perm));
  return static_cast<size_t>(__builtin_popcount(mask4));
}
#endif

// Appends (value, index) for the first `valid` of 16 values (v[0..16) at input index `first`)
// whose magnitude is >= thr; returns how many. `out` must have room for 16.
inline size_t take_group(const float* v, int32_t first, float thr, int valid, Candidate* out) {
#if defined(__AVX512F__)
  const __m512i bits = _mm512_loadu_si512(v);
  const __m512 mag = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)));
  const __mmask16 lanes = static_cast<__mmask16>(valid >= 16 ? 0xffff : (1u << valid) - 1);
  const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes, mag, _mm512_set1_ps(thr), _CMP_GE_OQ);
  // No early exit for groups without a hit: at a few percent most groups hold one, and the
  // branch would be mispredicted often; the stores below are cheap.
  // Interleave (value, index) pairs: 64-bit lanes in Candidate's memory layout.
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(first),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i lo = _mm512_permutex2var_epi32(
      bits, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), idx);
  const __m512i hi = _mm512_permutex2var_epi32(
      bits, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), idx);
  const __mmask8 hit_lo = static_cast<__mmask8>(hit & 0xff), hit_hi = static_cast<__mmask8>(hit >> 8);
  // Compress in registers, then plain full-width stores (the memory form of compress is slow on
  // some cores; `out` has room for 16 pairs, so the lanes past the hits may be written).
  _mm512_storeu_si512(out, _mm512_maskz_compress_epi64(hit_lo, lo));
  const size_t n_lo = static_cast<size_t>(__builtin_popcount(hit_lo));
  _mm512_storeu_si512(out + n_lo, _mm512_maskz_compress_epi64(hit_hi, hi));
  return n_lo + static_cast<size_t>(__builtin_popcount(hit_hi));
#elif defined(__AVX2__)
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 t = _mm256_set1_ps(thr);
  const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
  unsigned hit = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v0, abs_mask), t, _CMP_GE_OQ))) |
                 static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v1, abs_mask), t, _CMP_GE_OQ)))
                     << 8;
  hit &= valid >= 16 ? 0xffffu : (1u << valid) - 1;
  // Most groups hold no hit at the usual ratios: without compress, skipping them is cheaper than
  // the permutations a miss would cost.
  if (hit == 0) return 0;
  size_t n = 0;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int h = 0; h < 2; ++h) {
    const __m256i bits = _mm256_castps_si256(h == 0 ? v0 : v1);
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(first + 8 * h), lane);
    const __m256i lo = _mm256_unpacklo_epi32(bits, idx);  // pairs 0 1 | 4 5
    const __m256i hi = _mm256_unpackhi_epi32(bits, idx);  // pairs 2 3 | 6 7
    const unsigned m = (hit >> (8 * h)) & 0xffu;
    n += take_quad(_mm256_permute2x128_si256(lo, hi, 0x20), m & 0xfu, out + n);
    n += take_quad(_mm256_permute2x128_si256(lo, hi, 0x31), m >> 4, out + n);
  }
  return n;
#else
  // Writes every lane and advances only past the hits (no branch to mispredict).
  size_t n = 0;
  for (int j = 0; j < valid; ++j) {
    out[n] = {v[j], first + j};
    n += std::fabs(v[j]) >= thr ? 1 : 0;
  }
  return n;
#endif
}

// Every element with |x| >= thr as (value in float32, index), in index order; empty when more
// than `cap` (the caller falls back to the exact path).
template <class T>
void gather_above(const T* in, size_t count, float thr, size_t cap, std::vector<Candidate>& out) {
  constexpr size_t kBlock = 256, kGroup = 16;
  alignas(64) float vals[kBlock];
  out.resize(cap + kGroup);  // room for `cap` candidates plus one group's writes
  size_t n = 0;
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    const float* v = vals;
    if constexpr (std::is_same_v<T, float>) {
      if (len == kBlock) v = in + base;  // float32 is read in place
    }
    if (v == vals) {
      const T* __restrict src = in + base;
      for (size_t j = 0; j < len; ++j) vals[j] = load_f32(src[j]);
      for (size_t j = len; j < kBlock; ++j) vals[j] = 0.0f;  // lanes past `len` are masked off
    }
    for (size_t g = 0; g * kGroup < len; ++g) {
      const int valid = static_cast<int>(std::min(kGroup, len - g * kGroup));
      n += take_group(v + g * kGroup, static_cast<int32_t>(base + g * kGroup), thr, valid, out.data() + n);
      if (n > cap) {
        out.clear();
        return;
      }
    }
  }
  out.resize(n);
}

// The bit pattern t of the k-th largest magnitude (1 <= k <= cand.size()) and how many
// candidates equal to t belong to the k largest (*ties; the other k - *ties are above t): a radix
// select on the upper 16 bits, over the range of bins the candidates occupy (a few hundred for
// candidates above a sampled threshold: no 65536-bin histogram to clear and scan), then an
// nth_element over the lower 16 bits of the candidates in the bin that holds t.
uint32_t kth_largest_bits(const std::vector<Candidate>& cand, size_t k, size_t* ties) {
  uint32_t top = 0, bottom = 0xffff;
  for (const Candidate& c : cand) {
    const uint32_t u = mag_bits(c.value) >> 16;
    top = std::max(top, u);
    bottom = std::min(bottom, u);
  }
  std::vector<uint32_t> hist(top - bottom + 1, 0);
  for (const Candidate& c : cand) ++hist[(mag_bits(c.value) >> 16) - bottom];
  size_t need = k;  // rank still to descend, counted from the top of the remaining bins
  uint32_t hi = top;
  for (;; --hi) {
    if (hist[hi - bottom] >= need) break;
    need -= hist[hi - bottom];
  }
  std::vector<uint32_t> low;
  low.reserve(hist[hi - bottom]);
  for (const Candidate& c : cand) {
    const uint32_t b = mag_bits(c.value);
    if ((b >> 16) == hi) low.push_back(b & 0xffff);
  }
  std::nth_element(low.begin(), low.begin() + (need - 1), low.end(), std::greater<uint32_t>());
  const uint32_t lo = low[need - 1];
  // After nth_element the elements before position need - 1 are >= lo: those above lo are the
  // ones ranked before t; the rest of the need are ties.
  size_t above = 0;
  for (size_t j = 0; j + 1 < need; ++j) above += low[j] > lo;
  *ties = need - above;
  return (hi << 16) | lo;
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
    for (size_t i = 0; i < count; ++i) cand[i] = {load_f32(in[i]), static_cast<int32_t>(i)};
  }
  top_k_trim(cand, k);
  for (size_t j = 0; j < k; ++j) {
    indices[j] = cand[j].index;
    values[j] = cand[j].value;
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
  if (k >= cand.size()) return;
  if (k == 0) {
    cand.clear();
    return;
  }
  size_t ties = 0, kept = 0;
  const uint32_t t = kth_largest_bits(cand, k, &ties);
  for (const Candidate& c : cand) {
    const uint32_t b = mag_bits(c.value);
    const bool keep = b > t || (b == t && ties > 0);
    if (b == t && keep) --ties;
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
