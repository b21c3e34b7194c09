// The ranks of one host joined through one shared-memory segment per rank: progress counters,
// collective descriptors, data slots (group.cc), the waiting machinery (wait.h, wait.cc: spin,
// yield, futex, deadline, peer liveness, abort propagation) and point-to-point mailboxes
// (mailbox.h, mailbox.cc).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../../collective.h"
#include "../../dtype.h"
#include "../../errors.h"
#include "../../tunables.h"
#include "../transport.h"
#include "mailbox.h"
#include "segment.h"

namespace braid {

constexpr int kMaxLocalRanks = 64;

struct PeerInfo {
  std::string segment;
  pid_t pid = 0;
  std::string host;
};

struct ShmLayout {
  size_t oneshot_bytes;  // capacity of each of the two one-shot buffers
  size_t slot_bytes;     // capacity of each pipeline slot
  int nslots;            // pipeline depth
  int world_size;        // one point-to-point mailbox per destination rank and channel
  size_t oneshot_offset() const;
  size_t slots_offset() const;
  size_t mailbox_offset(int lane, uint64_t chunk) const;  // lane: channel * world_size + dst
  size_t total_bytes() const;
};

struct WaitPolicy {
  std::chrono::nanoseconds spin{std::chrono::microseconds(20)};   // busy-poll before yielding
  std::chrono::nanoseconds yield{std::chrono::microseconds(50)};  // sched_yield before futex sleep
  std::chrono::nanoseconds timeout{std::chrono::seconds(300)};
};

struct SegmentHeader;

// A registered buffer's mappings on one rank: its own segment and every peer's. Shared by the
// group's registry and whatever holds the memory (a tensor), so that it stays mapped until both
// are gone, even past the group.
struct ShmWindow {
  ShmSegment own;
  std::vector<ShmSegment> peers;  // index = local rank; this rank's entry stays empty
  std::vector<char*> bases;       // every rank's segment as mapped here
  size_t bytes = 0;
};

class ShmGroup : public Transport {
 public:
  // `stream_min_bytes`: outputs at least this large are written with non-temporal stores.
  // `skewed_rounds`: pipelined all-reduces overlap the phases of consecutive rounds.
  ShmGroup(int rank, int world_size, const ShmLayout& layout, const WaitPolicy& policy,
           size_t stream_min_bytes, bool skewed_rounds);
  ~ShmGroup() override;
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  const std::string& segment_name() const { return own_.name(); }
  // Maps every peer's segment (peers[rank] describes this rank and is skipped) and opens pidfds.
  void attach(const std::vector<PeerInfo>& peers);
  // Removes this rank's segment name: call once every rank has attached.
  void unlink_own() { own_.unlink(); }

  int rank() const { return rank_; }
  // Ranks in messages: this group's ranks are the communicator's ranks on this host, numbered
  // 0..n-1 here; `global[i]` is the communicator rank of local rank i.
  void set_global_ranks(std::vector<int> global) { global_ = std::move(global); }
  int world_size() const { return world_; }
  const ShmLayout& layout() const { return layout_; }
  // How long a waiting rank busy-polls before it yields its core (BRAID_SPIN_US; 0 where the
  // host has more ranks than cores).
  std::chrono::nanoseconds spin_budget() const { return policy_.spin; }

  // Registered buffers ("windows", windows.cc): one shared-memory segment per rank of the host,
  // made together under one id, each rank mapping every peer's, so that a collective whose data
  // lies in the same window on every rank reads the peers' data where it is, without copying it
  // through the slots. The steps, every rank in the same order: window_create (this rank's
  // segment of `bytes`, backed at once; returns its name), window_attach (maps the peers'
  // segments, `names` indexed by local rank; returns the mappings), a barrier, then
  // window_unlink. window_free drops this rank's mappings of the id (its last tensor is gone).
  std::string window_create(int64_t id, size_t bytes);
  std::shared_ptr<const ShmWindow> window_attach(int64_t id, const std::vector<std::string>& names);
  void window_unlink(int64_t id);
  void window_free(int64_t id) noexcept;
  // Arrives at collective `d` (as arrive(); the algorithm's own arrive() right after returns the
  // same step without posting again), first publishing which window holds this rank's
  // [data, data + bytes), if one does. Returns true, with `peer_data[r]` the address of rank r's
  // data (this rank's included), when every rank's data lies in the same window; false
  // otherwise, the same answer on every rank.
  bool arrive_windowed(const CollectiveDesc& d, const void* data, size_t bytes, const char** peer_data);
  // The two halves of arrive_windowed, for algorithms that do more in between (the one-shot ones:
  // algorithms/oneshot_sources.h). publish_window records which window holds this rank's data for
  // `d` (none: -1) and returns whether one does; after the arrival at `d`, windows_at reads every
  // rank's record: kAll (the same window everywhere; `peer_data` filled as above), kNone or kSome.
  enum class Windows { kNone, kSome, kAll };
  bool publish_window(const CollectiveDesc& d, const void* data, size_t bytes);
  Windows windows_at(const CollectiveDesc& d, const char** peer_data);
  // Whether windows_at answered kAll since forget_windows(): the collective read registered
  // buffers in place (what the flight recorder names it).
  bool read_windows() const { return read_windows_; }
  void forget_windows() { read_windows_ = false; }

