// Shared-memory rank group: counters in separate cache lines, a host-wide futex doorbell that
// posters ring only when someone sleeps, and waits that escalate from spinning to yielding to a
// futex sleep with a deadline, periodic peer liveness checks (pidfd) and abort propagation.
#include "group.h"

#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>

#include "../../copy.h"
#include "../../interrupt.h"
#include "../../tunables.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BRAID_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define BRAID_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define BRAID_CPU_RELAX() ((void)0)
#endif

namespace braid {

namespace {
constexpr uint64_t kMagic = 0x6272616964736d31ull;  // "braidsm1"
constexpr uint32_t kStateAlive = 0, kStateLeft = 1, kStateFailed = 2;
constexpr size_t kLine = 128;  // two cache lines: keeps the adjacent-line prefetcher from sharing
constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);
// A wait asks interrupt_requested() (core/interrupt.h) once it has lasted this long, then at
// every liveness check.
constexpr auto kInterruptAfter = std::chrono::milliseconds(100);

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

using Clock = std::chrono::steady_clock;
}  // namespace

struct SegmentHeader {
  uint64_t magic;
  uint64_t total_bytes;
  uint64_t oneshot_bytes;
  uint64_t slot_bytes;
  uint32_t nslots;
  int32_t rank;
  int32_t world_size;
  int32_t pid;
  // One cache line that a waiting peer reads as a whole: the progress counter, the CPU and the
  // descriptors. `cpu` is where this rank ran when it last posted: a waiter whose missing peer
  // last ran on the waiter's own CPU yields instead of spinning, which would only burn the time
  // slice the peer needs. `desc` is indexed by seq & 1: a peer cannot reach seq + 2 before this
  // rank has finished seq, because every collective waits for every rank at least once.
  alignas(kLine) std::atomic<uint64_t> step;
  std::atomic<int32_t> cpu;
  CollectiveDesc desc[2];
  // Doorbell and abort epoch: only rank 0's copy is used (the "hub").
  alignas(kLine) std::atomic<uint32_t> bell;
  std::atomic<uint32_t> sleepers;
  alignas(kLine) std::atomic<uint32_t> abort_epoch;
  alignas(kLine) std::atomic<uint32_t> state;
  uint32_t error_kind;
  uint64_t fail_seq;  // the collective this rank was in (or last ran) when it failed
  char error_msg[488];
  // Point-to-point progress: chunks this rank posted to each destination, and took from each
  // source (see ShmGroup::send). Each side writes only its own arrays.
  // Indexed by lane: channel * kMaxLocalRanks + peer (see Channel).
  alignas(kLine) std::atomic<uint64_t> mailbox_sent[kNumChannels * kMaxLocalRanks];
  alignas(kLine) std::atomic<uint64_t> mailbox_taken[kNumChannels * kMaxLocalRanks];
};

// What precedes the data of a mailbox chunk: the receiver checks the message against its own.
struct MailboxChunk {
  uint64_t total_bytes;  // of the whole message
  uint64_t offset;       // of this chunk in it
  uint64_t bytes;        // in this chunk
  uint32_t dtype;
};
constexpr size_t kChunkHeader = 64;
static_assert(sizeof(CollectiveDesc) == 24, "descriptor layout is shared between processes");
static_assert(offsetof(SegmentHeader, desc) + sizeof(CollectiveDesc[2]) - offsetof(SegmentHeader, step) <= 64,
              "step, cpu and descriptors must share one cache line");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared counters must be lock-free");

size_t ShmLayout::oneshot_offset() const { return round_up(sizeof(SegmentHeader), 4096); }
size_t ShmLayout::slots_offset() const { return oneshot_offset() + 2 * round_up(oneshot_bytes, 4096); }
namespace {
constexpr size_t kMailboxSlot = (kChunkHeader + kMailboxChunkBytes + 4095) / 4096 * 4096;
}

