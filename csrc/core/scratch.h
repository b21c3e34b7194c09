// Grow-only staging buffers that a communicator's collectives reuse from call to call: fresh
// memory for every large call would cost its page faults and zeroing each time (a 64 MB call
// spent more on that than on copying its data).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace braid {

class ScratchBuffers {
 public:
  // At least `bytes` of uninitialized memory in slot `slot`, valid until the next get() of that
  // slot. A communicator's collectives run one at a time, so one set serves all of them.
  char* get(size_t slot, size_t bytes) {
    if (slot >= bufs_.size()) {
      bufs_.resize(slot + 1);
      caps_.resize(slot + 1, 0);
    }
    if (caps_[slot] < bytes || !bufs_[slot]) {
      bufs_[slot].reset(new char[bytes > 0 ? bytes : 1]);
      caps_[slot] = bytes;
    }
    return bufs_[slot].get();
  }

 private:
  std::vector<std::unique_ptr<char[]>> bufs_;
  std::vector<size_t> caps_;
};

}  // namespace braid
