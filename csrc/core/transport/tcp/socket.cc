// Sockets for the TCP transport: addresses, listening, connecting, exact I/O with a deadline,
// interface choice.
#include "socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../../errors.h"

namespace braid {

void Fd::reset() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int SockAddr::port() const {
  if (family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
}

std::string SockAddr::host() const {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (family() == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf, sizeof(buf));
  else
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf, sizeof(buf));
  return buf;
}

std::string SockAddr::str() const {
  if (family() == AF_INET6) return "[" + host() + "]:" + std::to_string(port());
  return host() + ":" + std::to_string(port());
}

SockAddr parse_ip(const std::string& ip) {
  SockAddr a;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (::inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    a.len = sizeof(sockaddr_in);
    return a;
  }
  // A link-local IPv6 address needs its interface: "fe80::1%eth0".
  std::string addr = ip;
  unsigned scope = 0;
  const size_t pct = ip.find('%');
  if (pct != std::string::npos) {
    addr = ip.substr(0, pct);
    scope = ::if_nametoindex(ip.substr(pct + 1).c_str());
  }
  if (::inet_pton(AF_INET6, addr.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_scope_id = scope;
    a.len = sizeof(sockaddr_in6);
    return a;
  }
  throw std::invalid_argument("not an IP address: '" + ip + "'");
}

SockAddr parse_endpoint(const std::string& endpoint) {
  std::string host, port;
  if (!endpoint.empty() && endpoint[0] == '[') {
    const size_t close = endpoint.find("]:");
    if (close == std::string::npos) throw std::invalid_argument("bad endpoint '" + endpoint + "'");
    host = endpoint.substr(1, close - 1);
    port = endpoint.substr(close + 2);
  } else {
    const size_t colon = endpoint.rfind(':');
    if (colon == std::string::npos) throw std::invalid_argument("bad endpoint '" + endpoint + "'");
    host = endpoint.substr(0, colon);
    port = endpoint.substr(colon + 1);
  }
  char* end = nullptr;
  const long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p <= 0 || p > 65535)
    throw std::invalid_argument("bad port in endpoint '" + endpoint + "'");
  SockAddr a = parse_ip(host);
  if (a.family() == AF_INET)
    reinterpret_cast<sockaddr_in*>(&a.storage)->sin_port = htons(static_cast<uint16_t>(p));
  else
    reinterpret_cast<sockaddr_in6*>(&a.storage)->sin6_port = htons(static_cast<uint16_t>(p));
  return a;
}

Fd listen_on(const std::string& ip, SockAddr* bound) {
  SockAddr a = parse_ip(ip);
  Fd fd(::socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw_system_error("socket", errno);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.storage), a.len) != 0)
    throw_system_error("bind to " + ip, errno);
  if (::listen(fd.get(), SOMAXCONN) != 0) throw_system_error("listen", errno);
  bound->len = sizeof(bound->storage);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound->storage), &bound->len) != 0)
    throw_system_error("getsockname", errno);
  return fd;
}

namespace {
int ms_until(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 100));
}
}  // namespace

std::string errno_text(int err) { return err == 0 ? "connection closed" : std::strerror(err); }

Fd connect_to(const SockAddr& to, Clock::time_point deadline, const std::string& what, bool retry_refused) {
  int last_err = 0;
  auto backoff = std::chrono::milliseconds(1);
  while (Clock::now() < deadline) {
    Fd fd(::socket(to.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) throw_system_error("socket", errno);
    int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&to.storage), to.len);
    if (rc != 0 && errno == EINPROGRESS) {
      struct pollfd p{fd.get(), POLLOUT, 0};
      while ((rc = ::poll(&p, 1, ms_until(deadline))) == 0 && Clock::now() < deadline) {
      }
      if (rc > 0) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        rc = -1;
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      const int flags = ::fcntl(fd.get(), F_GETFL);
      ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
      return fd;
    }
    last_err = errno;
    if ((last_err != ECONNREFUSED || !retry_refused) && last_err != ETIMEDOUT && last_err != EINTR && last_err != EAGAIN &&
        last_err != ENETUNREACH && last_err != EHOSTUNREACH)
      throw CommError(ErrorKind::kPeer, "could not connect to " + what + " at " + to.str() + ": " +
                                            std::strerror(last_err));
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
  throw CommError(ErrorKind::kTimeout, "could not connect to " + what + " at " + to.str() + " before the deadline" +
                                           (last_err ? std::string(" (") + std::strerror(last_err) + ")" : ""));
}