size_t ShmLayout::mailbox_offset(int lane, uint64_t chunk) const {
  const size_t first = slots_offset() + static_cast<size_t>(nslots) * round_up(slot_bytes, 4096);
  return first + (static_cast<size_t>(lane) * kMailboxDepth + chunk % kMailboxDepth) * kMailboxSlot;
}

size_t ShmLayout::total_bytes() const { return mailbox_offset(kNumChannels * world_size, 0); }

ShmGroup::ShmGroup(int rank, int world_size, const ShmLayout& layout, const WaitPolicy& policy,
                   size_t stream_min_bytes, bool skewed_rounds)
    : rank_(rank),
      world_(world_size),
      layout_(layout),
      policy_(policy),
      stream_min_bytes_(stream_min_bytes),
      skewed_rounds_(skewed_rounds) {
  // The collectives' part (header, one-shot buffers, slots) is backed now; each mailbox when this
  // rank first sends to its destination (most programs never use point-to-point).
  own_ = ShmSegment::create(layout_.total_bytes(), layout_.mailbox_offset(0, 0));
  mailbox_reserved_.assign(static_cast<size_t>(kNumChannels) * world_size, false);
  auto* h = new (own_.data()) SegmentHeader();
  h->magic = kMagic;
  h->total_bytes = layout_.total_bytes();
  h->oneshot_bytes = layout_.oneshot_bytes;
  h->slot_bytes = layout_.slot_bytes;
  h->nslots = static_cast<uint32_t>(layout_.nslots);
  h->rank = rank;
  h->world_size = world_size;
  h->pid = static_cast<int32_t>(::getpid());
  headers_.assign(world_, nullptr);
  bases_.assign(world_, nullptr);
  pidfds_.assign(world_, -1);
  headers_[rank_] = h;
  bases_[rank_] = static_cast<char*>(own_.data());
  for (int r = 0; r < world_; ++r)
    if (r != rank_) all_peers_.push_back(r);
  sent_.assign(static_cast<size_t>(kNumChannels) * world_, 0);
  taken_.assign(static_cast<size_t>(kNumChannels) * world_, 0);
}

ShmGroup::~ShmGroup() {
  for (int fd : pidfds_)
    if (fd >= 0) ::close(fd);
}

void ShmGroup::attach(const std::vector<PeerInfo>& peers) {
  info_ = peers;
  peers_.resize(world_);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    peers_[r] = ShmSegment::attach(peers[r].segment, layout_.total_bytes());
    auto* h = static_cast<SegmentHeader*>(peers_[r].data());
    if (h->magic != kMagic || h->rank != r || h->world_size != world_ ||
        h->total_bytes != layout_.total_bytes() || h->oneshot_bytes != layout_.oneshot_bytes ||
        h->slot_bytes != layout_.slot_bytes || h->nslots != static_cast<uint32_t>(layout_.nslots))
      throw CommError(ErrorKind::kGeneric,
                      rank_name(r) + "'s shared memory does not match this rank's "
                      "layout: all ranks must use the same braid version and the same BRAID_* tunables");
    headers_[r] = h;
    bases_[r] = static_cast<char*>(peers_[r].data());
#ifdef SYS_pidfd_open
    pidfds_[r] = static_cast<int>(::syscall(SYS_pidfd_open, peers[r].pid, 0));
#endif
  }
  hub_ = headers_[0];
}

uint64_t ShmGroup::post_next() {
  ++step_;
  SegmentHeader* me = header(rank_);
  me->cpu.store(::sched_getcpu(), std::memory_order_relaxed);
  // seq_cst store + seq_cst load of `sleepers`: either the sleeper sees the new step before it
  // sleeps, or this poster sees the sleeper and rings the bell (Dekker-style handshake).
  me->step.store(step_, std::memory_order_seq_cst);
  if (hub_->sleepers.load(std::memory_order_seq_cst) != 0) wake_all();
  return step_;
}

