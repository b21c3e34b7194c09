// POSIX shared memory with RAII: shm_open/ftruncate/mmap, unlink as soon as peers have mapped.
#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <utility>

#include "../errors.h"

namespace braid {
namespace {

std::string random_name() {
  uint8_t bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_system_error("getrandom", errno);
    }
    got += static_cast<size_t>(n);
  }
  std::string name = "/braid-";
  char hex[3];
  for (uint8_t b : bytes) {
    std::snprintf(hex, sizeof(hex), "%02x", b);
    name += hex;
  }
  return name;
}

// Closes an fd when leaving scope; the mapping outlives it.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_system_error("mmap of shared memory " + name, errno);
  return p;
}

}  // namespace

ShmSegment::~ShmSegment() { reset(); }

ShmSegment::ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    name_ = std::move(other.name_);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

void ShmSegment::reset() noexcept {
  if (linked_) ::shm_unlink(name_.c_str());
  linked_ = false;
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

ShmSegment ShmSegment::create(size_t bytes) {
  ShmSegment seg;
  for (int attempt = 0;; ++attempt) {
    std::string name = random_name();
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      if (errno == EEXIST && attempt < 8) continue;
      throw_system_error("shm_open(" + name + ")", errno);
    }
    FdCloser closer{fd};
    seg.name_ = name;
    seg.linked_ = true;  // from here on the destructor removes the name on failure
    // fchmod guards against a umask-independent mode; ftruncate zero-fills the object.
    if (::fchmod(fd, 0600) != 0) throw_system_error("fchmod(" + name + ")", errno);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0)
      throw_system_error("ftruncate(" + name + ") to " + std::to_string(bytes) + " bytes", errno);
    seg.data_ = map_fd(fd, bytes, name);
    seg.size_ = bytes;
    return seg;
  }
}

ShmSegment ShmSegment::attach(const std::string& name, size_t bytes) {
  if (name.rfind("/braid-", 0) != 0 || name.size() != 7 + 32)
    throw CommError(ErrorKind::kGeneric, "refusing to map shared memory with unexpected name '" + name + "'");
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw_system_error("shm_open(" + name + ") of a peer's segment", errno);
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_system_error("fstat(" + name + ")", errno);
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0)
    throw CommError(ErrorKind::kGeneric, "shared memory " + name + " is not private to this user");
  if (static_cast<size_t>(st.st_size) < bytes)
    throw CommError(ErrorKind::kGeneric, "shared memory " + name + " is smaller than announced");
  ShmSegment seg;
  seg.data_ = map_fd(fd, bytes, name);
  seg.size_ = bytes;
  seg.name_ = name;
  return seg;
}

void ShmSegment::unlink() {
  if (!linked_) return;
  linked_ = false;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) throw_system_error("shm_unlink(" + name_ + ")", errno);
}

}  // namespace braid
