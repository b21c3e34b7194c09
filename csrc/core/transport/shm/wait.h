// How a rank of the shared-memory group waits for its peers (ShmGroup's wait templates, inlined
// into each wait so that the spin loop calls no function): spin, then yield, then sleep on the
// rank's own futex doorbell with the deadline, checking aborts, peer liveness and signals on the way.
// Private to the group's files (wait.cc, mailbox.cc).
#pragma once

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <linux/futex.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string>

#include "../../cpu_relax.h"
#include "../../errors.h"
#include "../../interrupt.h"
#include "group.h"
#include "segment_header.h"


namespace braid {

inline constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);
// A wait asks interrupt_requested() (core/interrupt.h) once it has lasted this long, then at
// every liveness check.
inline constexpr auto kInterruptAfter = std::chrono::milliseconds(100);

template <class Awaited>
bool ShmGroup::missing_peer_shares_cpu(const int* peers, int npeers, const Awaited& awaited) const {
  const int cpu = ::sched_getcpu();
  for (int i = 0; i < npeers; ++i)
    if (awaited(peers[i]) && headers_[peers[i]]->cpu.load(std::memory_order_relaxed) == cpu) return true;
  return false;
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
  using Clock = std::chrono::steady_clock;
  // A failure raises only in a wait that must go on. What this wait needs may be there although a
  // peer failed since: it posted its part, finished this collective and then failed in a later
  // call. Its failure was published after its posts, so a rank that sees the failure sees them
  // too, and this call completes; the failure poisons the next one.
  const auto stop = [&] {
    if (reached()) return true;
    if (!abort_pending()) return false;
    if (reached()) return true;  // read after the failure was seen: the posts made before it show
    check_abort();
    return false;
  };
  if (stop()) return;
  const auto start = Clock::now();
  // Phase 1: spin. Cheap when peers are running on other cores and about to post.
  for (uint32_t i = 0; policy_.spin.count() > 0; ++i) {
    for (int k = 0; k < 16; ++k) {
      BRAID_CPU_RELAX();
      if (reached()) return;
    }
    if ((i & 15) == 0) {
      if (stop()) return;
      if (Clock::now() - start >= policy_.spin || missing_peer_shares_cpu(peers, npeers, awaited)) break;
    }
  }
  // Phase 2: yield the core; with more ranks than cores the peer we wait for may need it.
  while (Clock::now() - start < policy_.spin + policy_.yield) {
    ::sched_yield();
    if (stop()) return;
  }
  // Phase 3: sleep on this rank's doorbell, bounded by the deadline; check peer liveness
  // regularly. The bits of `peers` in `waits_for` ask them to ring it when they post.
  const auto deadline = start + policy_.timeout;
  auto last_liveness = Clock::time_point{};
  SegmentHeader* me = header(rank_);
  uint64_t mask = 0;
  for (int i = 0; i < npeers; ++i) mask |= uint64_t{1} << peers[i];
  me->sleepers.fetch_add(1, std::memory_order_seq_cst);
  me->waits_for.fetch_or(mask, std::memory_order_seq_cst);
  hub_->asleep.fetch_add(1, std::memory_order_seq_cst);
  struct SleeperGuard {
    SegmentHeader* hub;
    SegmentHeader* me;
    ~SleeperGuard() {
      hub->asleep.fetch_sub(1, std::memory_order_seq_cst);
      // The last sleeper of this rank clears the bits (a second one, which no engine runs, could
      // lose its bits here: its wait would then rely on the liveness slices, never hang).
      if (me->sleepers.fetch_sub(1, std::memory_order_seq_cst) == 1) me->waits_for.store(0, std::memory_order_seq_cst);
    }
  } guard{hub_, me};
  for (;;) {
    const uint32_t bell = me->bell.load(std::memory_order_seq_cst);
    if (stop()) return;
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
      throw CommError(ErrorKind::kTimeout, rank_name(rank_) + " timed out: no progress within the timeout of " +
                                               number_text(secs) + " s" + what_doing(" in ", doing) + " waiting for " +
                                               missing_ranks(peers, npeers, awaited) + ", which did not arrive");
    }
    const auto slice = std::min<Clock::duration>(deadline - now, kLivenessPeriod);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
    struct timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&me->bell), FUTEX_WAIT, bell, &ts, nullptr, 0);
  }
}

}  // namespace braid
