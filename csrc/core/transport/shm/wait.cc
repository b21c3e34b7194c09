// Waiting in the shared-memory group: the progress counters and each rank's futex doorbell, which
// a poster rings only for the ranks asleep waiting for it; waits for peers' steps (wait.h: spin,
// yield, futex sleep with a deadline, peer liveness); failures and aborts that end every waiter's
// wait at once.
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstring>

#include "wait.h"

namespace braid {

uint64_t ShmGroup::post_next() {
  ++step_;
  SegmentHeader* me = header(rank_);
  me->cpu.store(::sched_getcpu(), std::memory_order_relaxed);
  // seq_cst store + seq_cst load of `asleep`: either the sleeper sees the new step before it
  // sleeps, or this poster sees the sleeper and rings its bell (Dekker-style handshake).
  me->step.store(step_, std::memory_order_seq_cst);
  if (hub_->asleep.load(std::memory_order_seq_cst) != 0) wake_waiting_for_me();
  return step_;
}

void ShmGroup::publish(std::atomic<uint64_t>& counter, uint64_t value, int to) {
  header(rank_)->cpu.store(::sched_getcpu(), std::memory_order_relaxed);
  counter.store(value, std::memory_order_seq_cst);  // the same handshake as post_next
  if (hub_->asleep.load(std::memory_order_seq_cst) != 0) ring_if_waiting_for_me(headers_[to]);
}

void ShmGroup::ring(SegmentHeader* h) noexcept {
  h->bell.fetch_add(1, std::memory_order_seq_cst);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void ShmGroup::ring_if_waiting_for_me(SegmentHeader* h) noexcept {
  // A seq_cst load of `waits_for` after the post's seq_cst store: a waiter that set its bits
  // before this post is seen here, and one that sets them after sees the post before it sleeps.
  if (h != nullptr && (h->waits_for.load(std::memory_order_seq_cst) & (uint64_t{1} << rank_)) != 0) ring(h);
}

void ShmGroup::wake_waiting_for_me() noexcept {
  for (int r : all_peers_) ring_if_waiting_for_me(headers_[r]);
}

void ShmGroup::wake_all() noexcept {
  for (SegmentHeader* h : headers_)
    if (h != nullptr) ring(h);
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

bool ShmGroup::abort_pending() const {
  return hub_->abort_epoch.load(std::memory_order_acquire) != 0 || abort_requested_.load(std::memory_order_acquire);
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

std::string ShmGroup::peer_failure() const {
  if (hub_ == nullptr || hub_->abort_epoch.load(std::memory_order_acquire) == 0) return {};
  for (int r = 0; r < world_; ++r) {
    const SegmentHeader* h = headers_[r];
    if (r == rank_ || h->state.load(std::memory_order_acquire) != kStateFailed) continue;
    return std::string(h->error_msg, strnlen(h->error_msg, sizeof(h->error_msg))) + " [reported by " + rank_name(r) +
           "]";
  }
  return {};
}

CommError ShmGroup::peer_error() const {
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const SegmentHeader* h = headers_[r];
    if (h->state.load(std::memory_order_acquire) != kStateFailed) continue;
    auto kind = static_cast<ErrorKind>(h->error_kind);
    std::string msg(h->error_msg, strnlen(h->error_msg, sizeof(h->error_msg)));
    if (kind != ErrorKind::kTimeout && kind != ErrorKind::kMismatch && kind != ErrorKind::kPeer)
      kind = ErrorKind::kPeer;
    return CommError(kind, msg + " [reported by " + rank_name(r) + "]");
  }
  return CommError(ErrorKind::kPeer, "a peer aborted the communicator");
}

void ShmGroup::raise_abort() { throw peer_error(); }

std::string ShmGroup::what_doing(const char* word, const std::string* doing) const {
  if (doing) return word + *doing;
  return current_ ? word + current_->describe() : std::string();
}

std::string ShmGroup::rank_name(int r) const {
  return "rank " + std::to_string(global_.empty() ? r : global_[static_cast<size_t>(r)]);
}

std::string ShmGroup::rank_label(int r) const {
  std::string s = rank_name(r);
  if (r < static_cast<int>(info_.size()))
    s += " (pid " + std::to_string(info_[r].pid) + " on " + info_[r].host + ")";
  return s;
}

void ShmGroup::wait_slow(const int* peers, int npeers, uint64_t step) {
  wait_slow(peers, npeers, [this, step](int r) { return headers_[r]->step.load(std::memory_order_acquire) < step; },
            nullptr);
}

void ShmGroup::publish_failure(ErrorKind kind, const std::string& msg, bool after_collective) noexcept {
  SegmentHeader* me = header(rank_);
  if (me->state.load(std::memory_order_acquire) != kStateAlive || hub_ == nullptr) return;
  me->error_kind = static_cast<uint32_t>(kind);
  me->fail_seq = current_ != nullptr ? current_->seq + (after_collective ? 1 : 0) : 0;
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
