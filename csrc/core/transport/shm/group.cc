// Shared-memory rank group: the layout of each rank's segment (header, one-shot buffers, pipeline
// slots, mailboxes), joining the host's segments, and the collectives' arrival, where every rank
// checks that its peers announced the same collective. Waiting is in wait.cc, point-to-point in
// mailbox.cc.
#include "group.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>
#include <new>

#include "segment_header.h"

namespace braid {

namespace {
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

size_t ShmLayout::oneshot_offset() const { return round_up(sizeof(SegmentHeader), 4096); }
size_t ShmLayout::slots_offset() const { return oneshot_offset() + 2 * round_up(oneshot_bytes, 4096); }
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
  h->magic = kSegmentMagic;
  h->total_bytes = layout_.total_bytes();
  h->oneshot_bytes = layout_.oneshot_bytes;
  h->slot_bytes = layout_.slot_bytes;
  h->nslots = static_cast<uint32_t>(layout_.nslots);
  h->rank = rank;
  h->world_size = world_size;
  h->pid = static_cast<int32_t>(::getpid());
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (::sched_getaffinity(0, sizeof(cpus), &cpus) != 0)
    for (int c = 0, n = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)); c < n && c < CPU_SETSIZE; ++c)
      CPU_SET(c, &cpus);
  for (size_t c = 0; c < kCpuMaskWords * 64 && c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &cpus)) h->cpus[c / 64] |= uint64_t{1} << (c % 64);
  headers_.assign(world_, nullptr);
  bases_.assign(world_, nullptr);
  pidfds_.assign(world_, -1);
  h->window_id[0] = h->window_id[1] = -1;
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
    if (h->magic != kSegmentMagic || h->rank != r || h->world_size != world_ ||
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

int ShmGroup::host_cores() const {
  int n = 0;
  for (size_t w = 0; w < kCpuMaskWords; ++w) {
    uint64_t any = 0;
    for (const SegmentHeader* h : headers_)
      if (h != nullptr) any |= h->cpus[w];
    n += __builtin_popcountll(any);
  }
  return n;
}

uint64_t ShmGroup::arrive(const CollectiveDesc& d) {
  if (prearrived_ && prearrived_seq_ == d.seq) {  // arrive_windowed arrived already
    prearrived_ = false;
    return prearrived_step_;
  }
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

char* ShmGroup::oneshot(int rank, uint64_t seq) const {
  return bases_[rank] + layout_.oneshot_offset() + (seq & 1) * round_up(layout_.oneshot_bytes, 4096);
}

char* ShmGroup::slot(int rank, int k) const {
  return bases_[rank] + layout_.slots_offset() + static_cast<size_t>(k) * round_up(layout_.slot_bytes, 4096);
}

}  // namespace braid
