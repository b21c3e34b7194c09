// The TCP transport: connection setup with mutual challenge-response authentication, striped
// non-blocking transfers with checked frames, waits with a deadline, failure propagation.
#include "tcp_transport.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "../../dtype.h"
#include "../../interrupt.h"
#include "../../tunables.h"
#include "hmac_sha256.h"

namespace braid {

namespace {
// Longest a poll sleeps before looking at the deadline, aborts and signals again.
constexpr int kPollSliceMs = 50;
constexpr auto kInterruptAfter = std::chrono::milliseconds(100);

uint64_t derive_comm_id(const std::vector<uint8_t>& secret) {
  static const char kLabel[] = "braid-communicator-id";
  const auto mac = hmac_sha256(secret.data(), secret.size(), kLabel, sizeof(kLabel) - 1);
  uint64_t id = 0;
  std::memcpy(&id, mac.data(), sizeof(id));
  return id;
}

}  // namespace

struct TcpTransport::Stripe {
  int sock = 0;            // index into Peer::socks
  size_t chunk = 0;        // the chunk this socket moves next
  size_t pos = 0;          // bytes of that chunk's frame (header + payload) moved
  bool finished = false;
  FrameHeader hdr{};       // send: the header being written; recv: the one being read
  std::string abort_text;  // recv: an abort frame's message
  // The frame is done: on to this socket's next chunk (every `stride`-th of `nchunks`).
  void next_chunk(size_t stride, size_t nchunks) {
    pos = 0;
    chunk += stride;
    finished = chunk >= nchunks;
  }
};

TcpTransport::TcpTransport(int rank, int world_size, const std::string& bind_ip, TcpConfig cfg)
    : rank_(rank), world_(world_size), cfg_(std::move(cfg)) {
  if (cfg_.sockets < 1 || cfg_.sockets > Tunables::kMaxSockets)
    throw std::invalid_argument("BRAID_NSOCKS must be in [1, " + std::to_string(Tunables::kMaxSockets) + "]");
  if (cfg_.chunk_bytes < Tunables::kMinSocketChunkBytes || cfg_.chunk_bytes > Tunables::kMaxSocketChunkBytes)
    throw std::invalid_argument("BRAID_SOCKET_CHUNK_BYTES must be in [4096, 2^30]");
  if (cfg_.secret.size() < 16) throw std::invalid_argument("the TCP transport needs a secret of at least 16 bytes");
  comm_id_ = derive_comm_id(cfg_.secret);
  listener_ = listen_on(bind_ip, &bound_);
  wake_fd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_) throw_system_error("eventfd", errno);
  stop_fd_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!stop_fd_) throw_system_error("eventfd", errno);
  peers_.resize(static_cast<size_t>(world_size));
  remote_.assign(static_cast<size_t>(world_size), false);
  addrs_.resize(static_cast<size_t>(world_size));
  installed_.assign(static_cast<size_t>(world_size), 0);
  ready_.reset(new std::atomic<bool>[static_cast<size_t>(world_size)]);
  connect_mu_.reset(new std::mutex[static_cast<size_t>(world_size)]);
  requested_.assign(static_cast<size_t>(world_size), false);
  for (int r = 0; r < world_size; ++r) ready_[static_cast<size_t>(r)].store(false);
}

TcpTransport::~TcpTransport() { close(); }

void TcpTransport::start(Lane& lane, const P2POp& op) {
  const size_t k = static_cast<size_t>(cfg_.sockets);
  const size_t nchunks = std::max<size_t>(1, (op.bytes + cfg_.chunk_bytes - 1) / cfg_.chunk_bytes);
  lane.active = true;
  lane.total = op.bytes;
  lane.nchunks = nchunks;
  lane.moved = 0;
  lane.stripes.resize(k);
  for (size_t i = 0; i < k; ++i) {
    Stripe& s = lane.stripes[i];
    s = Stripe{};
    s.sock = sock_index(op.channel, static_cast<int>(i));
    s.chunk = (i + k - lane.msg % k) % k;  // chunk j goes on socket (msg + j) % k
    s.finished = s.chunk >= nchunks;
  }
}

std::string TcpTransport::doing(const P2POp& op) const {
  std::string s = op.describe();
  if (op.desc != nullptr) s += " in " + op.desc->describe();
  return s;
}

