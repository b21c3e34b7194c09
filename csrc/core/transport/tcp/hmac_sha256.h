// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) for the TCP transport's challenge-response handshake.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace braid {

using Digest = std::array<uint8_t, 32>;

// Incremental hash: update() any number of times, then finish() once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t len);
  // Pads and returns the digest; the object must not be updated afterwards.
  Digest finish();

 private:
  void compress(const uint8_t* block);

  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_len_ = 0;  // bytes; the padding encodes it in bits
};

Digest hmac_sha256(const void* key, size_t key_len, const void* msg, size_t msg_len);

// Compares all n bytes whatever the first difference, so that timing does not reveal how much of
// an expected MAC a guess got right.
bool digest_equal(const uint8_t* a, const uint8_t* b, size_t n);

// Cryptographically secure bytes from the kernel; throws CommError when none can be had.
void random_bytes(void* out, size_t n);

// Lower-case hex, for carrying nonces and MACs in text messages.
std::string to_hex(const uint8_t* p, size_t n);
// Accepts either case; false (out unspecified) on odd length or a non-hex character.
bool from_hex(const std::string& s, std::vector<uint8_t>& out);

}  // namespace braid