namespace {
template <class IO>
bool exact(int fd, size_t n, short events, Clock::time_point deadline, std::string* why, IO io) {
  size_t done = 0;
  while (done < n) {
    struct pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, ms_until(deadline));
    if (rc < 0 && errno != EINTR) {
      *why = std::strerror(errno);
      return false;
    }
    if (rc <= 0) {
      if (Clock::now() >= deadline) {
        *why = "no answer before the deadline";
        return false;
      }
      continue;
    }
    const ssize_t k = io(done);
    if (k == 0) {
      *why = "connection closed";
      return false;
    }
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      *why = std::strerror(errno);
      return false;
    }
    done += static_cast<size_t>(k);
  }
  return true;
}
}  // namespace

bool read_exact(int fd, void* buf, size_t n, Clock::time_point deadline, std::string* why) {
  return exact(fd, n, POLLIN, deadline, why,
               [&](size_t done) { return ::recv(fd, static_cast<char*>(buf) + done, n - done, MSG_DONTWAIT); });
}

bool write_exact(int fd, const void* buf, size_t n, Clock::time_point deadline, std::string* why) {
  return exact(fd, n, POLLOUT, deadline, why, [&](size_t done) {
    return ::send(fd, static_cast<const char*>(buf) + done, n - done, MSG_DONTWAIT | MSG_NOSIGNAL);
  });
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) throw_system_error("fcntl(O_NONBLOCK)", errno);
}

void set_nodelay(int fd) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) throw_system_error("TCP_NODELAY", errno);
}

namespace {
std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at - start));
    if (at == std::string::npos) return out;
    start = at + 1;
  }
}

bool spec_matches(const std::string& spec, const std::string& name) {
  bool exclude = false, exact_name = false;
  std::string list = spec;
  if (!list.empty() && list[0] == '^') {
    exclude = true;
    list = list.substr(1);
  }
  if (!list.empty() && list[0] == '=') {
    exact_name = true;
    list = list.substr(1);
  }
  bool hit = false;
  for (const std::string& p : split(list, ','))
    if (!p.empty() && (exact_name ? name == p : name.compare(0, p.size(), p) == 0)) hit = true;
  return exclude ? !hit : hit;
}
}  // namespace

std::string interface_address(const std::string& spec, int family) {
  struct ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) throw_system_error("getifaddrs", errno);
  std::string v4, v6, names;
  for (struct ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || !(i->ifa_flags & IFF_UP)) continue;
    const int fam = i->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    names += std::string(names.empty() ? "" : ", ") + i->ifa_name;
    if (!spec_matches(spec, i->ifa_name)) continue;
    SockAddr a;
    std::memcpy(&a.storage, i->ifa_addr, fam == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    std::string host = a.host();
    if (fam == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<sockaddr_in6*>(&a.storage)->sin6_addr))
      host += std::string("%") + i->ifa_name;
    if (fam == AF_INET && v4.empty()) v4 = host;
    if (fam == AF_INET6 && v6.empty()) v6 = host;
  }
  ::freeifaddrs(list);
  const std::string pick = family == AF_INET6 ? v6 : (v4.empty() ? v6 : v4);
  if (pick.empty())
    throw std::invalid_argument("BRAID_SOCKET_IFNAME='" + spec + "' matches no interface that is up with an " +
                                (family == AF_INET6 ? "IPv6" : "IP") + " address (interfaces: " + names + ")");
  return pick;
}

std::string route_address(const std::string& host) {
  struct addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  struct addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr)
    throw std::invalid_argument("cannot resolve the store's host '" + host + "'");
  std::string out;
  for (struct addrinfo* r = res; r != nullptr && out.empty(); r = r->ai_next) {
    Fd fd(::socket(r->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    // connect() on a datagram socket sends nothing: it only picks the route and source address.
    if (!fd || ::connect(fd.get(), r->ai_addr, r->ai_addrlen) != 0) continue;
    SockAddr a;
    a.len = sizeof(a.storage);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a.storage), &a.len) == 0) out = a.host();
  }
  ::freeaddrinfo(res);
  if (out.empty()) throw std::invalid_argument("no route to the store's host '" + host + "'");
  return out;
}

}  // namespace braid