void TcpTransport::fail_io(int peer, const P2POp& op, const std::string& what) {
  // A peer that failed writes an abort frame on each of its sockets that is between frames and
  // then shuts them down: a send of this rank can meet the shutdown (EPIPE) before anything read
  // the frame. Its error, where it waits unread at the front of a socket, is the one to raise.
  Peer& p = peers_[static_cast<size_t>(peer)];
  std::string buf(sizeof(FrameHeader) + kMaxAbortText, '\0');
  for (const Fd& fd : p.socks) {
    if (!fd) continue;
    const ssize_t n = ::recv(fd.get(), &buf[0], buf.size(), MSG_PEEK | MSG_DONTWAIT);
    if (n < static_cast<ssize_t>(sizeof(FrameHeader))) continue;
    FrameHeader h;
    std::memcpy(&h, buf.data(), sizeof(h));
    const bool abort = h.magic == kFrameMagic && h.version == kWireVersion && h.comm_id == comm_id_ &&
                       h.kind == static_cast<uint8_t>(FrameKind::kAbort) && h.length <= kMaxAbortText &&
                       h.error >= static_cast<uint32_t>(ErrorKind::kGeneric) &&
                       h.error <= static_cast<uint32_t>(ErrorKind::kClosed) &&
                       n >= static_cast<ssize_t>(sizeof(FrameHeader) + h.length);
    if (!abort) continue;
    peer_reported_.store(true);
    throw CommError(static_cast<ErrorKind>(h.error),
                    buf.substr(sizeof(FrameHeader), h.length) + " [reported by " + p.label + "]");
  }
  throw CommError(ErrorKind::kPeer, p.label + " " + what + " during " + doing(op) + " while rank " +
                                        std::to_string(rank_) + " waited for it");
}

