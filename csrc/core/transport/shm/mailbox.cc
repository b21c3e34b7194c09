// Point-to-point through the shared-memory group's mailboxes (mailbox.h): a chunk at a time, in
// issue order per (sender, receiver, channel), the receiver checking each chunk's header against
// the message it expects.
#include <algorithm>
#include <cstring>
#include <string>

#include "../../copy.h"
#include "mailbox.h"
#include "wait.h"

namespace braid {

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
      publish(header(rank_)->mailbox_sent[header_lane(op.channel, peer)], k + 1, peer);  // the chunk is visible first
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
      publish(header(rank_)->mailbox_taken[header_lane(op.channel, peer)], k + 1, peer);
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

}  // namespace braid
