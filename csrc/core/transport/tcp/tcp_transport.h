// The TCP transport between ranks on different hosts: per peer pair and channel several sockets
// with each message striped across them in chunks, authenticated connections, checked framing,
// non-blocking progress driven by the waiting thread, abort frames that carry a failure to peers.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../../errors.h"
#include "../transport.h"
#include "frame.h"
#include "socket.h"

namespace braid {

struct TcpConfig {
  int sockets = 2;                 // per peer pair and channel
  size_t chunk_bytes = 512 << 10;  // a message is striped across the sockets in chunks this big
  std::chrono::nanoseconds timeout{std::chrono::seconds(300)};  // every wait's deadline
  std::vector<uint8_t> secret;     // the job's secret: both ends of a connection prove they know it
};

class TcpTransport : public Transport {
 public:
  // Listens on `bind_ip` (an IP literal), port chosen by the kernel.
  TcpTransport(int rank, int world_size, const std::string& bind_ip, TcpConfig cfg);
  ~TcpTransport() override;
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  // What peers connect to: "ip:port" or "[ip6]:port".
  std::string address() const { return bound_.str(); }
  // Connects to every rank r with remote[r] true, using endpoints[r] and naming it labels[r] in
  // errors: the higher rank of a pair connects, the lower accepts. Every connection proves the
  // secret both ways before it is used; anything else that connects is refused (and logged) and
  // connecting goes on. Closes the listener once every peer is connected. Throws CommTimeout
  // naming the peers missing at the deadline.
  void connect(const std::vector<std::string>& endpoints, const std::vector<bool>& remote,
               const std::vector<std::string>& labels);

  bool advance(P2POp& op) override;
  // Whether a message from `peer` on `channel` has begun to arrive (or its connection has news,
  // e.g. EOF, which receiving it reports), for a receive from any source. wait() on a receive
  // not yet started waits for the same.
  bool incoming(int peer, Channel channel);
  void wait(P2POp* const* ops, int nops, const std::function<bool()>& interrupted) override {
    wait(ops, nops, interrupted, std::chrono::milliseconds(50));
  }
  // wait() that looks at `interrupted` at least every `slice` (a caller that also watches
  // another transport).
  void wait(P2POp* const* ops, int nops, const std::function<bool()>& interrupted, std::chrono::milliseconds slice);
  void wake() noexcept override;

  // The collective in progress, for error messages (may be null).
  void set_current(const CollectiveDesc* d) { current_ = d; }
  // Tells every peer about this rank's failure (an abort frame where a socket is between frames),
  // then shuts the sockets down: a peer waiting on this rank fails with the same error at once.
  void publish_failure(ErrorKind kind, const std::string& msg) noexcept;
  // From any thread: the waiting thread fails its current or next wait with CommError(kind, msg).
  void request_abort(const std::string& msg, ErrorKind kind);
  // Closes every socket (normal departure: peers still waiting on this rank get PeerError).
  void close() noexcept;

  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }
  int rank() const { return rank_; }

 private:
  struct Stripe;  // one socket's part of the message in flight on a lane
  struct Lane {
    uint64_t msg = 0;       // messages finished on this lane
    bool active = false;    // a message is in flight
    size_t total = 0;
    size_t nchunks = 1;     // the message's chunks (a zero-byte message still sends one)
    size_t moved = 0;       // payload bytes moved
    std::vector<Stripe> stripes;
  };
  struct Peer {
    std::vector<Fd> socks;  // channel * sockets + index
    std::string label;
    Lane lanes[2][kNumChannels];  // [send][channel]
    bool shut = false;
  };

  void accept_loop(Clock::time_point deadline);
  bool accept_one(Fd fd, Clock::time_point deadline, std::string* why);
  void handshake_connect(int peer, int channel, int index, const SockAddr& to, Clock::time_point deadline);
  void start(Lane& lane, const P2POp& op);
  bool pump_send(Peer& p, int peer, Lane& lane, P2POp& op);
  bool pump_recv(Peer& p, int peer, Lane& lane, P2POp& op);
  [[noreturn]] void fail_io(int peer, const P2POp& op, const std::string& what);
  void check_header(int peer, const P2POp& op, const Lane& lane, const Stripe& s) const;
  void check_abort();
  std::string doing(const P2POp& op) const;
  int sock_index(Channel c, int i) const { return static_cast<int>(c) * cfg_.sockets + i; }
  // The socket the next message of `lane` begins on (chunk 0 of message m goes on socket m % k).
  int first_socket(const Lane& lane, Channel c) const {
    return sock_index(c, static_cast<int>(lane.msg % static_cast<uint64_t>(cfg_.sockets)));
  }

  int rank_;
  int world_;
  TcpConfig cfg_;
  uint64_t comm_id_;
  SockAddr bound_;
  Fd listener_;
  Fd wake_fd_;  // eventfd: wake() and request_abort() interrupt a poll
  std::vector<Peer> peers_;  // index = rank; entries of same-host ranks stay empty
  std::vector<bool> remote_;
  const CollectiveDesc* current_ = nullptr;
  std::mutex accept_mu_;  // accepted connections: the accepting thread fills peers_ socks
  std::atomic<int> accepted_{0};
  std::atomic<bool> abort_requested_{false};
  std::mutex abort_mu_;
  std::string abort_msg_;
  ErrorKind abort_kind_ = ErrorKind::kGeneric;
  uint64_t bytes_sent_ = 0, bytes_received_ = 0;
};

}  // namespace braid
