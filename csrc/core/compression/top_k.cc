// Top-k by threshold: estimate the k-th largest magnitude from a sample, keep everything above
// it in one streaming pass, then trim the few extra candidates exactly. The full sort that an
// exact top-k needs is paid only when the sample was misleading.
//
// Candidates are kept as two arrays, values and indices (not as pairs): the streaming pass
// compacts each with one compress, the trim reads only the values until its last pass, and the
// last pass writes the caller's value and index arrays directly.
#include "top_k.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
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
// Elements per step of the candidate pass (one AVX-512 register, two AVX2 ones).
constexpr size_t kGroup = 16;

// Candidates are ordered by magnitude, compared as bit patterns with the sign cleared: for floats
// the order is the same (a NaN, whose pattern is above infinity's, counts as the largest).
inline uint32_t mag_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b & 0x7fffffffu;
}

#if !defined(__AVX512F__) && defined(__AVX2__)
// AVX2 has no compress: a table gives, for each 8-bit mask, the permutation of 32-bit lanes that
// moves the selected lanes to the front, in order.
struct LanePermutations {
  alignas(32) int32_t lanes[256][8];
};
constexpr LanePermutations make_lane_permutations() {
  LanePermutations p{};
  for (int m = 0; m < 256; ++m) {
    int o = 0;
    for (int j = 0; j < 8; ++j)
      if ((m >> j) & 1) p.lanes[m][o++] = j;
  }
  return p;
}
constexpr LanePermutations kLanePerm = make_lane_permutations();

// Writes the lanes of `v` and `idx` selected by `mask` (8 bits) to the front of out_v / out_i;
// all 8 lanes are stored, so both need room for 8.
inline size_t pack8(__m256i v, __m256i idx, unsigned mask, float* out_v, int32_t* out_i) {
  const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLanePerm.lanes[mask]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_v), _mm256_permutevar8x32_epi32(v, perm));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_i), _mm256_permutevar8x32_epi32(idx, perm));
  return static_cast<size_t>(__builtin_popcount(mask));
}
#endif

// Appends (value, index) for the first `valid` of 16 values (v[0..16) at input index `first`)
// whose magnitude bits are >= thr (so a NaN is above every threshold but a NaN's); returns how
// many. out_v and out_i need room for 16.
inline size_t take_group(const float* v, int32_t first, uint32_t thr, int valid, float* out_v, int32_t* out_i) {
#if defined(__AVX512F__)
  const __m512 x = _mm512_loadu_ps(v);
  const __m512i mag = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
  const __mmask16 lanes = static_cast<__mmask16>(valid >= 16 ? 0xffff : (1u << valid) - 1);
  const __mmask16 hit = _mm512_mask_cmpge_epu32_mask(lanes, mag, _mm512_set1_epi32(static_cast<int32_t>(thr)));
  // No early exit for groups without a hit: at a few percent most groups hold one, and the
  // branch would be mispredicted often. Compress in registers, then store (the memory form of
  // compress is slow on some cores).
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(first),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512 cv = _mm512_maskz_compress_ps(hit, x);
  const __m512i ci = _mm512_maskz_compress_epi32(hit, idx);
  const unsigned n = static_cast<unsigned>(__builtin_popcount(hit));
  // Stores are what this loop spends most on: a group rarely holds more than 8 hits, and a store
  // masked to the lower half costs one 256-bit store where a full one costs two.
  const __mmask16 half = static_cast<__mmask16>(n > 8 ? 0xffff : 0x00ff);
  _mm512_mask_storeu_ps(out_v, half, cv);
  _mm512_mask_storeu_epi32(out_i, half, ci);
  return n;
#elif defined(__AVX2__)
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  // Magnitude bits are below 2^31, so a signed compare orders them; b >= thr is b > thr - 1
  // (thr = 0 gives -1: every lane).
  const __m256i below = _mm256_set1_epi32(static_cast<int32_t>(thr) - 1);
  const unsigned lanes = valid >= 16 ? 0xffffu : (1u << valid) - 1;
  size_t n = 0;
  for (int h = 0; h < 2; ++h) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 8 * h));
    const __m256i hit = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), below);
    const unsigned m = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(hit))) & (lanes >> (8 * h)) & 0xffu;
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(first + 8 * h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    n += pack8(x, idx, m, out_v + n, out_i + n);
  }
  return n;
#else
  // Writes every lane and advances only past the hits (no branch to mispredict).
  size_t n = 0;
  for (int j = 0; j < valid; ++j) {
    out_v[n] = v[j];
    out_i[n] = first + j;
    n += mag_bits(v[j]) >= thr ? 1 : 0;
  }
  return n;
#endif
}

// Uninitialized arrays of candidates (zeroing megabytes that are about to be overwritten would
// cost as much as the pass that fills them), in one allocation: two blocks of several MB each
// can make malloc hand the top of its heap back to the kernel at every call, and the pages fault
// in again at the next.
struct Candidates {
  std::unique_ptr<unsigned char[]> storage;  // raw storage for both arrays
  float* value;
  int32_t* index;
  size_t size = 0;
  explicit Candidates(size_t capacity)
      : storage(new unsigned char[capacity * (sizeof(float) + sizeof(int32_t))]),
        value(reinterpret_cast<float*>(storage.get())),
        index(reinterpret_cast<int32_t*>(storage.get() + capacity * sizeof(float))) {}
};

