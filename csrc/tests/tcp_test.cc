// The TCP transport between two in-process ranks (one thread each) and against a hand-driven
// peer: striping across sockets at chunk boundaries, both directions and channels at once,
// partial reads and writes, EOF, abort frames, size and descriptor mismatches, refused strangers
// and wrong secrets, strangers holding connections while the job connects, connections on demand
// (and a failure reaching a peer never connected), and fuzzed frames that must fail cleanly
// without touching memory around the
// receive buffer.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <atomic>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "core/transport/tcp/frame.h"
#include "core/transport/tcp/hmac_sha256.h"
#include "core/transport/tcp/tcp_transport.h"

using braid::Channel;
using braid::CommError;
using braid::ErrorKind;
using braid::P2POp;
using braid::TcpConfig;
using braid::TcpTransport;
using namespace braid_test;

namespace {

constexpr size_t kChunk = 4096;

std::vector<uint8_t> secret(uint8_t salt) { return std::vector<uint8_t>(32, salt); }

TcpConfig config(int sockets, uint8_t salt = 7, double timeout_s = 5) {
  TcpConfig c;
  c.sockets = sockets;
  c.chunk_bytes = kChunk;
  c.timeout = std::chrono::nanoseconds(static_cast<int64_t>(timeout_s * 1e9));
  c.secret = secret(salt);
  return c;
}

// Two connected transports, ranks 0 and 1 of a world of 2 on different hosts.
struct Pair {
  std::unique_ptr<TcpTransport> t[2];
  explicit Pair(int sockets) {
    for (int r = 0; r < 2; ++r) t[r] = std::make_unique<TcpTransport>(r, 2, "127.0.0.1", config(sockets));
    const std::vector<std::string> eps = {t[0]->address(), t[1]->address()};
    std::thread acceptor([&] { t[0]->connect(eps, {false, true}, {"rank 0", "rank 1"}); });
    t[1]->connect(eps, {true, false}, {"rank 0", "rank 1"});
    acceptor.join();
  }
};

P2POp op(int peer, bool send, void* data, size_t bytes, Channel ch = Channel::kUser) {
  P2POp o;
  o.peer = peer;
  o.send = send;
  o.data = static_cast<char*>(data);
  o.bytes = bytes;
  o.dtype = braid::DType::kUInt8;
  o.channel = ch;
  return o;
}

std::vector<char> pattern(size_t n, int salt) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + static_cast<size_t>(salt) * 17) % 251);
  return v;
}

// Runs `ops` of each rank on its own thread; returns the first error of each (empty when none).
std::vector<std::string> run_both(Pair& p, std::vector<P2POp>* ops) {
  std::vector<std::string> errors(2);
  std::thread other([&] {
    try {
      std::vector<P2POp*> ptrs;
      for (P2POp& o : ops[1]) ptrs.push_back(&o);
      p.t[1]->run(ptrs.data(), static_cast<int>(ptrs.size()));
    } catch (const std::exception& e) {
      errors[1] = e.what();
    }
  });
  try {
    std::vector<P2POp*> ptrs;
    for (P2POp& o : ops[0]) ptrs.push_back(&o);
    p.t[0]->run(ptrs.data(), static_cast<int>(ptrs.size()));
  } catch (const std::exception& e) {
    errors[0] = e.what();
  }
  other.join();
  return errors;
}

}  // namespace