  // Progress counter: each call posts the next step; peers wait on step values.
  uint64_t step() const { return step_; }
  uint64_t post_next();
  void wait_all(uint64_t step);
  void wait_peer(int peer, uint64_t step);

  // Publishes `d` with the data already written (one-shot), posts the next step, waits for all
  // peers to do the same and checks that every peer announced the same collective.
  // Returns the step value of that arrival.
  uint64_t arrive(const CollectiveDesc& d);

  // Whether an output of `bytes` is written around the caches (see copy_streaming).
  bool streaming(size_t bytes) const { return bytes >= stream_min_bytes_; }
  // Sends from registered buffers of at least `bytes` may be read in place (mailbox.cc).
  void set_p2p_window_min_bytes(size_t bytes) { p2p_window_min_bytes_ = bytes; }
  bool skewed_rounds() const { return skewed_rounds_; }
  // The CPUs the host's ranks may run on together (the union of their affinity masks), once
  // attached; the wait policy's spin and the skew, set again from it before the first collective.
  int host_cores() const;
  void set_spin(std::chrono::nanoseconds spin) { policy_.spin = spin; }
  void set_skewed_rounds(bool on) { skewed_rounds_ = on; }

  // Point-to-point, in issue order per (sender, receiver, channel), a chunk at a time so that
  // several advance together (a receive must name the size and dtype of the matching send; a
  // difference raises a mismatch on the receiver): advance() moves
  // every chunk it can without waiting and returns whether `op` is finished; wait_p2p() waits
  // until one of `ops` can move a chunk or `interrupted()` is true (deadline, liveness and abort
  // as every wait). Only the first unfinished op of each (direction, peer) may be advanced.
  // On each (channel, peer) lane a mailbox of its own (Channel).
  bool advance(P2POp& op) override;
  void wait_p2p(P2POp* const* ops, int nops, const std::function<bool()>& interrupted);
  void wait(P2POp* const* ops, int nops, const std::function<bool()>& interrupted) override {
    wait_p2p(ops, nops, interrupted);
  }
  // Whether `op` can move a chunk now (for waits that also watch another transport).
  bool ready(const P2POp& op) const { return p2p_ready(op); }
  // Wakes this rank's waiting thread (e.g. a wait_p2p whose `interrupted` became true).
  void wake() noexcept override { ring(header(rank_)); }

  char* oneshot(int rank, uint64_t seq) const;
  char* slot(int rank, int k) const;

  // Publishes this rank's failure so that every peer's waits end at once with the same error.
  // `after_collective`: the failure came after the last collective this rank arrived at had
  // finished here (in point-to-point), so a peer still arriving at that collective completes it
  // and learns of the failure at its next one.
  void publish_failure(ErrorKind kind, const std::string& msg, bool after_collective = false) noexcept;
  // Announces a normal departure: peers still waiting on this rank fail with PeerError.
  void mark_left() noexcept;
  // A peer's published failure as "message [reported by rank r]", or empty; never raises (for a
  // watcher that is not waiting: the flight recorder's).
  std::string peer_failure() const;
  // The error the first rank of this host that failed published (a PeerError when none did).
  CommError peer_error() const;
  // From any thread: the thread running this rank's collectives fails its current or next wait
  // with CommError(`kind`, `msg`) (and, through the communicator, publishes it to the peers). Sticky.
  void request_abort(const std::string& msg, ErrorKind kind = ErrorKind::kGeneric);

 private:
  SegmentHeader* header(int rank) const { return headers_[rank]; }

