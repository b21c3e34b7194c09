// A POSIX shared-memory segment: created exclusively (mode 0600, unguessable name) or attached.
#pragma once

#include <cstddef>
#include <string>

namespace braid {

class ShmSegment {
 public:
  ShmSegment() = default;
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;

  // Creates a new segment of `bytes` under a random 128-bit name (O_CREAT|O_EXCL, mode 0600),
  // with its first `reserve_bytes` backed by memory at once (reserve()).
  static ShmSegment create(size_t bytes, size_t reserve_bytes);
  // Maps an existing segment; checks that it is a regular object of at least `bytes` owned by us.
  static ShmSegment attach(const std::string& name, size_t bytes);

  // Removes the name; the mapping stays valid until every process unmaps it.
  void unlink();

  // Backs [offset, offset + bytes) of a created segment with memory now. A shared-memory file
  // system that is too small (a container's 64 MB /dev/shm) then fails here with a CommError
  // that says so, instead of killing the process with SIGBUS at its first write there.
  void reserve(size_t offset, size_t bytes);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool linked() const { return linked_; }

 private:
  void reset() noexcept;

  void* data_ = nullptr;
  size_t size_ = 0;
  std::string name_;
  bool linked_ = false;  // whether this object created the name and has not unlinked it yet
  int fd_ = -1;          // created segments: kept for reserve()
};

}  // namespace braid