void ShmGroup::publish(std::atomic<uint64_t>& counter, uint64_t value) {
  header(rank_)->cpu.store(::sched_getcpu(), std::memory_order_relaxed);
  counter.store(value, std::memory_order_seq_cst);  // the same handshake as post_next
  if (hub_->sleepers.load(std::memory_order_seq_cst) != 0) wake_all();
}

void ShmGroup::wake_all() noexcept {
  hub_->bell.fetch_add(1, std::memory_order_seq_cst);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&hub_->bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

template <class Awaited>
bool ShmGroup::missing_peer_shares_cpu(const int* peers, int npeers, const Awaited& awaited) const {
  const int cpu = ::sched_getcpu();
  for (int i = 0; i < npeers; ++i)
    if (awaited(peers[i]) && headers_[peers[i]]->cpu.load(std::memory_order_relaxed) == cpu) return true;
  return false;
}

bool ShmGroup::reached(const int* peers, int npeers, uint64_t step) const {
  for (int i = 0; i < npeers; ++i)
    if (headers_[peers[i]]->step.load(std::memory_order_acquire) < step) return false;
  return true;
}

void ShmGroup::wait_all(uint64_t step) {
  if (reached(all_peers_.data(), static_cast<int>(all_peers_.size()), step)) return;
  wait_slow(all_peers_.data(), static_cast<int>(all_peers_.size()), step);
}

void ShmGroup::wait_peer(int peer, uint64_t step) {
  if (headers_[peer]->step.load(std::memory_order_acquire) >= step) return;
  wait_slow(&peer, 1, step);
}

void ShmGroup::check_abort() {
  if (hub_->abort_epoch.load(std::memory_order_acquire) != 0) raise_abort();
  if (abort_requested_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(abort_mu_);
    throw CommError(abort_kind_, abort_msg_);
  }
}

void ShmGroup::request_abort(const std::string& msg, ErrorKind kind) {
  {
    std::lock_guard<std::mutex> lk(abort_mu_);
    if (abort_requested_.load(std::memory_order_relaxed)) return;
    abort_msg_ = msg;
    abort_kind_ = kind;
    abort_requested_.store(true, std::memory_order_release);
  }
  wake_all();
}

void ShmGroup::check_abort_at(uint64_t seq) {
  if (hub_->abort_epoch.load(std::memory_order_acquire) == 0) return;
  bool any_failed = false;  // published before the epoch moved; none found: raise all the same
  for (int r = 0; r < world_; ++r) {
    if (r == rank_ || headers_[r]->state.load(std::memory_order_acquire) != kStateFailed) continue;
    if (headers_[r]->fail_seq <= seq) raise_abort();
    any_failed = true;
  }
  if (!any_failed) raise_abort();
}

void ShmGroup::raise_abort() {
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    SegmentHeader* h = headers_[r];
    if (h->state.load(std::memory_order_acquire) != kStateFailed) continue;
    auto kind = static_cast<ErrorKind>(h->error_kind);
    std::string msg(h->error_msg, strnlen(h->error_msg, sizeof(h->error_msg)));
    if (kind != ErrorKind::kTimeout && kind != ErrorKind::kMismatch && kind != ErrorKind::kPeer)
      kind = ErrorKind::kPeer;
    throw CommError(kind, msg + " [reported by " + rank_name(r) + "]");
  }
  throw CommError(ErrorKind::kPeer, "a peer aborted the communicator");
}

std::string ShmGroup::what_doing(const char* word, const std::string* doing) const {
  if (doing) return word + *doing;
  return current_ ? word + current_->describe() : std::string();
}

std::string ShmGroup::rank_name(int r) const {
  return "rank " + std::to_string(global_.empty() ? r : global_[static_cast<size_t>(r)]);
}

std::string ShmGroup::rank_label(int r) const {
  std::ostringstream s;
  s << rank_name(r);
  if (r < static_cast<int>(info_.size())) s << " (pid " << info_[r].pid << " on " << info_[r].host << ")";
  return s.str();
}

