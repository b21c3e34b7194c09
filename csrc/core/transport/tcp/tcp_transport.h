// The TCP transport between ranks on different hosts: per peer pair and channel several sockets
// with each message striped across them in chunks, authenticated connections, checked framing,
// non-blocking progress driven by the waiting thread, abort frames that carry a failure to peers.
//
// Connections (tcp_connect.cc): of a pair of ranks the higher one connects, the lower accepts.
// An acceptor thread serves the listener for the transport's life, authenticating up to
// kMaxHandshakes connections at once, each with its own deadline, so strangers (idle, slow,
// garbage) cost only their own sockets. Eager (connect() opens every connection) or on demand
// (TcpConfig::lazy: a pair's sockets are opened when either rank first uses the pair: the higher
// rank connects from its progress thread; the lower one sends the higher one's acceptor an
// authenticated request, which that acceptor answers by connecting, whatever the higher rank's
// progress thread is doing), so that descriptors and setup grow with the peers an algorithm
// uses, not with the number of ranks.
#pragma once

#include <atomic>
#include <memory>
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
  bool lazy = false;               // open each peer's connections when first used (else in connect())
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
  // Learns every rank r with remote[r] true: endpoints[r], named labels[r] in errors, and starts
  // accepting. Eager: then connects to every one (the higher rank of a pair connects, the lower
  // accepts), closes the listener once every peer is connected, and throws CommTimeout naming
  // the peers missing at the deadline. Lazy: returns at once; each pair connects at first use.
  // Every connection proves the secret both ways before it is used; anything else that
  // connects is refused (and logged) and connecting goes on.
  void connect(const std::vector<std::string>& endpoints, const std::vector<bool>& remote,
               const std::vector<std::string>& labels);
  // Peers whose connections are open now, and the sockets they hold.
  int connected_peers() const;
  int open_sockets() const { return connected_peers() * kNumChannels * cfg_.sockets; }

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
  // Every remote peer, connected or not, also gets a notice on a connection of its own (its
  // acceptor takes it even while the peer is busy elsewhere), within about a second in all,
  // unless the failure is a timeout, a close, or one a peer reported (so that a failure does not
  // cascade into every rank telling every other). A peer that connects later is answered with
  // the failure.
  void publish_failure(ErrorKind kind, const std::string& msg) noexcept;
  // With the flight recorder's dumps on: failures (timeouts included) go as notices to every
  // rank on another host, connected or not, so that a rank busy elsewhere learns of them (its
  // acceptor takes the notice) and dumps its trace too.
  void set_notify_everyone(bool on) { notify_everyone_ = on; }
  // A failure a peer reported (a notice or an abort frame) as "message [reported by ...]", or
  // empty. From any thread.
  std::string reported_failure();
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

  struct Handshake;  // an incoming connection being authenticated (tcp_connect.cc)
  void start_acceptor();
  void stop_acceptor() noexcept;
  void accept_loop();
  int step_handshake(Handshake& h);
  bool check_hello(Handshake& h);
  bool install(Handshake& h);
  bool ready(int peer) const { return ready_[static_cast<size_t>(peer)].load(std::memory_order_acquire); }
  // The progress thread: whether `peer`'s sockets can be used (connecting to it now when this
  // rank is the pair's connector).
  bool ensure_connected(int peer);
  // Opens `peer`'s sockets (this rank the higher), serialized per peer (the progress thread and
  // the acceptor, answering a request, may both want to).
  void connect_peer(int peer, Clock::time_point deadline);
  // One authenticated socket to `peer` (channel kRequestChannel: a request to connect back).
  Fd handshake_connect(int peer, int channel, int index, Clock::time_point deadline);
  void serve_request(int peer);
  void notify_failure(ErrorKind kind, const std::string& text, bool everyone) noexcept;
  bool notify_everyone_ = false;
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
  std::vector<SockAddr> addrs_;  // each remote peer's listener
  // A peer's sockets are used only once it is ready (all of them open): the acceptor thread
  // fills the sockets of higher ranks under accept_mu_, the progress thread those of lower ones.
  std::unique_ptr<std::atomic<bool>[]> ready_;
  std::vector<int> installed_;  // sockets accepted per peer (under accept_mu_)
  std::unique_ptr<std::mutex[]> connect_mu_;  // per peer: one connect_peer at a time
  std::vector<bool> requested_;  // lower rank: asked the peer to connect (progress thread)
  // After publish_failure (under accept_mu_): every connection authenticated from then on is
  // answered with this failure instead of being installed, so that a peer that connects late
  // learns it at once.
  bool failed_ = false;
  std::atomic<bool> peer_reported_{false};  // the failure came from a peer (a frame or a notice)
  ErrorKind failed_kind_ = ErrorKind::kGeneric;
  std::string failed_text_;
  std::mutex accept_mu_;
  std::thread acceptor_;
  Fd stop_fd_;  // eventfd: stops the acceptor
  std::atomic<bool> abort_requested_{false};
  std::mutex abort_mu_;
  std::string abort_msg_;
  ErrorKind abort_kind_ = ErrorKind::kGeneric;
  uint64_t bytes_sent_ = 0, bytes_received_ = 0;
};

}  // namespace braid
