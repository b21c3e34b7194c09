// What crosses a TCP connection: the handshake messages and the header in front of every chunk.
// Fixed-size little-endian structs (the transport refuses big-endian builds); every field a
// receiver reads is checked against what it expects before any payload is accepted.
#pragma once

#include <cstdint>

#include "../../collective.h"

namespace braid {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the TCP framing is little-endian");

constexpr uint32_t kHelloMagic = 0x48445242;  // "BRDH"
constexpr uint32_t kFrameMagic = 0x46445242;  // "BRDF"
constexpr uint8_t kWireVersion = 1;
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;
// Longest failure message an abort frame carries.
constexpr uint32_t kMaxAbortText = 1024;

// Connector -> acceptor, first thing on a new connection.
struct Hello {
  uint32_t magic;
  uint8_t version;
  uint8_t pad[3];
  uint64_t comm_id;  // which communicator (a hash of the job's secret and the communicator's key)
  int32_t from;      // the connecting rank
  int32_t to;        // the rank it believes it reached
  int32_t channel;
  int32_t index;     // socket index within the channel
  uint8_t nonce[kNonceBytes];
};
static_assert(sizeof(Hello) == 48, "wire layout");

// Acceptor -> connector: its proof of the secret over the hello, and its own challenge.
struct Challenge {
  uint32_t magic;
  uint8_t version;
  uint8_t pad[3];
  uint8_t nonce[kNonceBytes];
  uint8_t mac[kMacBytes];  // HMAC(secret, "braid-accept" | hello | nonce)
};
static_assert(sizeof(Challenge) == 56, "wire layout");

// Connector -> acceptor: HMAC(secret, "braid-connect" | hello | challenge nonce). The acceptor
// then answers one byte (kAccepted) or closes.
struct Proof {
  uint8_t mac[kMacBytes];
};
constexpr uint8_t kAccepted = 0xA5;

enum class FrameKind : uint8_t { kData = 1, kAbort = 2 };

// In front of every chunk of a message. A message of `total` bytes on a lane is cut into chunks of
// the transport's chunk size; chunk j travels on socket (msg + j) % sockets, so each socket's
// receiver knows which chunk (offset, length) comes next and checks it.
struct FrameHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t kind;     // FrameKind
  uint8_t channel;  // Channel
  uint8_t dtype;    // DType of the message
  uint64_t comm_id;
  uint64_t msg;     // index of the message on its lane
  uint64_t total;   // bytes of the whole message
  uint64_t offset;  // of this chunk's payload within the message
  uint32_t length;  // payload bytes after this header (abort: the message text)
  uint32_t error;   // abort: the ErrorKind
  CollectiveDesc desc;  // the sender's collective (all zero for the user's point-to-point)
};
static_assert(sizeof(FrameHeader) == 72, "wire layout");

}  // namespace braid
