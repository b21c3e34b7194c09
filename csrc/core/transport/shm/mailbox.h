// The shared-memory group's point-to-point mailboxes: sizes and the format of a chunk. Each
// sender owns, in its segment, a FIFO of kMailboxDepth chunks of kMailboxChunkBytes per
// destination and channel. Sends are eager up to that much data in flight (pages are touched
// only when used), then wait for the receiver to take chunks (ShmGroup::advance, mailbox.cc).
#pragma once

#include <cstddef>
#include <cstdint>

namespace braid {

constexpr int kMailboxDepth = 4;
constexpr size_t kMailboxChunkBytes = size_t{1} << 20;

// What precedes the data of a mailbox chunk: the receiver checks the message against its own.
struct MailboxChunk {
  uint64_t total_bytes;  // of the whole message
  uint64_t offset;       // of this chunk in it
  uint64_t bytes;        // in this chunk
  uint32_t dtype;
  // An offer instead of data (>= 0): the whole message lies in the sender's registered buffer
  // of this id, at `window_off`, and stays there until the receiver has read it (bytes 0).
  int64_t window_id;
  uint64_t window_off;
};
constexpr size_t kChunkHeader = 64;
static_assert(sizeof(MailboxChunk) <= kChunkHeader, "a chunk's header fits before its data");
// One chunk's place in the segment: header and data, in whole pages.
constexpr size_t kMailboxSlot = (kChunkHeader + kMailboxChunkBytes + 4095) / 4096 * 4096;

// What a sender may have in flight before its send waits for the receiver (the eager capacity).
constexpr size_t kMailboxEagerBytes = kMailboxDepth * kMailboxChunkBytes;

}  // namespace braid
