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
// when the destination will not be read again soon, i.e. messages larger than the cache.
void copy_streaming(void* dst, const void* src, size_t n);

}  // namespace braid