template <class Awaited>
std::string ShmGroup::missing_ranks(const int* peers, int npeers, const Awaited& awaited) const {
  std::string out;
  for (int i = 0; i < npeers; ++i) {
    if (!awaited(peers[i])) continue;
    if (!out.empty()) out += ", ";
    out += rank_label(peers[i]);
  }
  return out;
}

template <class Awaited>
void ShmGroup::check_peers_alive(const int* peers, int npeers, const Awaited& awaited, const std::string* doing) {
  // Formatted only for an error: waits are on the latency path of every small collective.
  for (int i = 0; i < npeers; ++i) {
    const int r = peers[i];
    SegmentHeader* h = headers_[r];
    if (!awaited(r)) continue;  // only those we still need
    if (h->state.load(std::memory_order_acquire) == kStateLeft)
      throw CommError(ErrorKind::kPeer, rank_label(r) + " closed its communicator" + what_doing(" during ", doing) +
                                            " while " + rank_name(rank_) + " waited for it");
    bool dead = false;
    if (pidfds_[r] >= 0) {
      struct pollfd p{pidfds_[r], POLLIN, 0};
      dead = ::poll(&p, 1, 0) > 0;
    } else if (r < static_cast<int>(info_.size()) && info_[r].pid > 0) {
      dead = ::kill(info_[r].pid, 0) != 0 && errno == ESRCH;
    }
    // A peer may post its last step and exit at once: look at the counter again before blaming it.
    if (dead && awaited(r))
      throw CommError(ErrorKind::kPeer, rank_label(r) + " exited" + what_doing(" during ", doing));
  }
}

void ShmGroup::wait_slow(const int* peers, int npeers, uint64_t step) {
  wait_slow(peers, npeers, [this, step](int r) { return headers_[r]->step.load(std::memory_order_acquire) < step; },
            nullptr);
}

template <class Awaited>
void ShmGroup::wait_slow(const int* peers, int npeers, const Awaited& awaited, const std::string* doing) {
  auto reached = [&] {
    for (int i = 0; i < npeers; ++i)
      if (awaited(peers[i])) return false;
    return true;
  };
  wait_until(peers, npeers, awaited, reached, doing);
}

template <class Awaited, class Reached>
void ShmGroup::wait_until(const int* peers, int npeers, const Awaited& awaited, const Reached& reached,
                          const std::string* doing) {
  check_abort();
  const auto start = Clock::now();
  // Phase 1: spin. Cheap when peers are running on other cores and about to post.
  for (uint32_t i = 0; policy_.spin.count() > 0; ++i) {
    for (int k = 0; k < 16; ++k) {
      BRAID_CPU_RELAX();
      if (reached()) return;
    }
    if ((i & 15) == 0) {
      check_abort();
      if (Clock::now() - start >= policy_.spin || missing_peer_shares_cpu(peers, npeers, awaited)) break;
    }
  }
  // Phase 2: yield the core; with more ranks than cores the peer we wait for may need it.
  while (Clock::now() - start < policy_.spin + policy_.yield) {
    ::sched_yield();
    if (reached()) return;
    check_abort();
  }
  // Phase 3: sleep on the host doorbell, bounded by the deadline; check peer liveness regularly.
  const auto deadline = start + policy_.timeout;
  auto last_liveness = Clock::time_point{};
  hub_->sleepers.fetch_add(1, std::memory_order_seq_cst);
  struct SleeperGuard {
    SegmentHeader* hub;
    ~SleeperGuard() { hub->sleepers.fetch_sub(1, std::memory_order_seq_cst); }
  } guard{hub_};
  for (;;) {
    const uint32_t bell = hub_->bell.load(std::memory_order_seq_cst);
    if (reached()) return;
    check_abort();
    const auto now = Clock::now();
    if (now - last_liveness >= kLivenessPeriod) {
      check_peers_alive(peers, npeers, awaited, doing);
      last_liveness = now;
      // Only waits that already took a while ask: the hook takes Python's GIL, which a busy
      // Python thread may hold for milliseconds, and a short wait must not pay for that.
      if (now - start >= kInterruptAfter && interrupt_requested())
        throw Interrupted(rank_name(rank_) + " was interrupted by a signal" +
                          what_doing(" during ", doing));
    }
    if (now >= deadline) {
      const double secs = std::chrono::duration<double>(policy_.timeout).count();
      std::ostringstream s;
      s << rank_name(rank_) << " timed out: no progress within the timeout of " << secs << " s"
        << what_doing(" in ", doing) << " waiting for "
        << missing_ranks(peers, npeers, awaited) << ", which did not arrive";
      throw CommError(ErrorKind::kTimeout, s.str());
    }
    const auto slice = std::min<Clock::duration>(deadline - now, kLivenessPeriod);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
    struct timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&hub_->bell), FUTEX_WAIT, bell, &ts, nullptr, 0);
  }
}