// Sizes around the chunk and stripe boundaries, both directions and both channels in flight at
// once, several messages per lane (each starts its stripes on the next socket).
BRAID_TEST(striped_messages_arrive_whole_in_order) {
  for (int sockets : {1, 3}) {
    Pair p(sockets);
    const size_t sizes[] = {0, 1, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk - 1, 3 * kChunk + 1, 7 * kChunk + 5, 1 << 20};
    std::vector<std::vector<char>> sent[2], got[2];
    std::vector<P2POp> ops[2];
    for (int r = 0; r < 2; ++r)
      for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); ++i) {
        sent[r].push_back(pattern(sizes[i], r * 100 + static_cast<int>(i)));
        got[r].push_back(std::vector<char>(sizes[i] + 1, 'x'));
      }
    for (int r = 0; r < 2; ++r)
      for (size_t i = 0; i < sent[r].size(); ++i) {
        const Channel ch = i % 2 ? Channel::kCollective : Channel::kUser;
        ops[r].push_back(op(1 - r, true, sent[r][i].data(), sent[r][i].size(), ch));
        ops[r].push_back(op(1 - r, false, got[r][i].data(), sizes[i], ch));
      }
    const auto errors = run_both(p, ops);
    CHECK_MSG(errors[0].empty() && errors[1].empty(), errors[0] + " | " + errors[1]);
    for (int r = 0; r < 2; ++r)
      for (size_t i = 0; i < sent[r].size(); ++i) {
        CHECK(sizes[i] == 0 || std::memcmp(got[r][i].data(), sent[1 - r][i].data(), sizes[i]) == 0);
        CHECK_EQ(got[r][i].back(), 'x');  // nothing past the message
      }
    CHECK_EQ(p.t[0]->bytes_sent(), p.t[1]->bytes_received());
  }
}