bool TcpTransport::pump_send(Peer& p, int peer, Lane& lane, P2POp& op) {
  bool all = true;
  for (Stripe& s : lane.stripes) {
    while (!s.finished) {
      const size_t offset = s.chunk * cfg_.chunk_bytes;
      const size_t len = std::min(cfg_.chunk_bytes, lane.total - std::min(lane.total, offset));
      if (s.pos == 0) {
        s.hdr = FrameHeader{};
        s.hdr.magic = kFrameMagic;
        s.hdr.version = kWireVersion;
        s.hdr.kind = static_cast<uint8_t>(FrameKind::kData);
        s.hdr.channel = static_cast<uint8_t>(op.channel);
        s.hdr.dtype = static_cast<uint8_t>(op.dtype);
        s.hdr.comm_id = comm_id_;
        s.hdr.msg = lane.msg;
        s.hdr.total = lane.total;
        s.hdr.offset = offset;
        s.hdr.length = static_cast<uint32_t>(len);
        if (op.desc != nullptr) s.hdr.desc = *op.desc;
      }
      struct iovec iov[2];
      int n = 0;
      if (s.pos < sizeof(FrameHeader))
        iov[n++] = {reinterpret_cast<char*>(&s.hdr) + s.pos, sizeof(FrameHeader) - s.pos};
      const size_t pay_done = s.pos > sizeof(FrameHeader) ? s.pos - sizeof(FrameHeader) : 0;
      if (len > pay_done) iov[n++] = {op.data + offset + pay_done, len - pay_done};
      ssize_t w = 0;
      if (n > 0) {
        struct msghdr m{};
        m.msg_iov = iov;
        m.msg_iovlen = static_cast<size_t>(n);
        w = ::sendmsg(p.socks[static_cast<size_t>(s.sock)].get(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          if (errno == EINTR) continue;
          fail_io(peer, op, "is gone (" + errno_text(errno) + ")");
        }
      }
      const size_t before = s.pos > sizeof(FrameHeader) ? s.pos - sizeof(FrameHeader) : 0;
      s.pos += static_cast<size_t>(w);
      const size_t after = s.pos > sizeof(FrameHeader) ? s.pos - sizeof(FrameHeader) : 0;
      lane.moved += after - before;
      bytes_sent_ += after - before;
      if (s.pos == sizeof(FrameHeader) + len) s.next_chunk(lane.stripes.size(), lane.nchunks);
    }
    all = all && s.finished;
  }
  op.off = lane.moved;
  return all;
}

void TcpTransport::check_header(int peer, const P2POp& op, const Lane& lane, const Stripe& s) const {
  const FrameHeader& h = s.hdr;
  const std::string& who = peers_[peer].label;
  auto malformed = [&](const std::string& what) {
    return CommError(ErrorKind::kGeneric, "rank " + std::to_string(rank_) + " received a malformed frame from " +
                                              who + " (" + what + ") during " + doing(op));
  };
  if (h.magic != kFrameMagic || h.version != kWireVersion || h.comm_id != comm_id_)
    throw malformed("bad magic, version or communicator id");
  if (h.kind == static_cast<uint8_t>(FrameKind::kAbort)) {
    if (h.length > kMaxAbortText || h.error < static_cast<uint32_t>(ErrorKind::kGeneric) ||
        h.error > static_cast<uint32_t>(ErrorKind::kClosed))
      throw malformed("bad abort frame");
    return;
  }
  if (h.kind != static_cast<uint8_t>(FrameKind::kData)) throw malformed("unknown frame kind");
  if (h.channel != static_cast<uint8_t>(op.channel) || h.msg != lane.msg)
    throw malformed("wrong channel or message index");
  if (op.desc != nullptr && !(h.desc == *op.desc))
    throw CommError(ErrorKind::kMismatch, "collective mismatch: rank " + std::to_string(rank_) + " called " +
                                              op.desc->describe() + " but " + who + " called " + h.desc.describe());
  if (h.total != op.bytes || h.dtype != static_cast<uint8_t>(op.dtype))
    throw CommError(ErrorKind::kMismatch,
                    "point-to-point mismatch: rank " + std::to_string(rank_) + " expected " + std::to_string(op.bytes) +
                        " bytes of " + dtype_name(op.dtype) + " from " + who + ", which sent " +
                        std::to_string(h.total) + " bytes of " +
                        (h.dtype <= static_cast<uint8_t>(DType::kUInt8) ? dtype_name(static_cast<DType>(h.dtype)) : "?"));
  const size_t offset = s.chunk * cfg_.chunk_bytes;
  const size_t len = std::min(cfg_.chunk_bytes, lane.total - std::min(lane.total, offset));
  if (h.offset != offset || h.length != len) throw malformed("chunk offset or length out of sequence");
}

bool TcpTransport::pump_recv(Peer& p, int peer, Lane& lane, P2POp& op) {
  bool all = true;
  for (Stripe& s : lane.stripes) {
    while (!s.finished) {
      const int fd = p.socks[static_cast<size_t>(s.sock)].get();
      ssize_t r;
      const bool in_header = s.pos < sizeof(FrameHeader);
      const size_t pay_done = in_header ? 0 : s.pos - sizeof(FrameHeader);
      const bool abort_frame = !in_header && s.hdr.kind == static_cast<uint8_t>(FrameKind::kAbort);
      if (in_header) {
        r = ::recv(fd, reinterpret_cast<char*>(&s.hdr) + s.pos, sizeof(FrameHeader) - s.pos, MSG_DONTWAIT);
      } else if (abort_frame) {
        s.abort_text.resize(s.hdr.length);
        r = s.hdr.length == pay_done ? 0 : ::recv(fd, &s.abort_text[pay_done], s.hdr.length - pay_done, MSG_DONTWAIT);
      } else {
        r = s.hdr.length == pay_done ? 0
                                     : ::recv(fd, op.data + s.hdr.offset + pay_done, s.hdr.length - pay_done, MSG_DONTWAIT);
      }
      const bool payload_left = in_header || s.hdr.length > pay_done;
      if (payload_left) {
        if (r == 0) fail_io(peer, op, "closed its connection");
        if (r < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          if (errno == EINTR) continue;
          fail_io(peer, op, "is gone (" + errno_text(errno) + ")");
        }
        s.pos += static_cast<size_t>(r);
        if (!in_header) {
          if (!abort_frame) {
            lane.moved += static_cast<size_t>(r);
            bytes_received_ += static_cast<size_t>(r);
          }
        } else if (s.pos == sizeof(FrameHeader)) {
          check_header(peer, op, lane, s);
        }
      }
      if (s.pos >= sizeof(FrameHeader) && s.pos == sizeof(FrameHeader) + s.hdr.length) {
        if (s.hdr.kind == static_cast<uint8_t>(FrameKind::kAbort)) {
          peer_reported_.store(true);
          throw CommError(static_cast<ErrorKind>(s.hdr.error), s.abort_text + " [reported by " + peers_[peer].label + "]");
        }
        s.next_chunk(lane.stripes.size(), lane.nchunks);
      }
    }
    all = all && s.finished;
  }
  op.off = lane.moved;
  return all;
}

bool TcpTransport::incoming(int peer, Channel channel) {
  check_abort();
  Peer& p = peers_[static_cast<size_t>(peer)];
  if (p.shut || !ensure_connected(peer)) return false;
  const Lane& lane = p.lanes[0][static_cast<int>(channel)];
  if (lane.active) return true;
  struct pollfd fd = {p.socks[static_cast<size_t>(first_socket(lane, channel))].get(), POLLIN, 0};
  return ::poll(&fd, 1, 0) > 0 && fd.revents != 0;
}

bool TcpTransport::advance(P2POp& op) {
  if (op.done) return true;
  check_abort();
  Peer& p = peers_[static_cast<size_t>(op.peer)];
  if (p.shut) fail_io(op.peer, op, "is unreachable: this rank's connections were shut down after a failure");
  if (!ensure_connected(op.peer)) return false;
  Lane& lane = p.lanes[op.send ? 1 : 0][static_cast<int>(op.channel)];
  if (!lane.active) start(lane, op);
  const bool finished = op.send ? pump_send(p, op.peer, lane, op) : pump_recv(p, op.peer, lane, op);
  if (finished) {
    lane.active = false;
    ++lane.msg;
    op.off = op.bytes;
    op.done = true;
  }
  return op.done;
}

void TcpTransport::check_abort() {
  if (!abort_requested_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lk(abort_mu_);
  throw CommError(abort_kind_, abort_msg_);
}

void TcpTransport::wait(P2POp* const* ops, int nops, const std::function<bool()>& interrupted,
                        std::chrono::milliseconds slice) {
  std::vector<struct pollfd> fds;
  fds.push_back({wake_fd_.get(), POLLIN, 0});
  std::vector<int> unconnected;  // peers this rank waits to connect to it (the acceptor wakes it)
  for (int i = 0; i < nops; ++i) {
    if (!ready(ops[i]->peer)) {
      if (rank_ > ops[i]->peer) return;  // this rank connects: let the caller advance it
      unconnected.push_back(ops[i]->peer);
      continue;
    }
    Peer& p = peers_[static_cast<size_t>(ops[i]->peer)];
    Lane& lane = p.lanes[ops[i]->send ? 1 : 0][static_cast<int>(ops[i]->channel)];
    if (!lane.active && ops[i]->send) return;  // not started: let the caller advance it
    if (!lane.active) {  // a receive not started (one from any source): its message's first socket
      fds.push_back({p.socks[static_cast<size_t>(first_socket(lane, ops[i]->channel))].get(), POLLIN, 0});
      continue;
    }
    for (const Stripe& s : lane.stripes)
      if (!s.finished)
        fds.push_back({p.socks[static_cast<size_t>(s.sock)].get(), static_cast<short>(ops[i]->send ? POLLOUT : POLLIN), 0});
  }
  const auto start = Clock::now();
  const auto deadline = start + cfg_.timeout;
  for (;;) {
    check_abort();
    if (interrupted()) return;
    for (int peer : unconnected)
      if (ready(peer)) return;
    const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(slice.count(), kPollSliceMs)));
    if (rc < 0 && errno != EINTR) throw_system_error("poll", errno);
    if (rc > 0) {
      if (fds[0].revents != 0) {
        uint64_t v;
        while (::read(wake_fd_.get(), &v, sizeof(v)) > 0) {
        }
      }
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents != 0) return;  // data, room, EOF or an error: advance() sees which
      continue;
    }
    const auto now = Clock::now();
    if (now - start >= kInterruptAfter && interrupt_requested())
      throw Interrupted("rank " + std::to_string(rank_) + " was interrupted by a signal during " + doing(*ops[0]));
    if (now >= deadline) {
      std::string waiting, missing;
      for (int i = 0; i < nops; ++i) {
        waiting += (i ? ", " : "") + ops[i]->describe();
        const std::string who = peers_[static_cast<size_t>(ops[i]->peer)].label +
                                (ready(ops[i]->peer) ? "" : " (it never connected to this rank)");
        if (missing.find(who) == std::string::npos) missing += (missing.empty() ? "" : ", ") + who;
      }
      throw CommError(ErrorKind::kTimeout,
                      "rank " + std::to_string(rank_) + " timed out: no progress within the timeout of " +
                          number_text(std::chrono::duration<double>(cfg_.timeout).count()) + " s" +
                          (current_ != nullptr ? " in " + current_->describe() : std::string()) + " waiting for " +
                          waiting + ": nothing heard from " + missing);
    }
  }
}