// Elements per block of gather_above: the unit in which it converts 16-bit inputs and checks
// its capacity, so candidate buffers need this much slack.
constexpr size_t kBlock = 256;

// Every element whose magnitude bits are >= thr as (value in float32, index), in index order;
// false (and nothing kept) when there are more than `cap` (the caller falls back to the exact
// path). `out` needs room for cap + kBlock.
template <class T>
bool gather_above(const T* in, size_t count, uint32_t thr, size_t cap, Candidates& out) {
  alignas(64) float vals[kBlock];
  float* const out_v = out.value;  // locals: the stores below cannot be taken to modify them
  int32_t* const out_i = out.index;
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
    const auto first = static_cast<int32_t>(base);
    if (len == kBlock) {
      for (size_t g = 0; g < kBlock; g += kGroup)
        n += take_group(v + g, first + static_cast<int32_t>(g), thr, kGroup, out_v + n, out_i + n);
    } else {
      for (size_t g = 0; g < len; g += kGroup) {
        const int valid = static_cast<int>(std::min(kGroup, len - g));
        n += take_group(v + g, first + static_cast<int32_t>(g), thr, valid, out_v + n, out_i + n);
      }
    }
    if (n > cap) return false;
  }
  out.size = n;
  return true;
}

// The bit pattern t of the k-th largest magnitude of v[0..c) (1 <= k <= c) and how many
// elements equal to t belong to the k largest (*ties; the other k - *ties are above t): a radix
// select on the upper 16 bits, over the range of bins the values occupy (a few hundred for
// candidates above a sampled threshold: no 65536-bin histogram to clear and scan), then an
// nth_element over the lower 16 bits of the values in the bin that holds t.
uint32_t kth_largest_bits(const float* v, size_t c, size_t k, size_t* ties) {
  uint32_t top = 0, bottom = 0xffff;
  for (size_t j = 0; j < c; ++j) {
    const uint32_t u = mag_bits(v[j]) >> 16;
    top = std::max(top, u);
    bottom = std::min(bottom, u);
  }
  // Four interleaved histograms: neighbouring values often share a bin, and one histogram would
  // chain every increment to the previous one through memory.
  const size_t bins = top - bottom + 1;
  std::vector<uint32_t> hist4(4 * bins, 0);
  uint32_t* h0 = hist4.data();
  size_t j = 0;
  for (; j + 4 <= c; j += 4)
    for (size_t q = 0; q < 4; ++q) ++h0[q * bins + (mag_bits(v[j + q]) >> 16) - bottom];
  for (; j < c; ++j) ++h0[(mag_bits(v[j]) >> 16) - bottom];
  auto hist = [&](uint32_t b) {
    const size_t i = b - bottom;
    return static_cast<size_t>(h0[i]) + h0[bins + i] + h0[2 * bins + i] + h0[3 * bins + i];
  };
  size_t need = k;  // rank still to descend, counted from the top of the remaining bins
  uint32_t hi = top;
  for (;; --hi) {
    if (hist(hi) >= need) break;
    need -= hist(hi);
  }
  // The low halves of the values in bin hi, gathered without a branch per value.
  std::vector<uint32_t> low(hist(hi) + kGroup);
  size_t m = 0, i = 0;
#if defined(__AVX512F__)
  const __m512i bin = _mm512_set1_epi32(static_cast<int32_t>(hi << 16));
  for (; i + 16 <= c; i += 16) {
    const __m512i b = _mm512_and_si512(_mm512_loadu_si512(v + i), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 in_bin = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fff0000)), bin);
    _mm512_storeu_si512(low.data() + m, _mm512_maskz_compress_epi32(in_bin, _mm512_and_si512(b, _mm512_set1_epi32(0xffff))));
    m += static_cast<size_t>(__builtin_popcount(in_bin));
  }
#elif defined(__AVX2__)
  const __m256i bin = _mm256_set1_epi32(static_cast<int32_t>(hi << 16));
  for (; i + 8 <= c; i += 8) {
    const __m256i b = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), _mm256_set1_epi32(0x7fffffff));
    const unsigned in_bin = static_cast<unsigned>(
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fff0000)), bin))));
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLanePerm.lanes[in_bin]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(low.data() + m),
                        _mm256_permutevar8x32_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0xffff)), perm));
    m += static_cast<size_t>(__builtin_popcount(in_bin));
  }
#endif
  for (; i < c; ++i) {
    const uint32_t b = mag_bits(v[i]);
    low[m] = b & 0xffff;
    m += (b >> 16) == hi;
  }
  low.resize(m);
  std::nth_element(low.begin(), low.begin() + (need - 1), low.end(), std::greater<uint32_t>());
  const uint32_t lo = low[need - 1];
  // After nth_element the elements before position need - 1 are >= lo: those above lo are the
  // ones ranked before t; the rest of the need are ties.
  size_t above = 0;
  for (size_t i = 0; i + 1 < need; ++i) above += low[i] > lo;
  *ties = need - above;
  return (hi << 16) | lo;
}

