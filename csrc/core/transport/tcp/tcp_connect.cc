// Opening the TCP transport's connections: the acceptor thread (every incoming connection
// authenticated concurrently, each against its own deadline) and the connecting side (retried
// while the peer's acceptor may have dropped it, fatal when the peer refuses the job's secret),
// eagerly in connect() or on demand from the progress thread.
//
// The handshake, per socket (frame.h): the connector sends a Hello (its rank, the rank it means
// to reach, channel, socket index, a nonce); the acceptor answers a Challenge (its proof of the
// secret over the hello, and a nonce of its own); the connector sends its Proof over that nonce;
// the acceptor answers one verdict byte. Neither side sends data before the other has proved
// the secret.
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "hmac_sha256.h"
#include "tcp_transport.h"
#include "../../thread_name.h"

namespace braid {

namespace {
// An incoming connection that has not finished its handshake within this long is dropped.
constexpr auto kHandshakeTimeout = std::chrono::seconds(5);
// At most this many incoming connections are authenticated at once; past it the oldest is
// dropped (a real peer's handshake takes a round trip or two, so the oldest is a stranger's).
constexpr size_t kMaxHandshakes = 64;
// The verdict byte of a connection whose proof of the secret was wrong.
constexpr uint8_t kRefused = 0x5A;
// The verdict byte of an acceptor whose rank has failed, followed by the error (error_record).
constexpr uint8_t kFailed = 0x3C;
// The channel of a hello that asks the (higher) rank it reaches to connect to the sender: the
// lower rank of a pair wants the pair, on demand.
constexpr int kRequestChannel = -1;
// The channel of a hello that carries a failure: after the handshake the connector sends the
// error (error_record) and closes.
constexpr int kNoticeChannel = -2;
// How long publish_failure spends in all on notices to peers it holds no connection to.
constexpr auto kNoticeBudget = std::chrono::seconds(1);
// How long a refused lazy connection waits for the refusing peer's notice (sent before it left,
// within kNoticeBudget) before it is reported as the peer being gone.
constexpr auto kNoticeGrace = std::chrono::milliseconds(1500);
constexpr int kAcceptSliceMs = 50;

std::array<uint8_t, kMacBytes> proof_mac(const std::vector<uint8_t>& secret, const char* role, const Hello& h,
                                         const uint8_t* nonce) {
  std::vector<uint8_t> msg(role, role + std::strlen(role));
  const auto* hb = reinterpret_cast<const uint8_t*>(&h);
  msg.insert(msg.end(), hb, hb + sizeof(h));
  msg.insert(msg.end(), nonce, nonce + kNonceBytes);
  return hmac_sha256(secret.data(), secret.size(), msg.data(), msg.size());
}

// An error as it crosses in a handshake (a failed acceptor's answer, a notice): its kind (one
// byte), the length of its text (two bytes, little-endian) and the text.
std::string error_record(ErrorKind kind, const std::string& text) {
  const size_t n = std::min<size_t>(text.size(), kMaxAbortText);
  std::string record{static_cast<char>(kind), static_cast<char>(n & 0xff), static_cast<char>(n >> 8)};
  return record + text.substr(0, n);
}
// The text length of a record's three-byte head (bounded: no length is trusted).
size_t error_text_length(const uint8_t* head) {
  return std::min<size_t>(head[1] | (size_t{head[2]} << 8), kMaxAbortText);
}
// The kind of a record's head; an unknown one is a PeerError.
ErrorKind error_kind_of(const uint8_t* head) {
  const bool known = head[0] >= static_cast<uint8_t>(ErrorKind::kGeneric) &&
                     head[0] <= static_cast<uint8_t>(ErrorKind::kClosed);
  return known ? static_cast<ErrorKind>(head[0]) : ErrorKind::kPeer;
}

std::string seconds_text(std::chrono::nanoseconds d) {
  return number_text(std::chrono::duration<double>(d).count()) + " s";
}
}  // namespace

struct TcpTransport::Handshake {
  Fd fd;
  std::string from;  // the remote address, for the log
  Clock::time_point deadline;
  // 0: read the hello, 1: write the challenge, 2: read the proof, 3: write the verdict; a notice
  // then 4: read the error's kind and length, 5: its text.
  int step = 0;
  size_t pos = 0;    // bytes of the step's message moved
  Hello hello{};
  Challenge challenge{};
  Proof proof{};
  std::string verdict{static_cast<char>(kAccepted)};  // the verdict byte and, for kFailed, the error
  std::string why;   // why it is refused
  uint8_t notice_head[3] = {0, 0, 0};
  std::string notice;
};

// -- the connecting side -----------------------------------------------------------------------

void TcpTransport::connect(const std::vector<std::string>& endpoints, const std::vector<bool>& remote,
                           const std::vector<std::string>& labels) {
  if (static_cast<int>(endpoints.size()) != world_ || static_cast<int>(remote.size()) != world_ ||
      static_cast<int>(labels.size()) != world_)
    throw std::invalid_argument("connect needs one endpoint, remote flag and label per rank");
  if (acceptor_.joinable()) throw std::logic_error("connect called twice");
  remote_ = remote;
  const size_t per_peer = static_cast<size_t>(kNumChannels * cfg_.sockets);
  for (int r = 0; r < world_; ++r) {
    peers_[r].label = labels[r];
    if (!remote_[r]) continue;
    peers_[r].socks.resize(per_peer);
    try {
      addrs_[r] = parse_endpoint(endpoints[r]);
    } catch (const std::invalid_argument& e) {
      throw CommError(ErrorKind::kGeneric, "rank " + std::to_string(r) + " published a bad address: " + e.what());
    }
  }
  start_acceptor();
  if (cfg_.lazy) return;
  const auto deadline = Clock::now() + cfg_.timeout;
  try {
    for (int r = 0; r < rank_; ++r)
      if (remote_[r]) connect_peer(r, deadline);
    for (;;) {
      std::string missing;
      for (int r = rank_ + 1; r < world_; ++r)
        if (remote_[r] && !ready(r)) missing += (missing.empty() ? "" : ", ") + peers_[r].label;
      if (missing.empty()) break;
      if (Clock::now() >= deadline)
        throw CommError(ErrorKind::kTimeout, "rank " + std::to_string(rank_) +
                                                 " timed out connecting: no authenticated connection from " + missing +
                                                 " within " + seconds_text(cfg_.timeout));
      struct pollfd p{wake_fd_.get(), POLLIN, 0};
      if (::poll(&p, 1, kAcceptSliceMs) > 0) {
        uint64_t v;
        while (::read(wake_fd_.get(), &v, sizeof(v)) > 0) {
        }
      }
    }
  } catch (...) {
    stop_acceptor();
    throw;
  }
  stop_acceptor();
  listener_.reset();  // every peer is connected: nobody else may connect from now on
}

int TcpTransport::connected_peers() const {
  int n = 0;
  for (int r = 0; r < world_; ++r) n += ready(r) ? 1 : 0;
  return n;
}

bool TcpTransport::ensure_connected(int peer) {
  if (ready(peer)) return true;
  if (!remote_[static_cast<size_t>(peer)]) throw std::logic_error("a TCP operation for a rank on this host");
  if (rank_ > peer) {
    connect_peer(peer, Clock::now() + cfg_.timeout);
    return true;
  }
  // The pair's higher rank connects: ask its acceptor to, once; its sockets arrive through this
  // rank's acceptor, which wakes the waiting thread.
  if (!requested_[static_cast<size_t>(peer)]) {
    handshake_connect(peer, kRequestChannel, 0, Clock::now() + cfg_.timeout);
    requested_[static_cast<size_t>(peer)] = true;
  }
  return false;
}

void TcpTransport::connect_peer(int peer, Clock::time_point deadline) {
  std::lock_guard<std::mutex> lk(connect_mu_[static_cast<size_t>(peer)]);
  if (ready(peer)) return;
  {
    std::lock_guard<std::mutex> failed(accept_mu_);
    if (failed_) throw CommError(failed_kind_, failed_text_);
  }
  for (int c = 0; c < kNumChannels; ++c)
    for (int i = 0; i < cfg_.sockets; ++i) {
      Fd& s = peers_[peer].socks[static_cast<size_t>(sock_index(static_cast<Channel>(c), i))];
      if (!s) s = handshake_connect(peer, c, i, deadline);
    }
  ready_[static_cast<size_t>(peer)].store(true, std::memory_order_release);
}

Fd TcpTransport::handshake_connect(int peer, int channel, int index, Clock::time_point deadline) {
  const std::string& who = peers_[peer].label;
  const SockAddr& to = addrs_[static_cast<size_t>(peer)];
  auto backoff = std::chrono::milliseconds(1);
  std::string why;
  for (int attempt = 1;; ++attempt) {
    // Lazily, the peer's listener was up before its address was published: a refusal means it
    // is gone. Eagerly it may not be up yet.
    Fd fd;
    try {
      fd = connect_to(to, deadline, who, /*retry_refused=*/!cfg_.lazy);
    } catch (const CommError& e) {
      if (e.kind() != ErrorKind::kPeer) throw;
      // A peer that failed tells the ranks it holds no connection to why, in a notice, before it
      // leaves; its listener, closed as it leaves, can refuse this connection before this rank's
      // acceptor has read that notice. Give the notice a moment, so that every rank raises what
      // happened (a mismatch, say) and not "could not connect"; a peer that died sent none.
      const auto until = std::min(deadline, Clock::now() + kNoticeGrace);
      while (Clock::now() < until) {
        check_abort();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      check_abort();
      throw;
    }
    Hello h{};
    h.magic = kHelloMagic;
    h.version = kWireVersion;
    h.comm_id = comm_id_;
    h.from = rank_;
    h.to = peer;
    h.channel = channel;
    h.index = index;
    random_bytes(h.nonce, kNonceBytes);
    Challenge c{};
    const auto hs_deadline = std::min(deadline, Clock::now() + kHandshakeTimeout);
    why.clear();
    if (write_exact(fd.get(), &h, sizeof(h), hs_deadline, &why) && read_exact(fd.get(), &c, sizeof(c), hs_deadline, &why)) {
      const auto expect = proof_mac(cfg_.secret, "braid-accept", h, c.nonce);
      if (c.magic != kHelloMagic || c.version != kWireVersion || !digest_equal(c.mac, expect.data(), kMacBytes))
        throw CommError(ErrorKind::kGeneric, "the process at " + to.str() + " that answered for " + who +
                                                 " could not prove the job's secret: refusing to send it data");
      Proof p{};
      const auto mine = proof_mac(cfg_.secret, "braid-connect", h, c.nonce);
      std::memcpy(p.mac, mine.data(), kMacBytes);
      uint8_t verdict = 0;
      if (write_exact(fd.get(), &p, sizeof(p), hs_deadline, &why) && read_exact(fd.get(), &verdict, 1, hs_deadline, &why)) {
        if (verdict == kFailed) {
          uint8_t head[3] = {0, 0, 0};
          std::string text;
          if (read_exact(fd.get(), head, sizeof(head), hs_deadline, &why)) {
            text.resize(error_text_length(head));
            if (!read_exact(fd.get(), &text[0], text.size(), hs_deadline, &why)) text.clear();
          }
          throw CommError(error_kind_of(head), (text.empty() ? who + " has failed" : text) + " [reported by " +
                                                   who + "]");
        }
        if (verdict != kAccepted)
          throw CommError(ErrorKind::kPeer, who + " at " + to.str() + " refused this rank's proof of the job's " +
                                                "secret (a different job, or another secret?)");
        set_nodelay(fd.get());
        set_nonblocking(fd.get());
        return fd;
      }
    }
    // No answer, or closed before the verdict: the peer's acceptor may have dropped this
    // connection among many (it drops the oldest); try again until the deadline.
    if (Clock::now() + backoff >= deadline)
      throw CommError(ErrorKind::kTimeout, "rank " + std::to_string(rank_) + " could not complete a handshake with " +
                                               who + " at " + to.str() + " within " + seconds_text(cfg_.timeout) +
                                               " (" + std::to_string(attempt) + " attempts; the last: " + why + ")");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
}

void TcpTransport::serve_request(int peer) {
  // The progress thread may be connecting to the same peer: connect_peer serializes, and the
  // second finds the peer ready. A failure is the peer's to see (its wait names this rank).
  try {
    connect_peer(peer, Clock::now() + std::min<std::chrono::nanoseconds>(cfg_.timeout, 2 * kHandshakeTimeout));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "braid: rank %d could not connect to %s, which asked it to: %s\n", rank_,
                 peers_[static_cast<size_t>(peer)].label.c_str(), e.what());
  }
}

void TcpTransport::notify_failure(ErrorKind kind, const std::string& text, bool everyone) noexcept {
  const auto deadline = Clock::now() + kNoticeBudget;
  const std::string message = error_record(kind, text);
  for (int r = 0; r < world_ && Clock::now() < deadline; ++r) {
    // Connected peers get an abort frame (read when they next wait on this rank); with
    // `everyone`, a notice too, which their acceptor takes at once.
    if (!remote_[static_cast<size_t>(r)] || (ready(r) && !everyone)) continue;
    try {
      Fd fd = handshake_connect(r, kNoticeChannel, 0, deadline);
      std::string why;
      (void)write_exact(fd.get(), message.data(), message.size(), deadline, &why);
    } catch (const std::exception&) {  // best effort: a peer gone or failed itself needs no notice
    }
  }
}

// -- the accepting side ------------------------------------------------------------------------

void TcpTransport::start_acceptor() {
  set_nonblocking(listener_.get());  // the acceptor takes a burst of connections per wake-up
  acceptor_ = std::thread([this] { accept_loop(); });
}

void TcpTransport::stop_acceptor() noexcept {
  if (!acceptor_.joinable()) return;
  const uint64_t one = 1;
  (void)!::write(stop_fd_.get(), &one, sizeof(one));
  if (acceptor_.get_id() != std::this_thread::get_id()) acceptor_.join();
}

void TcpTransport::accept_loop() {
  name_this_thread("braid-accept");
  std::vector<std::unique_ptr<Handshake>> pending;  // oldest first
  std::vector<struct pollfd> fds;
  auto drop = [&](size_t i) {
    const Handshake& h = *pending[i];
    std::fprintf(stderr, "braid: rank %d refused a connection from %s: %s\n", rank_, h.from.c_str(), h.why.c_str());
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  };
  for (;;) {
    fds.clear();
    fds.push_back({stop_fd_.get(), POLLIN, 0});
    fds.push_back({listener_.get(), POLLIN, 0});
    for (const auto& h : pending)
      fds.push_back({h->fd.get(), static_cast<short>(h->step % 2 == 0 ? POLLIN : POLLOUT), 0});
    if (::poll(fds.data(), fds.size(), kAcceptSliceMs) < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) return;
    if (fds[1].revents & POLLIN) {
      for (int burst = 0; burst < 16; ++burst) {
        sockaddr_storage from{};
        socklen_t len = sizeof(from);
        Fd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!fd) break;
        if (pending.size() >= kMaxHandshakes) {
          pending.front()->why = "dropped: " + std::to_string(kMaxHandshakes) +
                                 " connections were being authenticated at once and it was the oldest";
          drop(0);
        }
        auto h = std::make_unique<Handshake>();
        SockAddr a;
        a.storage = from;
        a.len = len;
        h->from = a.str();
        h->fd = std::move(fd);
        h->deadline = Clock::now() + kHandshakeTimeout;
        pending.push_back(std::move(h));
      }
    }
    const auto now = Clock::now();
    for (size_t i = 0; i < pending.size();) {
      Handshake& h = *pending[i];
      int state = step_handshake(h);
      if (state == 0 && now >= h.deadline) {
        h.why = "no complete handshake within " + seconds_text(kHandshakeTimeout);
        state = -1;
      }
      if (state < 0) {
        drop(i);
      } else if (state > 0) {
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
}

// Moves the handshake on as far as its socket allows: 1 when the connection is installed, -1 when
// it is refused (h.why says why), 0 when it waits for the socket.
int TcpTransport::step_handshake(Handshake& h) {
  for (;;) {
    char* buf;
    size_t n;
    switch (h.step) {
      case 0: buf = reinterpret_cast<char*>(&h.hello), n = sizeof(h.hello); break;
      case 1: buf = reinterpret_cast<char*>(&h.challenge), n = sizeof(h.challenge); break;
      case 2: buf = reinterpret_cast<char*>(&h.proof), n = sizeof(h.proof); break;
      case 3: buf = h.verdict.data(), n = h.verdict.size(); break;
      case 4: buf = reinterpret_cast<char*>(h.notice_head), n = sizeof(h.notice_head); break;
      default: buf = &h.notice[0], n = h.notice.size(); break;
    }
    const bool reading = h.step % 2 == 0 || h.step == 5;
    while (h.pos < n) {
      const ssize_t k = reading ? ::recv(h.fd.get(), buf + h.pos, n - h.pos, MSG_DONTWAIT)
                                : ::send(h.fd.get(), buf + h.pos, n - h.pos, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (k > 0) {
        h.pos += static_cast<size_t>(k);
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
      if (k < 0 && errno == EINTR) continue;
      h.why = "the handshake broke off (" + errno_text(k == 0 ? 0 : errno) + ")";
      return -1;
    }
    h.pos = 0;
    switch (h.step) {
      case 0: {
        if (!check_hello(h)) return -1;
        Challenge& c = h.challenge;
        c.magic = kHelloMagic;
        c.version = kWireVersion;
        random_bytes(c.nonce, kNonceBytes);
        const auto mac = proof_mac(cfg_.secret, "braid-accept", h.hello, c.nonce);
        std::memcpy(c.mac, mac.data(), kMacBytes);
        break;
      }
      case 2: {
        const auto expect = proof_mac(cfg_.secret, "braid-connect", h.hello, h.challenge.nonce);
        if (!digest_equal(h.proof.mac, expect.data(), kMacBytes)) {
          h.why = "it could not prove the job's secret";
          h.verdict.assign(1, static_cast<char>(kRefused));
          break;
        }
        std::lock_guard<std::mutex> lk(accept_mu_);
        if (failed_ && h.hello.channel != kNoticeChannel) {
          h.verdict = static_cast<char>(kFailed) + error_record(failed_kind_, failed_text_);
          h.why = "this rank has failed: told it so";
        }
        break;
      }
      case 3:
        if (h.verdict[0] != static_cast<char>(kAccepted)) return -1;
        if (h.hello.channel == kNoticeChannel) break;
        return install(h) ? 1 : -1;
      case 4:
        h.notice.resize(error_text_length(h.notice_head));
        if (h.notice.empty()) h.notice = "(no message)";
        break;
      case 5: {
        peer_reported_.store(true);
        request_abort(h.notice + " [reported by " + peers_[static_cast<size_t>(h.hello.from)].label + "]",
                      error_kind_of(h.notice_head));
        return 1;
      }
      default: break;
    }
    ++h.step;
  }
}

bool TcpTransport::check_hello(Handshake& h) {
  const Hello& m = h.hello;
  if (m.magic != kHelloMagic || m.version != kWireVersion) {
    h.why = "not a braid connection (bad magic or version)";
    return false;
  }
  if (m.comm_id != comm_id_) {
    h.why = "another communicator or job (communicator id differs)";
    return false;
  }
  const bool request = m.channel == kRequestChannel, notice = m.channel == kNoticeChannel;
  if (m.to != rank_ || m.from < 0 || m.from >= world_ || !remote_[static_cast<size_t>(m.from)] ||
      (request ? m.from >= rank_ || m.index != 0
       : notice ? m.index != 0
                : m.from <= rank_ || m.channel < 0 || m.channel >= kNumChannels || m.index < 0 || m.index >= cfg_.sockets)) {
    h.why = "unexpected ranks or socket index in its hello";
    return false;
  }
  if (request || notice) return true;
  std::lock_guard<std::mutex> lk(accept_mu_);
  if (peers_[static_cast<size_t>(m.from)].socks[static_cast<size_t>(sock_index(static_cast<Channel>(m.channel), m.index))]) {
    h.why = "a second connection for a socket already connected";
    return false;
  }
  return true;
}

bool TcpTransport::install(Handshake& h) {
  const size_t from = static_cast<size_t>(h.hello.from);
  if (h.hello.channel == kRequestChannel) {  // the lower rank asks for the pair: connect to it
    h.fd.reset();
    serve_request(h.hello.from);
    return true;
  }
  const size_t slot = static_cast<size_t>(sock_index(static_cast<Channel>(h.hello.channel), h.hello.index));
  {
    std::lock_guard<std::mutex> lk(accept_mu_);
    if (failed_) return false;
    Fd& s = peers_[from].socks[slot];
    if (s) {  // two connections for one socket authenticated at once: the first stays
      h.why = "a second connection for a socket already connected";
      return false;
    }
    set_nodelay(h.fd.get());
    s = std::move(h.fd);
    if (++installed_[from] == kNumChannels * cfg_.sockets) ready_[from].store(true, std::memory_order_release);
  }
  wake();  // a wait for this peer goes on
  return true;
}

}  // namespace braid
