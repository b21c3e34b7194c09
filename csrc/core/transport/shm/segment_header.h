// What the start of every rank's shared-memory segment holds, read and written by every rank of
// the host: the layout check, the progress counter and descriptors, the doorbell, the failure
// state and the mailboxes' progress. Private to the group's files (group.cc, wait.cc, mailbox.cc).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "../../collective.h"
#include "../transport.h"
#include "group.h"

namespace braid {

constexpr uint64_t kSegmentMagic = 0x6272616964736d35ull;  // "braidsm5"
// SegmentHeader::state
constexpr uint32_t kStateAlive = 0, kStateLeft = 1, kStateFailed = 2;
constexpr size_t kLine = 128;
constexpr size_t kCpuMaskWords = 16;  // CPUs 0..1023  // two cache lines: keeps the adjacent-line prefetcher from sharing

struct SegmentHeader {
  uint64_t magic;
  uint64_t total_bytes;
  uint64_t oneshot_bytes;
  uint64_t slot_bytes;
  uint32_t nslots;
  int32_t rank;
  int32_t world_size;
  int32_t pid;
  // The CPUs this rank may run on (its affinity mask when it made the segment; CPU i is bit i % 64
  // of word i / 64): the host's ranks are oversubscribed only when they outnumber the union.
  uint64_t cpus[kCpuMaskWords];
  // One cache line that a waiting peer reads as a whole: the progress counter, the CPU and the
  // descriptors. `cpu` is where this rank ran when it last posted: a waiter whose missing peer
  // last ran on the waiter's own CPU yields instead of spinning, which would only burn the time
  // slice the peer needs. `desc` is indexed by seq & 1: a peer cannot reach seq + 2 before this
  // rank has finished seq, because every collective waits for every rank at least once.
  alignas(kLine) std::atomic<uint64_t> step;
  std::atomic<int32_t> cpu;
  CollectiveDesc desc[2];
  // This rank's doorbell: a thread of this rank that waits sleeps on `bell`, with the bits of the
  // ranks it waits for set in `waits_for`; a rank that posts rings the bells whose `waits_for`
  // has its bit, and only those (a transfer between two ranks wakes no third one). `sleepers`:
  // this rank's threads asleep on it. `asleep`: only rank 0's copy (the "hub"), the threads of
  // the host asleep, so that a post that finds none rings nothing.
  alignas(kLine) std::atomic<uint32_t> bell;
  std::atomic<uint32_t> sleepers;
  std::atomic<uint32_t> asleep;
  std::atomic<uint64_t> waits_for;
  // Abort epoch: only the hub's copy is used.
  alignas(kLine) std::atomic<uint32_t> abort_epoch;
  alignas(kLine) std::atomic<uint32_t> state;
  uint32_t error_kind;
  uint64_t fail_seq;  // the collective this rank was in (or last ran) when it failed
  char error_msg[488];
  // The registered buffer (window, windows.cc) whose data this rank's peers may read in the
  // collective of sequence number s, at index s & 1 as `desc`: its id (-1: none) and the data's
  // offset in it. Written before the arrival's post, read by peers once every rank arrived.
  alignas(kLine) int64_t window_id[2];
  uint64_t window_off[2];
  // Point-to-point progress: chunks this rank posted to each destination, and took from each
  // source (mailbox.cc). Each side writes only its own arrays.
  // Indexed by lane: channel * kMaxLocalRanks + peer (see Channel).
  alignas(kLine) std::atomic<uint64_t> mailbox_sent[kNumChannels * kMaxLocalRanks];
  alignas(kLine) std::atomic<uint64_t> mailbox_taken[kNumChannels * kMaxLocalRanks];
  // The chunk number + 1 of the last offer (MailboxChunk::window_id) this rank declined from each
  // source (it does not map the sender's window): written before the offer is marked taken.
  alignas(kLine) std::atomic<uint64_t> mailbox_declined[kNumChannels * kMaxLocalRanks];
};

static_assert(sizeof(CollectiveDesc) == 24, "descriptor layout is shared between processes");
static_assert(offsetof(SegmentHeader, desc) + sizeof(CollectiveDesc[2]) - offsetof(SegmentHeader, step) <= 64,
              "step, cpu and descriptors must share one cache line");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared counters must be lock-free");

}  // namespace braid
