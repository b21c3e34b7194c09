// Block quantization (braid::quantize, dequantize, dequantize_accumulate) and the cast with error
// feedback: round trips within the format's error, error feedback that keeps exactly what was
// dropped, and nothing written outside the buffers, at sizes around blocks and chunks. The bitwise
// comparisons with pure-torch references are in tests/test_compression_kernels.py; these run in
// the sanitizer builds, which the Python tests do not.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "core/compression/error_feedback.h"
#include "core/compression/quantize.h"
#include "core/half.h"

using braid::DType;
using braid::QuantFormat;
using namespace braid_test;

namespace {

constexpr uint8_t kGuard = 0xA5;
constexpr size_t kPad = 64;  // guard bytes on each side of every output

// A byte buffer of n bytes between two guard zones.
struct Guarded {
  std::vector<uint8_t> raw;
  explicit Guarded(size_t n) : raw(n + 2 * kPad, kGuard) {}
  uint8_t* data() { return raw.data() + kPad; }
  bool intact(size_t n) const {
    for (size_t i = 0; i < kPad; ++i)
      if (raw[i] != kGuard || raw[kPad + n + i] != kGuard) return false;
    return true;
  }
};

std::vector<float> gradient(std::mt19937_64& rng, size_t count) {
  std::normal_distribution<float> normal;
  std::vector<float> x(count);
  for (size_t i = 0; i < count; ++i) x[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>((i / 97) % 9) - 4);
  return x;
}

}  // namespace

BRAID_TEST(quantize_round_trips_within_one_step) {
  std::mt19937_64 rng(7);
  const size_t counts[] = {0, 1, 2, 31, 32, 33, 255, 256, 257, 1000, 4099};
  for (int bits : {8, 4}) {
    for (size_t block : {32, 128, 256}) {
      const QuantFormat fmt{bits, block};
      for (size_t count : counts) {
        for (size_t nchunks : {1, 3}) {
          for (bool stochastic : {false, true}) {
            const size_t chunk = nchunks == 1 ? count : (count + nchunks - 1) / nchunks + 5;
            const std::vector<float> x = gradient(rng, count);
            const size_t bytes = fmt.bytes(chunk) * nchunks;
            Guarded q(bytes);
            std::vector<float> residual(count, 0.0f);
            braid::quantize(fmt, DType::kFloat32, x.data(), residual.data(), count, chunk, nchunks, stochastic,
                            11, 0, q.data());
            const std::string what = "int" + std::to_string(bits) + " block " + std::to_string(block) + " count " +
                                     std::to_string(count) + " chunks " + std::to_string(nchunks) +
                                     (stochastic ? " stochastic" : " nearest");
            CHECK_MSG(q.intact(bytes), what + ": quantize wrote outside its output");
            // Dequantize chunk by chunk (the layout of chunk j starts at j * fmt.bytes(chunk)).
            Guarded out(count * sizeof(float));
            auto* deq = reinterpret_cast<float*>(out.data());
            braid::dequantize(fmt, q.data(), count, chunk, DType::kFloat32, deq);
            CHECK_MSG(out.intact(count * sizeof(float)), what + ": dequantize wrote outside its output");
            // Accumulation takes a whole chunk (the layout's capacity), as the all-reduce sums them;
            // the elements past `count` are encoded as zeros.
            std::vector<float> acc(nchunks * chunk, 1.0f);
            for (size_t j = 0; j < nchunks; ++j)
              braid::dequantize_accumulate(fmt, q.data() + j * fmt.bytes(chunk), chunk, acc.data() + j * chunk);
            bool within = true, feedback = true, accumulated = true;
            for (size_t i = 0; i < count; ++i) {
              // The block's scale is its absmax / qmax: one step of the grid.
              const size_t c = i / chunk, in_chunk = i % chunk, b = in_chunk / block;
              float amax = 0.0f;
              for (size_t t = c * chunk + b * block; t < std::min(count, c * chunk + (b + 1) * block); ++t)
                amax = std::max(amax, std::fabs(x[t]));
              const float step = amax / static_cast<float>(fmt.qmax());
              const float err = std::fabs(deq[i] - x[i]);
              // Less than one step (stochastic) or half a step (nearest); the 1e-5 slack is the
              // float32 rounding of x * inv and q * scale, a few ulps of the step.
              within = within && err <= (stochastic ? 1.0f : 0.5f) * step * (1.0f + 1e-5f);
              // Error feedback keeps exactly x - q * scale (one float32 rounding).
              feedback = feedback && residual[i] == x[i] - deq[i];
              accumulated = accumulated && acc[i] == 1.0f + deq[i];
            }
            for (size_t i = count; i < acc.size(); ++i) accumulated = accumulated && acc[i] == 1.0f;
            CHECK_MSG(within, what + ": round trip off by more than the rounding allows");
            CHECK_MSG(feedback, what + ": residual is not what the rounding dropped");
            CHECK_MSG(accumulated, what + ": dequantize-accumulate differs from dequantize");
          }
        }
      }
    }
  }
}

