// Point-to-point through the shared-memory group's mailboxes (mailbox.h): a chunk at a time, in
// issue order per (sender, receiver, channel), the receiver checking each chunk's header against
// the message it expects.
#include <algorithm>
#include <cstring>
#include <string>

#include "../../copy.h"
#include "mailbox.h"
#include "segment_header.h"
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
  if (op.send) {
    const uint64_t taken = header(op.peer)->mailbox_taken[me].load(std::memory_order_acquire);
    return op.offer != 0 ? taken >= op.offer : taken + kMailboxDepth > sent_[lane(op)];
  }
  return header(op.peer)->mailbox_sent[me].load(std::memory_order_acquire) > taken_[lane(op)];
}

// Whether `op`, a send not yet begun, offers its data in place (Tunables::p2p_window_min_bytes):
// a user transfer from a registered buffer that waits for its receiver anyway. The window's id and
// the data's offset in it go to `id` and `off`.
bool ShmGroup::offers_in_place(const P2POp& op, int64_t* id, uint64_t* off) {
  if (op.off != 0 || op.declined || op.channel != Channel::kUser || op.bytes < p2p_window_min_bytes_) return false;
  if (!op.exchange && op.bytes <= kMailboxEagerBytes) return false;  // an eager send returns at once
  *id = window_of(op.data, op.bytes, off);
  return *id >= 0;
}

// The receiver's side of an offer: reads the sender's data where it lies when this rank maps the
// sender's window (it holds a tensor of that id), else declines (the sender then sends chunks).
bool ShmGroup::take_in_place(P2POp& op, int peer, const MailboxChunk& c) {
  std::shared_ptr<const ShmWindow> w;
  {
    std::lock_guard<std::mutex> lock(windows_mu_);
    auto it = windows_.find(c.window_id);
    if (it != windows_.end() && !it->second->bases.empty()) w = it->second;
  }
  if (!w) return false;
  if (c.window_off > w->bytes || op.bytes > w->bytes - c.window_off)
    throw CommError(ErrorKind::kMismatch, "point-to-point: " + rank_name(peer) + " offered " +
                                              std::to_string(op.bytes) + " bytes at offset " +
                                              std::to_string(c.window_off) + " of a registered buffer of " +
                                              std::to_string(w->bytes));
  // The sender's send is not complete until this rank marks the offer taken, so the data stays.
  copy_output(op.data, w->bases[static_cast<size_t>(peer)] + c.window_off, op.bytes, streaming(op.bytes));
  return true;
}

bool ShmGroup::advance(P2POp& op) {
  while (!op.done && p2p_ready(op)) {
    const int peer = op.peer;
    const size_t l = lane(op);
    if (op.send && op.offer != 0) {  // the receiver has answered the offer
      const uint64_t declined = header(peer)->mailbox_declined[header_lane(op.channel, rank_)].load(
          std::memory_order_acquire);
      if (declined == op.offer) {
        op.declined = true;  // read in place by no one: the data goes through chunks after all
      } else {
        op.off = op.bytes;
        op.in_place = true;
      }
      op.offer = 0;
      op.done = op.off >= op.bytes;
      continue;
    }
    if (op.send) {
      if (!mailbox_reserved_[l]) {
        own_.reserve(layout_.mailbox_offset(static_cast<int>(l), 0), kMailboxDepth * kMailboxSlot);
        mailbox_reserved_[l] = true;
      }
      // Chunk k reuses the mailbox slot of chunk k - depth, which the receiver has taken (ready).
      const uint64_t k = sent_[l];
      char* slot = bases_[rank_] + layout_.mailbox_offset(static_cast<int>(l), k);
      int64_t window = -1;
      uint64_t window_off = 0;
      const bool in_place = offers_in_place(op, &window, &window_off);
      const size_t n = in_place ? 0 : std::min(op.bytes - op.off, kMailboxChunkBytes);
      auto* c = reinterpret_cast<MailboxChunk*>(slot);
      c->total_bytes = op.bytes;
      c->offset = op.off;
      c->bytes = n;
      c->dtype = static_cast<uint32_t>(op.dtype);
      c->window_id = window;
      c->window_off = window_off;
      if (n > 0) std::memcpy(slot + kChunkHeader, op.data + op.off, n);
      sent_[l] = k + 1;
      publish(header(rank_)->mailbox_sent[header_lane(op.channel, peer)], k + 1, peer);  // the chunk is visible first
      op.off += n;
      if (in_place) {
        op.offer = k + 1;  // done when the receiver has taken it (and not declined it)
        return false;
      }
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
      if (c->window_id >= 0) {  // an offer: the whole message, read where the sender holds it
        if (take_in_place(op, peer, *c)) {
          op.off = op.bytes;
          op.in_place = true;
        } else {
          header(rank_)->mailbox_declined[header_lane(op.channel, peer)].store(k + 1, std::memory_order_release);
        }
      } else {
        // A message larger than the cache is written around it, as the collectives' outputs are.
        copy_output(op.data + op.off, slot + kChunkHeader, c->bytes, streaming(op.bytes));
        op.off += c->bytes;
      }
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