uint64_t ShmGroup::arrive(const CollectiveDesc& d) {
  SegmentHeader* me = header(rank_);
  me->desc[d.seq & 1] = d;
  current_ = &me->desc[d.seq & 1];
  const uint64_t s = post_next();
  wait_all(s);
  // A peer that failed (e.g. timed out) in this collective before this rank arrived must not be
  // answered with success here while it reported an error. A failure from a later collective
  // does not concern this one: the peer that failed there had finished this one (it could not
  // start the next otherwise), and this rank learns of it at its next collective.
  check_abort_at(d.seq);
  for (int r : all_peers_) {
    const CollectiveDesc& theirs = header(r)->desc[d.seq & 1];
    if (!(theirs == d))
      throw CommError(ErrorKind::kMismatch, "collective mismatch: " + rank_name(rank_) +
                                                " called " + d.describe() + " but " +
                                                rank_name(r) + " called " + theirs.describe());
  }
  return s;
}

namespace {
// A lane is one (channel, peer) mailbox stream; the header arrays are sized for any world size.
size_t header_lane(Channel c, int peer) { return static_cast<size_t>(c) * kMaxLocalRanks + static_cast<size_t>(peer); }
}  // namespace

size_t ShmGroup::lane(const P2POp& op) const {
  return static_cast<size_t>(op.channel) * static_cast<size_t>(world_) + static_cast<size_t>(op.peer);
}

bool ShmGroup::p2p_ready(const P2POp& op) const {
  if (op.done) return true;
  const size_t me = header_lane(op.channel, rank_);
  if (op.send) return header(op.peer)->mailbox_taken[me].load(std::memory_order_acquire) + kMailboxDepth > sent_[lane(op)];
  return header(op.peer)->mailbox_sent[me].load(std::memory_order_acquire) > taken_[lane(op)];
}