BRAID_TEST(quantize_16_bit_inputs_and_outputs) {
  std::mt19937_64 rng(9);
  const QuantFormat fmt{8, 128};
  for (size_t count : {1, 127, 128, 129, 1001}) {
    const std::vector<float> x = gradient(rng, count);
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      std::vector<uint16_t> in(count);
      std::vector<float> xf(count);
      for (size_t i = 0; i < count; ++i) {
        in[i] = dt == DType::kBFloat16 ? braid::f32_to_bf16(x[i]) : braid::f32_to_f16(x[i]);
        xf[i] = dt == DType::kBFloat16 ? braid::bf16_to_f32(in[i]) : braid::f16_to_f32(in[i]);
      }
      Guarded q(fmt.bytes(count)), q32(fmt.bytes(count));
      braid::quantize(fmt, dt, in.data(), nullptr, count, count, 1, true, 3, 0, q.data());
      braid::quantize(fmt, DType::kFloat32, xf.data(), nullptr, count, count, 1, true, 3, 0, q32.data());
      // A 16-bit input quantizes as its float32 value does.
      CHECK_MSG(std::memcmp(q.data(), q32.data(), fmt.bytes(count)) == 0 && q.intact(fmt.bytes(count)),
                "16-bit input, count " + std::to_string(count));
      Guarded out(count * 2);
      braid::dequantize(fmt, q.data(), count, count, dt, out.data());
      std::vector<float> deq(count);
      braid::dequantize(fmt, q32.data(), count, count, DType::kFloat32, deq.data());
      bool same = true;
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, out.data() + 2 * i, 2);
        same = same && h == (dt == DType::kBFloat16 ? braid::f32_to_bf16(deq[i]) : braid::f32_to_f16(deq[i]));
      }
      CHECK_MSG(same && out.intact(count * 2), "16-bit output, count " + std::to_string(count));
    }
  }
}

BRAID_TEST(cast_with_feedback_keeps_the_rounding_error) {
  std::mt19937_64 rng(5);
  for (size_t count : {0, 1, 7, 8, 9, 63, 64, 65, 1000}) {
    const std::vector<float> x = gradient(rng, count);
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      std::vector<float> residual(count, 0.25f);
      const std::vector<float> before = residual;
      Guarded out(count * 2);
      braid::cast_with_feedback(DType::kFloat32, x.data(), residual.data(), dt, out.data(), count);
      bool exact = true;
      for (size_t i = 0; i < count; ++i) {
        const float sum = x[i] + before[i];
        const uint16_t want = dt == DType::kBFloat16 ? braid::f32_to_bf16(sum) : braid::f32_to_f16(sum);
        uint16_t got;
        std::memcpy(&got, out.data() + 2 * i, 2);
        const float sent = dt == DType::kBFloat16 ? braid::bf16_to_f32(got) : braid::f16_to_f32(got);
        exact = exact && got == want && residual[i] == sum - sent;
      }
      CHECK_MSG(exact && out.intact(count * 2), "cast count " + std::to_string(count));
    }
  }
}
