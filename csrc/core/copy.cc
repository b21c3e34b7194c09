// Non-temporal copy: unaligned loads, aligned streaming stores, a fence so that the data is
// globally visible before the caller posts a step.
#include "copy.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace braid {

void copy_streaming(void* dst, const void* src, size_t n, bool fence) {
#if defined(__AVX__)
  constexpr size_t kVec = 32;
#elif defined(__SSE2__)
  constexpr size_t kVec = 16;
#else
  constexpr size_t kVec = 0;
#endif
  if (kVec == 0 || n < 4 * kVec) return copy_bytes(dst, src, n);
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  const size_t head = (kVec - reinterpret_cast<uintptr_t>(d) % kVec) % kVec;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const size_t body = n - n % kVec;
#if defined(__AVX__)
  for (size_t i = 0; i < body; i += kVec)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
#elif defined(__SSE2__)
  for (size_t i = 0; i < body; i += kVec)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
#endif
  std::memcpy(d + body, s + body, n - body);
  if (fence) streaming_fence();
}

void streaming_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace braid
