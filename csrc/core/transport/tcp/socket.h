// Sockets for the TCP transport: an owning fd, addresses (IPv4 and IPv6), listening, connecting
// and exact reads/writes with a deadline (the handshake), and choosing the interface to bind.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <string>

namespace braid {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor (RAII): closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset() noexcept;

 private:
  int fd_ = -1;
};

// An IPv4 or IPv6 socket address.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;
  int family() const { return storage.ss_family; }
  int port() const;
  // "10.0.0.1:4000", "[fd00::1]:4000".
  std::string str() const;
  // The address part only: "10.0.0.1", "fd00::1".
  std::string host() const;
};

// Parses "ip:port" or "[ipv6]:port" (an IP literal, no name lookup); throws std::invalid_argument.
SockAddr parse_endpoint(const std::string& endpoint);
// Parses an IP literal with port 0.
SockAddr parse_ip(const std::string& ip);

// A listening socket on `ip` (an IP literal) and a port the kernel picks.
Fd listen_on(const std::string& ip, SockAddr* bound);
// Connects to `to` before `deadline`, retrying refusals when `retry_refused` (the peer's listener
// may not be up yet; where it must be, a refusal means the peer is gone). Throws
// CommError(kTimeout) past the deadline, CommError(kPeer) on other failures.
Fd connect_to(const SockAddr& to, Clock::time_point deadline, const std::string& what, bool retry_refused = true);
// strerror, or "connection closed" for 0 (an EOF).
std::string errno_text(int err);
// Exactly `n` bytes, before `deadline`; false on EOF, error or deadline (`why` says which).
bool read_exact(int fd, void* buf, size_t n, Clock::time_point deadline, std::string* why);
bool write_exact(int fd, const void* buf, size_t n, Clock::time_point deadline, std::string* why);

void set_nonblocking(int fd);
// TCP_NODELAY: a collective's small messages must not wait for Nagle's coalescing.
void set_nodelay(int fd);

// The address to bind, from the interface spec of BRAID_SOCKET_IFNAME (as NCCL_SOCKET_IFNAME):
// comma-separated interface name prefixes, "=name" for an exact name, "^prefix" to exclude.
// The first matching interface that is up, IPv4 before IPv6 (only IPv6 when `family` is
// AF_INET6). Throws std::invalid_argument naming the spec when nothing matches.
std::string interface_address(const std::string& spec, int family);
// The local address the kernel would use to reach `host` (an IP literal or a name): the
// interface that routes to the store's host.
std::string route_address(const std::string& host);

}  // namespace braid