// A receiver that advances only now and then: the sender's writes stop at a full socket buffer
// and resume where they stopped (partial writes), the reader takes what is there (partial reads).
BRAID_TEST(slow_reader_partial_reads_and_writes) {
  Pair p(2);
  const size_t n = 16 << 20;  // far past the socket buffers
  std::vector<char> data = pattern(n, 3), got(n, 0);
  P2POp s = op(0, true, data.data(), n);
  std::thread sender([&] {
    P2POp* ops[] = {&s};
    p.t[1]->run(ops, 1);
  });
  P2POp r = op(1, false, got.data(), n);
  int rounds = 0;
  while (!p.t[0]->advance(r)) {
    ++rounds;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  sender.join();
  CHECK(rounds > 1);
  CHECK(got == data);
}

BRAID_TEST(peer_closing_is_a_peer_error_naming_it) {
  Pair p(2);
  std::vector<char> buf(100);
  p.t[1]->close();
  P2POp r = op(1, false, buf.data(), buf.size());
  P2POp* ops[] = {&r};
  const std::string msg = CHECK_THROWS_KIND(ErrorKind::kPeer, p.t[0]->run(ops, 1));
  CHECK_MSG(msg.find("rank 1 closed its connection") != std::string::npos, msg);
}

BRAID_TEST(abort_frame_carries_the_failure) {
  Pair p(2);
  std::vector<char> buf(100);
  p.t[1]->publish_failure(ErrorKind::kMismatch, "rank 1 saw a mismatch");
  P2POp r = op(1, false, buf.data(), buf.size(), Channel::kCollective);
  P2POp* ops[] = {&r};
  const std::string msg = CHECK_THROWS_KIND(ErrorKind::kMismatch, p.t[0]->run(ops, 1));
  CHECK_MSG(msg.find("rank 1 saw a mismatch [reported by rank 1]") != std::string::npos, msg);
}

BRAID_TEST(size_and_descriptor_mismatches_are_refused) {
  {
    Pair p(2);
    std::vector<char> a(100), b(200);
    std::vector<P2POp> ops[2];
    ops[1].push_back(op(0, true, a.data(), a.size()));
    ops[0].push_back(op(1, false, b.data(), b.size()));
    const auto errors = run_both(p, ops);
    CHECK_MSG(errors[0].find("expected 200 bytes of uint8 from rank 1, which sent 100") != std::string::npos,
              errors[0]);
  }
  {
    Pair p(2);
    braid::CollectiveDesc mine, theirs;
    mine.seq = theirs.seq = 4;
    mine.kind = static_cast<uint8_t>(braid::CollKind::kAllReduce);
    theirs.kind = static_cast<uint8_t>(braid::CollKind::kAllGather);
    std::vector<char> a(64), b(64);
    std::vector<P2POp> ops[2];
    ops[1].push_back(op(0, true, a.data(), a.size(), Channel::kCollective));
    ops[1].back().desc = &theirs;
    ops[0].push_back(op(1, false, b.data(), b.size(), Channel::kCollective));
    ops[0].back().desc = &mine;
    const auto errors = run_both(p, ops);
    CHECK_MSG(errors[0].find("collective mismatch") != std::string::npos &&
                  errors[0].find("all_gather #4") != std::string::npos,
              errors[0]);
  }
}

BRAID_TEST(silent_peer_times_out_naming_it) {
  auto t0 = std::make_unique<TcpTransport>(0, 2, "127.0.0.1", config(1, 7, 0.3));
  auto t1 = std::make_unique<TcpTransport>(1, 2, "127.0.0.1", config(1, 7, 0.3));
  const std::vector<std::string> eps = {t0->address(), t1->address()};
  std::thread acceptor([&] { t0->connect(eps, {false, true}, {"rank 0", "rank 1 (on host-b)"}); });
  t1->connect(eps, {true, false}, {"rank 0", "rank 1"});
  acceptor.join();
  std::vector<char> buf(10);
  P2POp r = op(1, false, buf.data(), buf.size());
  P2POp* ops[] = {&r};
  const std::string msg = CHECK_THROWS_KIND(ErrorKind::kTimeout, t0->run(ops, 1));
  CHECK_MSG(msg.find("nothing heard from rank 1 (on host-b)") != std::string::npos, msg);
}

namespace {

// Plays rank 1 by hand: the handshake of every socket to rank 0's listener, proving `key`.
struct FakePeer {
  std::vector<int> fds;
  ~FakePeer() {
    for (int fd : fds) ::close(fd);
  }
  // Returns whether rank 0 accepted every socket.
  // `proof_key` (default: `key`) is what the proofs are computed with: a peer that knows the
  // communicator id (it crosses the wire in the clear) but not the secret.
  bool connect(const std::string& endpoint, const std::vector<uint8_t>& key, int sockets,
               const std::vector<uint8_t>* proof_key = nullptr) {
    const std::vector<uint8_t>& pk = proof_key ? *proof_key : key;
    const braid::SockAddr to = braid::parse_endpoint(endpoint);
    static const char kLabel[] = "braid-communicator-id";
    const auto id_mac = braid::hmac_sha256(key.data(), key.size(), kLabel, sizeof(kLabel) - 1);
    uint64_t comm_id;
    std::memcpy(&comm_id, id_mac.data(), sizeof(comm_id));
    const auto deadline = braid::Clock::now() + std::chrono::seconds(5);
    bool all = true;
    for (int c = 0; c < braid::kNumChannels; ++c)
      for (int i = 0; i < sockets; ++i) {
        braid::Fd fd = braid::connect_to(to, deadline, "rank 0");
        braid::Hello h{};
        h.magic = braid::kHelloMagic;
        h.version = braid::kWireVersion;
        h.comm_id = comm_id;
        h.from = 1;
        h.to = 0;
        h.channel = c;
        h.index = i;
        braid::Challenge ch{};
        std::string why;
        bool ok = braid::write_exact(fd.get(), &h, sizeof(h), deadline, &why) &&
                  braid::read_exact(fd.get(), &ch, sizeof(ch), deadline, &why);
        if (ok) {
          std::vector<uint8_t> msg = {'b', 'r', 'a', 'i', 'd', '-', 'c', 'o', 'n', 'n', 'e', 'c', 't'};
          const auto* hb = reinterpret_cast<const uint8_t*>(&h);
          msg.insert(msg.end(), hb, hb + sizeof(h));
          msg.insert(msg.end(), ch.nonce, ch.nonce + braid::kNonceBytes);
          const auto mac = braid::hmac_sha256(pk.data(), pk.size(), msg.data(), msg.size());
          uint8_t verdict = 0;
          ok = braid::write_exact(fd.get(), mac.data(), mac.size(), deadline, &why) &&
               braid::read_exact(fd.get(), &verdict, 1, deadline, &why) && verdict == braid::kAccepted;
        }
        all = all && ok;
        fds.push_back(fd.release());
      }
    return all;
  }
};

// Rank 0 accepting on its own thread while `peer` runs; returns rank 0's connect() error.
std::string accept_while(TcpTransport& t0, const std::function<void(const std::string&)>& peer) {
  std::string error;
  const std::vector<std::string> eps = {t0.address(), "127.0.0.1:1"};
  std::thread acceptor([&] {
    try {
      t0.connect(eps, {false, true}, {"rank 0", "rank 1"});
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  peer(t0.address());
  acceptor.join();
  return error;
}

// Rank 1 sends `bytes` to rank 0 (each on its own thread): they arrive intact.
void check_data_flows(TcpTransport& t0, TcpTransport& t1, size_t bytes) {
  std::vector<char> a = pattern(bytes, 1), b(bytes);
  P2POp s = op(0, true, a.data(), a.size()), r = op(1, false, b.data(), b.size());
  std::thread sender([&] {
    P2POp* ops[] = {&s};
    t1.run(ops, 1);
  });
  P2POp* ops[] = {&r};
  t0.run(ops, 1);
  sender.join();
  CHECK(a == b);
}

}  // namespace

// A stranger who sends garbage and one who proves a different secret are refused (rank 0 closes
// on them) while connecting goes on; the real rank 1 then connects and data flows.
BRAID_TEST(strangers_and_wrong_secrets_are_refused_and_the_job_goes_on) {
  TcpTransport t0(0, 2, "127.0.0.1", config(1));
  TcpTransport t1(1, 2, "127.0.0.1", config(1));
  std::string error = accept_while(t0, [&](const std::string& ep) {
    const braid::SockAddr to = braid::parse_endpoint(ep);
    {
      braid::Fd fd = braid::connect_to(to, braid::Clock::now() + std::chrono::seconds(5), "rank 0");
      const std::vector<char> junk = pattern(200, 9);
      (void)!::write(fd.get(), junk.data(), junk.size());
      char c;
      CHECK(::read(fd.get(), &c, 1) <= 0);  // refused: closed (or reset) without a byte
    }
    FakePeer other_job, no_secret;
    CHECK(!other_job.connect(ep, secret(99), 1));
    const auto wrong = secret(99);
    CHECK(!no_secret.connect(ep, secret(7), 1, &wrong));
    // The wrong secret's connections were closed; the real rank 1 connects.
    t1.connect({ep, t1.address()}, {true, false}, {"rank 0", "rank 1"});
  });
  CHECK_MSG(error.empty(), error);
  check_data_flows(t0, t1, 10000);
}

// Frames from an authenticated peer that are wrong in every way the receiver can see: each must
// end in a CommError (no crash, no hang past the deadline), and nothing around the receive
// buffer may be written.
BRAID_TEST(fuzzed_frames_fail_cleanly) {
  std::mt19937_64 rng(1234);
  const size_t want = 3 * kChunk + 10;
  int cases = 0;
  for (int trial = 0; trial < 60; ++trial) {
    TcpTransport t0(0, 2, "127.0.0.1", config(1, 7, 2));
    FakePeer fake;
    const std::string error = accept_while(t0, [&](const std::string& ep) { CHECK(fake.connect(ep, secret(7), 1)); });
    CHECK_MSG(error.empty(), error);
    // What rank 1 sends on its user-channel socket (the first one it connected).
    std::vector<char> wire;
    braid::FrameHeader h{};
    static const char kLabel[] = "braid-communicator-id";
    const auto key = secret(7);
    const auto id_mac = braid::hmac_sha256(key.data(), key.size(), kLabel, sizeof(kLabel) - 1);
    std::memcpy(&h.comm_id, id_mac.data(), sizeof(h.comm_id));
    h.magic = braid::kFrameMagic;
    h.version = braid::kWireVersion;
    h.kind = static_cast<uint8_t>(braid::FrameKind::kData);
    h.dtype = static_cast<uint8_t>(braid::DType::kUInt8);
    h.total = want;
    h.length = kChunk;
    switch (trial % 6) {
      case 0:  // random bytes
        wire = pattern(static_cast<size_t>(rng() % 400 + 1), static_cast<int>(rng() % 1000));
        break;
      case 1:  // huge lengths
        h.length = static_cast<uint32_t>(rng());
        h.total = rng();
        break;
      case 2:  // a truncated header, then EOF
        break;
      case 3:  // a chunk out of sequence
        h.offset = (rng() % 5 + 1) * kChunk;
        break;
      case 4:  // an abort frame with a bogus error kind
        h.kind = static_cast<uint8_t>(braid::FrameKind::kAbort);
        h.error = static_cast<uint32_t>(rng() % 1000 + 6);
        break;
      case 5:  // one random header field changed
        reinterpret_cast<uint8_t*>(&h)[rng() % 40] ^= static_cast<uint8_t>(rng() % 255 + 1);
        break;
    }
    if (wire.empty()) {
      const auto* hb = reinterpret_cast<const char*>(&h);
      wire.assign(hb, hb + (trial % 6 == 2 ? sizeof(h) / 2 : sizeof(h)));
      if (trial % 6 != 2) {
        const std::vector<char> payload = pattern(static_cast<size_t>(rng() % 5000), trial);
        wire.insert(wire.end(), payload.begin(), payload.end());
      }
    }
    (void)!::write(fake.fds[0], wire.data(), wire.size());
    ::shutdown(fake.fds[0], SHUT_WR);
    std::vector<char> buf(want + 2 * 64, 'g');
    P2POp r = op(1, false, buf.data() + 64, want);
    P2POp* ops[] = {&r};
    bool failed = false;
    try {
      t0.run(ops, 1);
    } catch (const CommError&) {
      failed = true;
    }
    CHECK_MSG(failed, "trial " + std::to_string(trial) + " was accepted");
    for (size_t i = 0; i < 64; ++i) {
      CHECK(buf[i] == 'g');
      CHECK(buf[buf.size() - 1 - i] == 'g');
    }
    ++cases;
  }
  CHECK_EQ(cases, 60);
}

// Strangers holding connections to rank 0's listener while it connects (idle ones, one dribbling
// a hello a byte at a time, one sending garbage), more of them than the acceptor authenticates
// at once: the real rank 1 still connects within a second (each handshake is served on its own
// deadline, the oldest dropped when too many are pending), and data flows.
BRAID_TEST(strangers_cannot_stall_the_handshake) {
  TcpTransport t0(0, 2, "127.0.0.1", config(2, 7, 20));
  TcpTransport t1(1, 2, "127.0.0.1", config(2, 7, 20));
  std::vector<braid::Fd> strangers;
  std::atomic<bool> stop{false};
  std::thread dribbler;
  double seconds = 1e9;
  std::string error = accept_while(t0, [&](const std::string& ep) {
    const braid::SockAddr to = braid::parse_endpoint(ep);
    const auto deadline = braid::Clock::now() + std::chrono::seconds(5);
    for (int i = 0; i < 80; ++i) strangers.push_back(braid::connect_to(to, deadline, "rank 0"));
    braid::Fd garbage = braid::connect_to(to, deadline, "rank 0");
    const std::vector<char> junk = pattern(48, 3);
    (void)!::write(garbage.get(), junk.data(), junk.size());
    // Connected here, before rank 1 starts: connected in the thread, it could come after rank 0
    // stopped listening (rank 1 done), and the refused connect would end the test process.
    braid::Fd slow = braid::connect_to(to, deadline, "rank 0");
    dribbler = std::thread([&, slow = std::move(slow)] {
      for (int i = 0; i < 40 && !stop.load(); ++i) {
        (void)!::write(slow.get(), "\x42", 1);
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
    const auto start = braid::Clock::now();
    t1.connect({ep, t1.address()}, {true, false}, {"rank 0", "rank 1"});
    seconds = std::chrono::duration<double>(braid::Clock::now() - start).count();
  });
  stop.store(true);
  dribbler.join();
  CHECK_MSG(error.empty(), error);
  CHECK_MSG(seconds < 1.0, "rank 1 took " + std::to_string(seconds) + " s to connect");
  check_data_flows(t0, t1, 50000);
}

namespace {
TcpConfig lazy_config(int sockets, double timeout_s = 5) {
  TcpConfig c = config(sockets, 7, timeout_s);
  c.lazy = true;
  return c;
}
}  // namespace

// On demand: connect() opens nothing; the first message between the pair opens its sockets,
// whichever rank uses the pair first (here the lower rank, which waits for the higher rank's
// connection, and then the other way round on a fresh pair).
BRAID_TEST(lazy_connections_open_at_first_use) {
  for (int first : {0, 1}) {
    TcpTransport t0(0, 2, "127.0.0.1", lazy_config(2));
    TcpTransport t1(1, 2, "127.0.0.1", lazy_config(2));
    const std::vector<std::string> eps = {t0.address(), t1.address()};
    t0.connect(eps, {false, true}, {"rank 0", "rank 1"});
    t1.connect(eps, {true, false}, {"rank 0", "rank 1"});
    CHECK_EQ(t0.connected_peers(), 0);
    CHECK_EQ(t1.connected_peers(), 0);
    TcpTransport* ts[2] = {&t0, &t1};
    std::vector<char> a = pattern(30000, first), b(30000);
    P2POp s = op(1 - first, true, a.data(), a.size()), r = op(first, false, b.data(), b.size());
    std::thread receiver([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the sender uses the pair first
      P2POp* ops[] = {&r};
      ts[1 - first]->run(ops, 1);
    });
    P2POp* ops[] = {&s};
    ts[first]->run(ops, 1);
    receiver.join();
    CHECK(a == b);
    for (TcpTransport* t : ts) {
      CHECK_EQ(t->connected_peers(), 1);
      CHECK_EQ(t->open_sockets(), 2 * braid::kNumChannels);
    }
  }
}

// On demand, a peer that is gone (its listener closed after a failure) is an error at once, not
// a wait until the deadline.
BRAID_TEST(lazy_connection_to_a_gone_peer_fails_at_once) {
  auto t0 = std::make_unique<TcpTransport>(0, 2, "127.0.0.1", lazy_config(1, 30));
  TcpTransport t1(1, 2, "127.0.0.1", lazy_config(1, 30));
  const std::vector<std::string> eps = {t0->address(), t1.address()};
  t0->connect(eps, {false, true}, {"rank 0", "rank 1"});
  t1.connect(eps, {true, false}, {"rank 0 (on host-a)", "rank 1"});
  t0->publish_failure(ErrorKind::kMismatch, "rank 0 saw a mismatch");
  std::vector<char> a(100);
  P2POp s = op(0, true, a.data(), a.size());
  P2POp* ops[] = {&s};
  const auto start = braid::Clock::now();
  const std::string msg = CHECK_THROWS_KIND(ErrorKind::kMismatch, t1.run(ops, 1));
  CHECK_MSG(msg.find("rank 0 saw a mismatch [reported by rank 0 (on host-a)]") != std::string::npos, msg);
  CHECK(braid::Clock::now() - start < std::chrono::seconds(2));
  // Closed (the process gone): a connection is refused, a PeerError naming the rank.
  t0.reset();
  const std::string gone = CHECK_THROWS_KIND(ErrorKind::kPeer, [&] {
    TcpTransport probe(1, 2, "127.0.0.1", lazy_config(1, 30));
    probe.connect(eps, {true, false}, {"rank 0 (on host-a)", "rank 1"});
    P2POp s2 = op(0, true, a.data(), a.size());
    P2POp* ops2[] = {&s2};
    probe.run(ops2, 1);
  }());
  CHECK_MSG(gone.find("rank 0 (on host-a)") != std::string::npos, gone);
}

// A failing rank tells a peer it holds no connection to (on demand) at once: a notice on a
// connection of its own; the peer's wait for it fails with the same error.
BRAID_TEST(failure_reaches_a_peer_never_connected) {
  TcpTransport t0(0, 2, "127.0.0.1", lazy_config(1, 30));
  TcpTransport t1(1, 2, "127.0.0.1", lazy_config(1, 30));
  const std::vector<std::string> eps = {t0.address(), t1.address()};
  t0.connect(eps, {false, true}, {"rank 0", "rank 1 (on host-b)"});
  t1.connect(eps, {true, false}, {"rank 0", "rank 1"});
  std::vector<char> buf(100);
  std::string msg;
  const auto start = braid::Clock::now();
  std::thread waiter([&] {
    // Rank 0 waits for data from rank 1 (the higher rank: rank 0 asks it to connect, and it
    // does, from its acceptor).
    P2POp r = op(1, false, buf.data(), buf.size());
    P2POp* ops[] = {&r};
    try {
      t0.run(ops, 1);
    } catch (const CommError& e) {
      msg = std::to_string(static_cast<int>(e.kind())) + ": " + e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  t1.publish_failure(ErrorKind::kMismatch, "rank 1 saw a mismatch");
  waiter.join();
  CHECK_MSG(msg.find(std::to_string(static_cast<int>(ErrorKind::kMismatch)) + ": rank 1 saw a mismatch [reported by rank 1 (on host-b)]") == 0, msg);
  CHECK(braid::Clock::now() - start < std::chrono::seconds(3));
}
