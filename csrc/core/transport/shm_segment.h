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

  // Creates a new segment of `bytes` under a random 128-bit name (O_CREAT|O_EXCL, mode 0600).
  static ShmSegment create(size_t bytes);
  // Maps an existing segment; checks that it is a regular object of at least `bytes` owned by us.
  static ShmSegment attach(const std::string& name, size_t bytes);

  // Removes the name; the mapping stays valid until every process unmaps it.
  void unlink();

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
};

}  // namespace braid