bool ShmGroup::advance(P2POp& op) {
  while (!op.done && p2p_ready(op)) {
    const int peer = op.peer;
    const size_t l = lane(op);
    if (op.send) {
      if (!mailbox_reserved_[l]) {
        own_.reserve(layout_.mailbox_offset(static_cast<int>(l), 0), kMailboxDepth * kMailboxSlot);
        mailbox_reserved_[l] = true;
      }
      // Chunk k reuses the mailbox slot of chunk k - depth, which the receiver has taken (ready).
      const uint64_t k = sent_[l];
      char* slot = bases_[rank_] + layout_.mailbox_offset(static_cast<int>(l), k);
      const size_t n = std::min(op.bytes - op.off, kMailboxChunkBytes);
      auto* c = reinterpret_cast<MailboxChunk*>(slot);
      c->total_bytes = op.bytes;
      c->offset = op.off;
      c->bytes = n;
      c->dtype = static_cast<uint32_t>(op.dtype);
      if (n > 0) std::memcpy(slot + kChunkHeader, op.data + op.off, n);
      sent_[l] = k + 1;
      publish(header(rank_)->mailbox_sent[header_lane(op.channel, peer)], k + 1);  // release: the chunk is visible first
      op.off += n;
    } else {
      const uint64_t k = taken_[l];
      const size_t theirs = static_cast<size_t>(op.channel) * static_cast<size_t>(world_) + static_cast<size_t>(rank_);
      const char* slot = bases_[peer] + layout_.mailbox_offset(static_cast<int>(theirs), k);
      const auto* c = reinterpret_cast<const MailboxChunk*>(slot);
      if (c->total_bytes != op.bytes || c->dtype != static_cast<uint32_t>(op.dtype) || c->offset != op.off ||
          c->bytes > kMailboxChunkBytes || c->bytes > op.bytes - op.off)
        throw CommError(ErrorKind::kMismatch,
                        "point-to-point mismatch: " + rank_name(rank_) + " expected " +
                            std::to_string(op.bytes) + " bytes of " + dtype_name(op.dtype) + " from " +
                            rank_name(peer) + ", which sent " + std::to_string(c->total_bytes) + " bytes of " +
                            dtype_name(static_cast<DType>(c->dtype)));
      // A message larger than the cache is written around it, as the collectives' outputs are.
      copy_output(op.data + op.off, slot + kChunkHeader, c->bytes, streaming(op.bytes));
      op.off += c->bytes;
      taken_[l] = k + 1;
      publish(header(rank_)->mailbox_taken[header_lane(op.channel, peer)], k + 1);
    }
    op.done = op.off >= op.bytes;
  }
  return op.done;
}

void ShmGroup::wait_p2p(P2POp* const* ops, int nops, const std::function<bool()>& interrupted) {
  auto ready = [&] {
    for (int i = 0; i < nops; ++i)
      if (p2p_ready(*ops[i])) return true;
    return interrupted();
  };
  if (ready()) return;
  int peers[kMaxLocalRanks];
  int npeers = 0;
  for (int i = 0; i < nops; ++i)
    if (std::find(peers, peers + npeers, ops[i]->peer) == peers + npeers) peers[npeers++] = ops[i]->peer;
  auto awaited = [&](int r) {
    for (int i = 0; i < nops; ++i)
      if (ops[i]->peer == r && !p2p_ready(*ops[i])) return true;
    return false;
  };
  std::string doing = ops[0]->describe();
  for (int i = 1; i < nops; ++i) doing += (i + 1 == nops ? " and " : ", ") + ops[i]->describe();
  wait_until(peers, npeers, awaited, ready, &doing);
}

char* ShmGroup::oneshot(int rank, uint64_t seq) const {
  return bases_[rank] + layout_.oneshot_offset() + (seq & 1) * round_up(layout_.oneshot_bytes, 4096);
}

char* ShmGroup::slot(int rank, int k) const {
  return bases_[rank] + layout_.slots_offset() + static_cast<size_t>(k) * round_up(layout_.slot_bytes, 4096);
}

void ShmGroup::publish_failure(ErrorKind kind, const std::string& msg) noexcept {
  SegmentHeader* me = header(rank_);
  if (me->state.load(std::memory_order_acquire) != kStateAlive || hub_ == nullptr) return;
  me->error_kind = static_cast<uint32_t>(kind);
  me->fail_seq = current_ != nullptr ? current_->seq : 0;
  std::memset(me->error_msg, 0, sizeof(me->error_msg));
  std::memcpy(me->error_msg, msg.data(), std::min(msg.size(), sizeof(me->error_msg) - 1));
  me->state.store(kStateFailed, std::memory_order_release);
  hub_->abort_epoch.fetch_add(1, std::memory_order_seq_cst);
  wake_all();
}

void ShmGroup::mark_left() noexcept {
  SegmentHeader* me = header(rank_);
  if (me->state.load(std::memory_order_acquire) != kStateAlive || hub_ == nullptr) return;
  me->state.store(kStateLeft, std::memory_order_release);
  wake_all();
}

}  // namespace braid
