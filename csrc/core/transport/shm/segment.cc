// POSIX shared memory with RAII: shm_open/ftruncate/mmap, unlink as soon as peers have mapped.
#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <utility>

#include "../../errors.h"

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
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void ShmSegment::reset() noexcept {
  if (linked_) ::shm_unlink(name_.c_str());
  linked_ = false;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

ShmSegment ShmSegment::create(size_t bytes, size_t reserve_bytes) {
  ShmSegment seg;
  for (int attempt = 0;; ++attempt) {
    std::string name = random_name();
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      if (errno == EEXIST && attempt < 8) continue;
      throw_system_error("shm_open(" + name + ")", errno);
    }
    seg.fd_ = fd;  // closed by the destructor, also on failure below
    seg.name_ = name;
    seg.linked_ = true;  // from here on the destructor removes the name on failure
    // fchmod guards against a umask-independent mode; ftruncate zero-fills the object.
    if (::fchmod(fd, 0600) != 0) throw_system_error("fchmod(" + name + ")", errno);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0)
      throw_system_error("ftruncate(" + name + ") to " + std::to_string(bytes) + " bytes", errno);
    seg.data_ = map_fd(fd, bytes, name);
    seg.size_ = bytes;
    seg.reserve(0, std::min(reserve_bytes, bytes));
    return seg;
  }
}

void ShmSegment::reserve(size_t offset, size_t bytes) {
  if (fd_ < 0 || bytes == 0) return;
  const int err = ::posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  if (err == 0) return;
  // A file system without fallocate: pages are then allocated at first touch, as before.
  if (err == EOPNOTSUPP || err == EINVAL || err == ENOSYS) return;
  if (err != ENOSPC && err != ENOMEM) throw_system_error("posix_fallocate(" + name_ + ")", err);
  std::string free_part;
  struct statvfs fs;
  if (::statvfs("/dev/shm", &fs) == 0)
    free_part = ", and /dev/shm has " + std::to_string(static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize >> 20) +
                " MiB left of " + std::to_string(static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize >> 20) + " MiB";
  throw CommError(ErrorKind::kGeneric,
                  "shared memory is full: braid needs " + std::to_string((bytes + (1 << 20) - 1) >> 20) +
                      " MiB more for this rank" + free_part +
                      "; enlarge /dev/shm (docker run --shm-size=1g, or mount -o remount,size=... /dev/shm), "
                      "run fewer ranks per host, or lower BRAID_SLOT_BYTES / BRAID_NSLOTS / "
                      "BRAID_ONESHOT_MAX_BYTES");
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