  // Waiting (wait.cc; the templates in wait.h).
  bool reached(const int* peers, int npeers, uint64_t step) const;
  void wait_slow(const int* peers, int npeers, uint64_t step);
  // Waits until `awaited(r)` is false for every r in `peers` (spin, yield, futex with deadline,
  // liveness); `doing` names the operation in errors (the current collective when null).
  template <class Awaited>
  void wait_slow(const int* peers, int npeers, const Awaited& awaited, const std::string* doing);
  // wait_slow with its own end condition: returns once `reached()`; `awaited` names the peers
  // still missing in errors.
  template <class Awaited, class Reached>
  void wait_until(const int* peers, int npeers, const Awaited& awaited, const Reached& reached,
                  const std::string* doing);
  template <class Awaited>
  bool missing_peer_shares_cpu(const int* peers, int npeers, const Awaited& awaited) const;
  template <class Awaited>
  void check_peers_alive(const int* peers, int npeers, const Awaited& awaited, const std::string* doing);
  void check_abort();
  bool abort_pending() const;  // what check_abort would raise, without raising it
  // check_abort for the arrival at collective `seq`: ignores failures that peers published from
  // later collectives.
  void check_abort_at(uint64_t seq);
  [[noreturn]] void raise_abort();
  // Doorbells (wait.cc): every rank's of the host (failures, departures, aborts); those of the
  // ranks whose waiting thread waits for this rank (its posts); `h`'s rank's if it does; one
  // rank's.
  void wake_all() noexcept;
  void wake_waiting_for_me() noexcept;
  void ring_if_waiting_for_me(SegmentHeader* h) noexcept;
  static void ring(SegmentHeader* h) noexcept;
  // Stores `value` in a counter that only rank `to` waits on (a mailbox lane's), ringing its
  // doorbell if it sleeps waiting for this rank.
  void publish(std::atomic<uint64_t>& counter, uint64_t value, int to);

  // Names for error messages (wait.cc).
  std::string rank_label(int r) const;  // "rank 3 (pid 4121 on host-a)"
  std::string rank_name(int r) const;   // "rank 3"
  // `word` + what this rank is doing (`doing`, or the current collective) for error messages.
  std::string what_doing(const char* word, const std::string* doing) const;
  template <class Awaited>
  std::string missing_ranks(const int* peers, int npeers, const Awaited& awaited) const;

  // Mailboxes (mailbox.cc).
  bool p2p_ready(const P2POp& op) const;
  size_t lane(const P2POp& op) const;   // index of op's (channel, peer) in sent_/taken_
  // Data in place from a registered buffer: the sender's test, the receiver's read (false: this
  // rank does not map the sender's window, and declines).
  bool offers_in_place(const P2POp& op, int64_t* id, uint64_t* off);
  bool take_in_place(P2POp& op, int peer, const MailboxChunk& c);

  // The id of the window holding [data, data + bytes), or -1.
  int64_t window_of(const void* data, size_t bytes, uint64_t* offset);

  int rank_;
  int world_;
  ShmLayout layout_;
  WaitPolicy policy_;
  size_t stream_min_bytes_;
  size_t p2p_window_min_bytes_ = Tunables{}.p2p_window_min_bytes;
  bool skewed_rounds_;
  ShmSegment own_;
  std::vector<ShmSegment> peers_;   // index = rank; this rank's entry stays empty
  std::vector<SegmentHeader*> headers_;
  std::vector<char*> bases_;
  std::vector<PeerInfo> info_;
  std::vector<int> pidfds_;         // -1 where pidfd_open is unavailable
  std::vector<int> all_peers_;
  std::vector<int> global_;         // communicator rank of each local rank (empty: the same)
  uint64_t step_ = 0;
  // Per lane (channel * world + peer):
  std::vector<uint64_t> sent_;      // chunks posted to each destination (mirrors the header)
  std::vector<uint64_t> taken_;     // chunks taken from each source
  std::vector<bool> mailbox_reserved_;  // this rank's mailbox to each destination is backed
  const CollectiveDesc* current_ = nullptr;  // for error messages
  SegmentHeader* hub_ = nullptr;   // rank 0's header: host doorbell and abort epoch
  std::mutex windows_mu_;  // windows_ is changed from the caller's threads, read by the collectives'
  std::map<int64_t, std::shared_ptr<ShmWindow>> windows_;
  std::atomic<size_t> nwindows_{0};
  // arrive_windowed's arrival, which the algorithm's arrive() for the same sequence number takes.
  bool prearrived_ = false;
  bool read_windows_ = false;
  uint64_t prearrived_seq_ = 0, prearrived_step_ = 0;
  std::atomic<bool> abort_requested_{false};  // request_abort() was called
  std::mutex abort_mu_;
  std::string abort_msg_;
  ErrorKind abort_kind_ = ErrorKind::kGeneric;  // what the aborted wait raises (abort(): kClosed)
};

}  // namespace braid