// The lowest `*ties` set bits of `eq` (ties at the threshold go to the lowest indices); takes
// them from *ties.
inline unsigned first_ties(unsigned eq, size_t* ties) {
  unsigned keep = 0;
  for (; eq != 0 && *ties > 0; --*ties) {
    const unsigned low = eq & (0u - eq);
    keep |= low;
    eq ^= low;
  }
  return keep;
}

// Copies the candidates whose magnitude is above t, and the first `ties` equal to it, to
// out_v / out_i (exactly k of them by construction), in order.
void keep_above(const float* v, const int32_t* idx, size_t c, uint32_t t, size_t ties, size_t k, float* out_v,
                int32_t* out_i) {
  size_t o = 0, j = 0;
#if defined(__AVX512F__)
  const __m512i tv = _mm512_set1_epi32(static_cast<int32_t>(t));
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (; j < c; j += 16) {
    const __mmask16 lanes = static_cast<__mmask16>(c - j >= 16 ? 0xffff : (1u << (c - j)) - 1);
    const __m512i x = _mm512_maskz_loadu_epi32(lanes, v + j);
    const __m512i b = _mm512_and_si512(x, abs_mask);
    __mmask16 keep = _mm512_mask_cmpgt_epu32_mask(lanes, b, tv);
    const __mmask16 eq = _mm512_mask_cmpeq_epu32_mask(lanes, b, tv);
    if (eq != 0) keep |= static_cast<__mmask16>(first_ties(eq, &ties));
    // Register compress and a store masked to the kept lanes: never past out[k).
    const __mmask16 dst = static_cast<__mmask16>((1u << __builtin_popcount(keep)) - 1);
    _mm512_mask_storeu_epi32(out_v + o, dst, _mm512_maskz_compress_epi32(keep, x));
    _mm512_mask_storeu_epi32(out_i + o, dst, _mm512_maskz_compress_epi32(keep, _mm512_maskz_loadu_epi32(lanes, idx + j)));
    o += static_cast<size_t>(__builtin_popcount(keep));
  }
#elif defined(__AVX2__)
  // Magnitude bits are below 2^31, so the signed compares order them as unsigned.
  const __m256i tv = _mm256_set1_epi32(static_cast<int32_t>(t));
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  // Full-width stores while 8 lanes of room remain before out[k); the rest one by one.
  for (; j + 8 <= c && o + 8 <= k; j += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j));
    const __m256i b = _mm256_and_si256(x, abs_mask);
    unsigned keep = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b, tv))));
    const unsigned eq = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b, tv))));
    if (eq != 0) keep |= first_ties(eq, &ties);
    o += pack8(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + j)), keep, out_v + o, out_i + o);
  }
#endif
  for (; j < c && o < k; ++j) {
    const uint32_t b = mag_bits(v[j]);
    const bool tie = b == t && ties > 0;
    ties -= tie ? 1 : 0;
    if (b > t || tie) {
      out_v[o] = v[j];
      out_i[o] = idx[j];
      ++o;
    }
  }
}

template <class T>
TopKPath select_typed(const T* in, size_t count, size_t k, float* values, int32_t* indices) {
  size_t r = 0, stride = 0;
  if (top_k_sampled(count, k, &r, &stride)) {
    // The sample as magnitude bits: the order the trim uses, in which a NaN is the largest (a
    // float comparison would leave NaNs unordered and out of the candidates).
    std::vector<uint32_t> s(kTopKSample);
    for (size_t j = 0; j < kTopKSample; ++j) s[j] = mag_bits(load_f32(in[top_k_sample_index(j, stride)]));
    std::nth_element(s.begin(), s.begin() + r, s.end(), std::greater<uint32_t>());
    const size_t cap = kTopKMaxOverselect * k;
    Candidates cand(cap + kBlock);
    if (gather_above(in, count, s[r], cap, cand) && cand.size >= k) {
      top_k_trim(cand.value, cand.index, cand.size, k, values, indices);
      return TopKPath::kSampled;
    }
  }
  // Exact: every element is a candidate.
  Candidates all(count);
  for (size_t i = 0; i < count; ++i) {
    all.value[i] = load_f32(in[i]);
    all.index[i] = static_cast<int32_t>(i);
  }
  top_k_trim(all.value, all.index, count, k, values, indices);
  return TopKPath::kExact;
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

void top_k_trim(const float* values, const int32_t* indices, size_t c, size_t k, float* out_values,
                int32_t* out_indices) {
  // The k-th largest magnitude t; then one pass in index order keeps everything above t and the
  // lowest-index elements equal to t. The candidates stay in index order: no sort needed.
  k = std::min(k, c);
  if (k == 0) return;
  if (k == c) {
    std::memcpy(out_values, values, c * sizeof(float));
    std::memcpy(out_indices, indices, c * sizeof(int32_t));
    return;
  }
  size_t ties = 0;
  const uint32_t t = kth_largest_bits(values, c, k, &ties);
  keep_above(values, indices, c, t, ties, k, out_values, out_indices);
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
