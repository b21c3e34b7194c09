// SHA-256 and HMAC-SHA256 (core/transport/tcp/hmac_sha256) against the FIPS 180-4 and RFC 4231 vectors.
#include <algorithm>
#include <string>
#include <vector>

#include "check.h"
#include "core/transport/tcp/hmac_sha256.h"

using braid::Digest;
using braid::Sha256;

namespace {

std::string sha256_hex(const std::string& msg) {
  Sha256 h;
  h.update(msg.data(), msg.size());
  const Digest d = h.finish();
  return braid::to_hex(d.data(), d.size());
}

std::string hmac_hex(const std::string& key, const std::string& msg) {
  const Digest d = braid::hmac_sha256(key.data(), key.size(), msg.data(), msg.size());
  return braid::to_hex(d.data(), d.size());
}

}  // namespace

BRAID_TEST(sha256_short_messages) {
  CHECK_EQ(sha256_hex(""), std::string("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"));
  CHECK_EQ(sha256_hex("abc"), std::string("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"));
  // 56 bytes: the length no longer fits the first block, so padding takes a second one.
  CHECK_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
           std::string("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"));
}

BRAID_TEST(sha256_million_a_in_uneven_pieces) {
  const std::string expected = "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";
  const std::string a(1000000, 'a');
  CHECK_EQ(sha256_hex(a), expected);

  // Piece sizes around the 64-byte block hit every path: partial fill, exact block, straddling.
  const size_t pieces[] = {1, 63, 64, 65, 1000};
  Sha256 h;
  size_t fed = 0;
  for (size_t i = 0; fed < a.size(); ++i) {
    const size_t n = std::min(pieces[i % 5], a.size() - fed);
    h.update(a.data() + fed, n);
    fed += n;
  }
  const Digest d = h.finish();
  CHECK_EQ(braid::to_hex(d.data(), d.size()), expected);
}

BRAID_TEST(hmac_rfc4231) {
  // Test case 1.
  CHECK_EQ(hmac_hex(std::string(20, '\x0b'), "Hi There"),
           std::string("b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"));
  // Test case 2: a key shorter than the output.
  CHECK_EQ(hmac_hex("Jefe", "what do ya want for nothing?"),
           std::string("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"));
  // Test case 3.
  CHECK_EQ(hmac_hex(std::string(20, '\xaa'), std::string(50, '\xdd')),
           std::string("773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"));
  // Test case 4.
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4.push_back(static_cast<char>(i));
  CHECK_EQ(hmac_hex(key4, std::string(50, '\xcd')),
           std::string("82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"));
  // Test cases 6 and 7: a 131-byte key, longer than the block, is hashed first.
  const std::string long_key(131, '\xaa');
  CHECK_EQ(hmac_hex(long_key, "Test Using Larger Than Block-Size Key - Hash Key First"),
           std::string("60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"));
  CHECK_EQ(hmac_hex(long_key,
                    "This is a test using a larger than block-size key and a larger than block-size data. "
                    "The key needs to be hashed before being used by the HMAC algorithm."),
           std::string("9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"));
}

BRAID_TEST(digest_equal_checks_every_byte) {
  const Digest a = braid::hmac_sha256("k", 1, "m", 1);
  Digest b = a;
  CHECK(braid::digest_equal(a.data(), b.data(), a.size()));
  b[0] ^= 1;
  CHECK(!braid::digest_equal(a.data(), b.data(), a.size()));
  b = a;
  b[31] ^= 0x80;
  CHECK(!braid::digest_equal(a.data(), b.data(), a.size()));
  CHECK(braid::digest_equal(a.data(), b.data(), 0));
}

BRAID_TEST(hex_round_trip_and_rejection) {
  std::vector<uint8_t> bytes(256);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i);
  const std::string hex = braid::to_hex(bytes.data(), bytes.size());
  CHECK_EQ(hex.size(), size_t{512});
  CHECK_EQ(hex.substr(0, 8), std::string("00010203"));
  CHECK_EQ(hex.substr(504), std::string("fcfdfeff"));
  std::vector<uint8_t> back;
  CHECK(braid::from_hex(hex, back));
  CHECK(back == bytes);

  CHECK(braid::from_hex("ABcd", back));
  CHECK(back == (std::vector<uint8_t>{0xab, 0xcd}));
  CHECK(braid::from_hex("", back));
  CHECK(back.empty());

  CHECK(!braid::from_hex("abc", back));
  CHECK(!braid::from_hex("0g", back));
  CHECK(!braid::from_hex("g0", back));
  CHECK(!braid::from_hex("12 4", back));
  CHECK(!braid::from_hex(std::string("1\0", 2), back));
}

BRAID_TEST(random_bytes_differ) {
  uint8_t a[32], b[32];
  braid::random_bytes(a, sizeof(a));
  braid::random_bytes(b, sizeof(b));
  // Equal 256-bit draws mean the source is broken, not bad luck.
  CHECK(!braid::digest_equal(a, b, sizeof(a)));
}
