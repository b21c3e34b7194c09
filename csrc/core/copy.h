// Bulk copies for the collectives: plain, and streaming (non-temporal) for outputs too large to
// stay in cache.
#pragma once

#include <cstddef>
#include <cstring>

namespace braid {

// memcpy that accepts the null pointers torch gives empty tensors.
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

// Copies with non-temporal stores: the destination lines are written without first being read
// (no read-for-ownership) and without evicting the slots that are still in flight. Only worth it
// when the destination will not be read again soon, i.e. messages larger than the cache. With
// `fence` false the caller issues streaming_fence() itself before publishing (once per batch).
void copy_streaming(void* dst, const void* src, size_t n, bool fence = true);
void streaming_fence();

// The copy of a final output: streaming when the output is too large for the cache.
inline void copy_output(void* dst, const void* src, size_t n, bool stream) {
  if (stream) {
    copy_streaming(dst, src, n);
  } else {
    copy_bytes(dst, src, n);
  }
}

}  // namespace braid