void TcpTransport::wake() noexcept {
  const uint64_t one = 1;
  if (wake_fd_) (void)!::write(wake_fd_.get(), &one, sizeof(one));
}

std::string TcpTransport::reported_failure() {
  if (!peer_reported_.load() || !abort_requested_.load(std::memory_order_acquire)) return {};
  std::lock_guard<std::mutex> lk(abort_mu_);
  return abort_msg_;
}

void TcpTransport::request_abort(const std::string& msg, ErrorKind kind) {
  {
    std::lock_guard<std::mutex> lk(abort_mu_);
    if (!abort_requested_.load()) {
      abort_msg_ = msg;
      abort_kind_ = kind;
    }
  }
  abort_requested_.store(true, std::memory_order_release);
  wake();
}

void TcpTransport::publish_failure(ErrorKind kind, const std::string& msg) noexcept {
  const std::string text = msg.substr(0, kMaxAbortText);
  {
    // No new connections from here on: one authenticated later is answered with this failure
    // (a peer that connects late raises at once instead of waiting for data that will not come).
    std::lock_guard<std::mutex> lk(accept_mu_);
    failed_ = true;
    failed_kind_ = kind == ErrorKind::kNone ? ErrorKind::kGeneric : kind;
    failed_text_ = text;
  }
  const bool tell = kind != ErrorKind::kClosed && (notify_everyone_ || kind != ErrorKind::kTimeout);
  // Every remote peer gets a notice, the connected ones too: a connected peer reads this rank's
  // abort frame only when it next waits on this rank, and it may be blocked elsewhere meanwhile
  // (connecting to a peer that was told and has left), which its acceptor's notice interrupts.
  if (tell && !peer_reported_.load()) notify_failure(failed_kind_, text, /*everyone=*/true);
  for (size_t r = 0; r < peers_.size(); ++r) {
    Peer& p = peers_[r];
    // The acceptor may be connecting to this peer (a request): its sockets are written then.
    std::lock_guard<std::mutex> connecting(connect_mu_[r]);
    if (p.shut || p.socks.empty()) continue;
    for (size_t i = 0; i < p.socks.size(); ++i) {
      if (!p.socks[i]) continue;
      // A socket in the middle of a frame cannot take another one: the peer learns from the EOF.
      bool between_frames = true;
      for (const Lane& lane : p.lanes[1])
        if (lane.active)
          for (const Stripe& s : lane.stripes)
            if (s.sock == static_cast<int>(i) && s.pos != 0) between_frames = false;
      if (between_frames) {
        FrameHeader h{};
        h.magic = kFrameMagic;
        h.version = kWireVersion;
        h.kind = static_cast<uint8_t>(FrameKind::kAbort);
        h.comm_id = comm_id_;
        h.length = static_cast<uint32_t>(text.size());
        h.error = static_cast<uint32_t>(kind == ErrorKind::kNone ? ErrorKind::kGeneric : kind);
        struct iovec iov[2] = {{&h, sizeof(h)}, {const_cast<char*>(text.data()), text.size()}};
        struct msghdr m{};
        m.msg_iov = iov;
        m.msg_iovlen = 2;
        // Best effort and never blocking: a full socket buffer means the peer is not reading
        // anyway, and the shutdown below reaches it as EOF.
        (void)::sendmsg(p.socks[i].get(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
      }
      // Write side only: a reset could make the peer drop the abort frame still unread.
      ::shutdown(p.socks[i].get(), SHUT_WR);
    }
    p.shut = true;
  }
}

void TcpTransport::close() noexcept {
  stop_acceptor();
  for (Peer& p : peers_)
    for (Fd& s : p.socks) s.reset();
  listener_.reset();
}

}  // namespace braid
