// The CUDA kernels (csrc/cuda/compression, csrc/cuda/ipc), run through the host emulation
// (cuda_host.h), against the CPU kernels bit for bit: payload bytes, residuals, decoded values,
// top-k selections, reductions. The CPU kernels are checked against pure-torch references
// (tests/test_compression_kernels.py), so this checks the CUDA kernels' indexing, layouts,
// rounding, padding and special values without a GPU; what only a GPU shows (its memory model,
// speed) stays with tests/test_compression_cuda.py. Outputs sit between guard bytes, so a kernel
// that writes outside them fails.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "core/compression/error_feedback.h"
#include "core/compression/quantize.h"
#include "core/compression/top_k.h"
#include "core/half.h"
#include "core/reduce.h"
#include "cuda/compression/compression_cuda.h"
#include "cuda/ipc/ipc_reduce.h"

using braid::DType;
using braid::QuantFormat;
using braid::TopKPath;
using namespace braid_test;

namespace {

constexpr uint8_t kGuard = 0x5A;
constexpr size_t kPad = 64;

// `n` bytes between two guard zones.
struct Guarded {
  std::vector<uint8_t> raw;
  explicit Guarded(size_t n, uint8_t fill = kGuard) : raw(n + 2 * kPad, fill) {
    for (size_t i = 0; i < kPad; ++i) raw[i] = raw[kPad + n + i] = kGuard;
  }
  uint8_t* data() { return raw.data() + kPad; }
  bool intact(size_t n) const {
    for (size_t i = 0; i < kPad; ++i)
      if (raw[i] != kGuard || raw[kPad + n + i] != kGuard) return false;
    return true;
  }
  bool same_bytes(const Guarded& o, size_t n) const { return std::memcmp(raw.data() + kPad, o.raw.data() + kPad, n) == 0; }
};

const std::vector<DType> kDtypes = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// The sanitizer builds (make sanitize) switch fibers tens of times slower: they run a corner of
// each matrix (the first entries and the last, where the hard sizes sit), enough for memory
// errors, within ctest's time limit.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kInstrumented = true;
#else
constexpr bool kInstrumented = false;
#endif

template <class T>
std::vector<T> sweep(std::vector<T> v) {
  if (kInstrumented && v.size() > 2) v = {v.front(), v.back()};
  return v;
}

// Gradient-like values whose scale changes every 97 elements, with the hard cases at fixed
// places: a NaN, infinities, a block of zeros, a block far below float32's smallest normal
// number (where qmax / absmax overflows), and float16's overflow range.
std::vector<float> gradient(std::mt19937_64& rng, size_t count, bool special) {
  std::normal_distribution<float> normal;
  std::vector<float> x(count);
  for (size_t i = 0; i < count; ++i) x[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>((i / 97) % 9) - 4);
  if (special) {
    for (size_t i = 0; i < count; ++i) {
      if (i % 1000 == 411) x[i] = NAN;
      if (i % 1000 == 733) x[i] = -INFINITY;
      if (i / 64 % 16 == 5) x[i] = 0.0f;
      if (i / 64 % 16 == 9) x[i] = std::ldexp(x[i], -130);
      if (i % 500 == 17) x[i] = 70000.0f;
    }
  }
  return x;
}

// x converted to `dtype` (float16/bfloat16 round to nearest even), as raw bytes.
std::vector<uint8_t> encode(const std::vector<float>& x, DType dtype) {
  const size_t es = braid::dtype_size(dtype);
  std::vector<uint8_t> out(x.size() * es);
  for (size_t i = 0; i < x.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &x[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBFloat16 ? braid::f32_to_bf16(x[i]) : braid::f32_to_f16(x[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// Bit for bit (NaNs included); empty vectors have null data(), which memcmp must not get.
bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

std::string last_failure() { return cuda_host::last_failure(); }

}  // namespace

BRAID_TEST(emulated_quantize_matches_the_cpu_bit_for_bit) {
  std::mt19937_64 rng(11);
  const auto counts = sweep<size_t>({0, 1, 33, 257, 1000, 2049});
  // Blocks below, at and above a warp, uneven, at the 256-thread launch width, past it.
  const auto blocks = sweep<size_t>({16, 32, 98, 256, 1000});
  const auto dtypes = sweep(kDtypes);
  size_t cases = 0;
  for (int bits : {8, 4}) {
    for (size_t block : blocks) {
      const QuantFormat fmt{bits, block};
      for (DType dtype : dtypes) {
        for (size_t count : counts) {
          for (size_t nchunks : {1, 3}) {
            const size_t chunk = nchunks == 1 ? count : (count + nchunks - 1) / nchunks + 5;
            const std::vector<float> x = gradient(rng, count, (count + block) % 2 == 1);
            const std::vector<uint8_t> in = encode(x, dtype);
            std::vector<float> r0 = gradient(rng, count, false);
            for (float& v : r0) v *= 0.01f;
            for (bool stochastic : {false, true}) {
              for (bool feedback : {false, true}) {
                const uint64_t seed = rng(), base = rng() % 1000;
                const size_t bytes = fmt.bytes(chunk) * nchunks;
                // Different fills: padding the kernel forgets to write shows as a difference.
                Guarded cpu(bytes, 0x00), gpu(bytes, 0xEE);
                std::vector<float> rc = r0, rg = r0;
                braid::quantize(fmt, dtype, in.data(), feedback ? rc.data() : nullptr, count, chunk, nchunks,
                                stochastic, seed, base, cpu.data());
                const cudaError_t e =
                    braid::cuda::quantize(fmt, dtype, in.data(), feedback ? rg.data() : nullptr, count, chunk,
                                          nchunks, stochastic, seed, base, gpu.data(), nullptr);
                const std::string what = "int" + std::to_string(bits) + " block " + std::to_string(block) + " " +
                                         dtype_name(dtype) + " count " + std::to_string(count) + " chunks " +
                                         std::to_string(nchunks) + (stochastic ? " stochastic" : " nearest") +
                                         (feedback ? " +feedback" : "");
                CHECK_MSG(e == cudaSuccess && cudaGetLastError() == cudaSuccess, what + ": " + last_failure());
                CHECK_MSG(gpu.same_bytes(cpu, bytes), what + ": payload differs from the CPU's");
                CHECK_MSG(gpu.intact(bytes), what + ": wrote outside the payload");
                CHECK_MSG(same_floats(rg, rc), what + ": residual differs from the CPU's");
                ++cases;
              }
            }
          }
        }
      }
    }
  }
  CHECK(cases == 2 * blocks.size() * dtypes.size() * counts.size() * 2 * 4);
}

BRAID_TEST(emulated_dequantize_matches_the_cpu_bit_for_bit) {
  std::mt19937_64 rng(12);
  for (int bits : {8, 4}) {
    for (size_t block : {size_t(32), size_t(98), size_t(256)}) {
      const QuantFormat fmt{bits, block};
      for (size_t count : {size_t(1), size_t(255), size_t(1001), size_t(3000)}) {
        for (size_t nchunks : {1, 4}) {
          const size_t chunk = nchunks == 1 ? count : (count + nchunks - 1) / nchunks + 3;
          const std::vector<float> x = gradient(rng, count, true);
          std::vector<uint8_t> payload(fmt.bytes(chunk) * nchunks);
          braid::quantize(fmt, DType::kFloat32, x.data(), nullptr, count, chunk, nchunks, true, rng(), 0,
                          payload.data());
          const std::string what = "int" + std::to_string(bits) + " block " + std::to_string(block) + " count " +
                                   std::to_string(count) + " chunks " + std::to_string(nchunks);
          for (DType dtype : kDtypes) {
            const size_t out_bytes = count * braid::dtype_size(dtype);
            Guarded cpu(out_bytes, 0), gpu(out_bytes, 0xEE);
            braid::dequantize(fmt, payload.data(), count, chunk, dtype, cpu.data());
            const cudaError_t e = braid::cuda::dequantize(fmt, payload.data(), count, chunk, dtype, gpu.data(), nullptr);
            CHECK_MSG(e == cudaSuccess, what + " " + dtype_name(dtype) + ": " + last_failure());
            CHECK_MSG(gpu.same_bytes(cpu, out_bytes) && gpu.intact(out_bytes),
                      what + " " + dtype_name(dtype) + ": dequantized values differ from the CPU's");
          }
          if (nchunks == 1) {  // accumulation reads the plain layout
            std::vector<float> acc_cpu = gradient(rng, count, false), acc_gpu = acc_cpu;
            braid::dequantize_accumulate(fmt, payload.data(), count, acc_cpu.data());
            const cudaError_t e = braid::cuda::dequantize_accumulate(fmt, payload.data(), count, acc_gpu.data(), nullptr);
            CHECK_MSG(e == cudaSuccess, what + " accumulate: " + last_failure());
            CHECK_MSG(same_floats(acc_gpu, acc_cpu), what + ": dequantize-accumulate differs from the CPU's");
          }
        }
      }
    }
  }
}

BRAID_TEST(emulated_error_feedback_update_matches_the_cpu) {
  std::mt19937_64 rng(13);
  for (DType dtype : kDtypes) {
    for (size_t count : {size_t(1), size_t(300), size_t(5000)}) {
      const std::vector<float> x = gradient(rng, count, true);
      const std::vector<uint8_t> in = encode(x, dtype);
      std::vector<float> sent = gradient(rng, count, true);
      for (bool with_sent : {false, true}) {
        std::vector<float> rc = gradient(rng, count, false), rg = rc;
        braid::error_feedback_update(dtype, in.data(), rc.data(), with_sent ? sent.data() : nullptr, count);
        const cudaError_t e = braid::cuda::error_feedback_update(dtype, in.data(), rg.data(),
                                                                 with_sent ? sent.data() : nullptr, count, nullptr);
        const std::string what = std::string(dtype_name(dtype)) + " count " + std::to_string(count) +
                                 (with_sent ? " with sent" : " without sent");
        CHECK_MSG(e == cudaSuccess, what + ": " + last_failure());
        CHECK_MSG(same_floats(rg, rc), what + ": residual differs from the CPU's");
      }
    }
  }
}

BRAID_TEST(emulated_top_k_selects_what_the_cpu_selects) {
  std::mt19937_64 rng(14);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> u;
  int sampled = 0, cases = 0;
  for (DType dtype : sweep(kDtypes)) {
    for (size_t count : sweep<size_t>({1, 100, 40000, 150001})) {
      for (double ratio : sweep<double>({0.001, 0.01, 0.05, 0.5})) {
        for (int shape : sweep<int>({0, 1, 2})) {
          std::vector<float> x(count);
          for (size_t i = 0; i < count; ++i) {
            float v = normal(rng) * static_cast<float>(1 + (i / 256) % 5);
            if (shape == 1) v = std::round(v * 2) / 2;                     // many ties
            if (shape == 2 && u(rng) < 0.002f) v = u(rng) < 0.5f ? NAN : -INFINITY;
            x[i] = v;
          }
          const std::vector<uint8_t> in = encode(x, dtype);
          const size_t k = std::max<size_t>(1, static_cast<size_t>(ratio * static_cast<double>(count)));
          const size_t kk = std::min(k, count);
          std::vector<float> vc(kk), vg(kk + 2, 321.0f);
          std::vector<int32_t> ic(kk), ig(kk + 2, -9);
          const TopKPath pc = braid::top_k_select(dtype, in.data(), count, k, vc.data(), ic.data());
          TopKPath pg = TopKPath::kSampled;
          const cudaError_t e =
              braid::cuda::top_k_select(dtype, in.data(), count, k, vg.data() + 1, ig.data() + 1, &pg, nullptr);
          const std::string what = std::string(dtype_name(dtype)) + " count " + std::to_string(count) + " k " +
                                   std::to_string(k) + " shape " + std::to_string(shape);
          CHECK_MSG(e == cudaSuccess, what + ": " + last_failure());
          CHECK_MSG(pg == pc, what + ": took the other path");
          CHECK_MSG(std::memcmp(ig.data() + 1, ic.data(), kk * sizeof(int32_t)) == 0, what + ": other indices");
          CHECK_MSG(std::memcmp(vg.data() + 1, vc.data(), kk * sizeof(float)) == 0, what + ": other values");
          CHECK_MSG(vg[0] == 321.0f && vg[kk + 1] == 321.0f && ig[0] == -9 && ig[kk + 1] == -9,
                    what + ": wrote outside the output");
          sampled += pg == TopKPath::kSampled;
          ++cases;
        }
      }
    }
  }
  // Both paths ran: the sampled one on the large tensors, the exact one on the small.
  CHECK_MSG(sampled > 0 && sampled < cases, "paths: " + std::to_string(sampled) + " sampled of " + std::to_string(cases));
}

BRAID_TEST(emulated_scatter_add_matches_the_cpu) {
  std::mt19937_64 rng(15);
  for (size_t k : {size_t(1), size_t(255), size_t(3001)}) {
    const size_t count = 4 * k + 7;
    std::vector<int32_t> idx(count);
    for (size_t i = 0; i < count; ++i) idx[i] = static_cast<int32_t>(i);
    std::shuffle(idx.begin(), idx.end(), rng);
    idx.resize(k);  // distinct, as top_k_select's are
    const std::vector<float> values = gradient(rng, k, true);
    std::vector<float> ac = gradient(rng, count, false), ag = ac;
    braid::scatter_add(ac.data(), idx.data(), values.data(), k);
    const cudaError_t e = braid::cuda::scatter_add(ag.data(), idx.data(), values.data(), k, nullptr);
    CHECK_MSG(e == cudaSuccess, "scatter_add k " + std::to_string(k) + ": " + last_failure());
    CHECK_MSG(same_floats(ag, ac), "scatter_add k " + std::to_string(k) + " differs from the CPU's");
  }
}

// The IPC reduction (csrc/cuda/ipc) against reduce_n: every dtype and operator, 1 to 16 sources,
// every path of the kernel (16-byte vectors, the scalar elements before the first aligned vector
// and after the last, the scalar loop of pointers at different offsets), in place and not.
namespace {

// Random elements of `dtype` with the hard cases among them: for floating types NaNs (of either
// sign, with payloads), infinities, signed zeros, subnormals and values whose sums overflow the
// type; for integers the whole range (sums and products wrap) mixed with small values of either
// sign (avg's division truncates toward zero).
std::vector<uint8_t> reduce_operand(std::mt19937_64& rng, DType dtype, size_t count) {
  const size_t es = braid::dtype_size(dtype);
  std::vector<uint8_t> out(count * es);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> pick(0, 63);
  const double specials[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0, -0.0, 1e-40, -3e-39, 65504.0, 6e4, 3e38, 1e308};
  for (size_t i = 0; i < count; ++i) {
    uint8_t* p = out.data() + i * es;
    const int k = pick(rng);
    if (braid::dtype_is_integral(dtype)) {
      uint64_t bits = rng();
      if (k < 32) bits = static_cast<uint64_t>(static_cast<int64_t>(bits % 201) - 100);
      std::memcpy(p, &bits, es);  // little-endian: the low bytes
      continue;
    }
    double v = normal(rng) * std::ldexp(1.0, static_cast<int>(rng() % 17) - 8);
    if (k < 6) v = specials[rng() % (sizeof(specials) / sizeof(specials[0]))];
    const float f = static_cast<float>(v);
    if (dtype == DType::kFloat64) {
      std::memcpy(p, &v, 8);
    } else if (dtype == DType::kFloat32) {
      std::memcpy(p, &f, 4);
    } else {
      uint16_t h = dtype == DType::kBFloat16 ? braid::f32_to_bf16(f) : braid::f32_to_f16(f);
      if (k == 0) h = dtype == DType::kBFloat16 ? 0xFFC1 : 0xFE01;  // a negative NaN with a payload
      std::memcpy(p, &h, 2);
    }
  }
  return out;
}

// Bit for bit, except that a float32 or float64 NaN equals any NaN: which operand's NaN an x86
// addition returns depends on the order the compiler put the operands in (reduce_n's vectorized
// loop and the emulated kernel's scalar one differ), and a GPU writes its one canonical NaN. The
// half types compare every bit: both paths write the one NaN reduce_n rounds to.
bool same_element(DType dtype, const uint8_t* a, const uint8_t* b) {
  if (dtype == DType::kFloat32) {
    float x, y;
    std::memcpy(&x, a, 4);
    std::memcpy(&y, b, 4);
    if (std::isnan(x) && std::isnan(y)) return true;
  } else if (dtype == DType::kFloat64) {
    double x, y;
    std::memcpy(&x, a, 8);
    std::memcpy(&y, b, 8);
    if (std::isnan(x) && std::isnan(y)) return true;
  }
  return std::memcmp(a, b, braid::dtype_size(dtype)) == 0;
}

// Where the operands sit relative to a 16-byte boundary, and whether dst is srcs[0].
enum class Layout { kAligned, kShifted, kOneSourceShifted, kInPlaceShifted };
const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kAligned: return "aligned";
    case Layout::kShifted: return "all shifted by an element";
    case Layout::kOneSourceShifted: return "last source shifted by an element";
    case Layout::kInPlaceShifted: return "in place, shifted by an element";
  }
  return "?";
}

// Runs launch_ipc_reduce on copies of `data` (nsrcs operands of `count` elements) laid out as
// `layout`, and reduce_n on the originals; true if both wrote the same bytes and the kernel wrote
// nothing else. `what` names the case in failures.
bool ipc_reduce_matches(const std::vector<std::vector<uint8_t>>& data, int nsrcs, size_t count, DType dtype,
                        braid::ReduceOp op, int divisor, Layout layout, const std::string& what) {
  const size_t es = braid::dtype_size(dtype), bytes = count * es;
  const bool in_place = layout == Layout::kInPlaceShifted;
  const bool all_shifted = layout == Layout::kShifted || in_place;
  // Each operand in its own guarded buffer, whose data() is 16-byte aligned; shifted ones start
  // an element later.
  std::vector<Guarded> bufs;
  std::vector<size_t> shift(static_cast<size_t>(nsrcs) + 1, 0);
  for (int j = 0; j <= nsrcs; ++j) {
    const bool shifted = all_shifted || (layout == Layout::kOneSourceShifted && j == nsrcs - 1);
    shift[static_cast<size_t>(j)] = shifted ? es : 0;
    bufs.emplace_back(bytes + es, 0xEE);
  }
  for (Guarded& b : bufs) CHECK_MSG(reinterpret_cast<uintptr_t>(b.data()) % 16 == 0, what + ": a buffer is misaligned");
  std::vector<const void*> srcs(static_cast<size_t>(nsrcs));
  std::vector<braid::Operand> operands(static_cast<size_t>(nsrcs));
  for (int j = 0; j < nsrcs; ++j) {
    uint8_t* p = bufs[static_cast<size_t>(j)].data() + shift[static_cast<size_t>(j)];
    if (bytes != 0) std::memcpy(p, data[static_cast<size_t>(j)].data(), bytes);
    srcs[static_cast<size_t>(j)] = p;
    operands[static_cast<size_t>(j)] = {data[static_cast<size_t>(j)].data(), false};
  }
  const size_t out_index = in_place ? 0 : static_cast<size_t>(nsrcs);
  uint8_t* out = bufs[out_index].data() + shift[out_index];
  std::vector<uint8_t> expected(bytes + 1);
  braid::reduce_n(dtype, op, operands.data(), nsrcs, braid::ReduceDst::result(expected.data(), divisor), count);

  const cudaError_t e = braid::cuda::launch_ipc_reduce(out, srcs.data(), nsrcs, count, dtype, op, divisor, nullptr);
  CHECK_MSG(e == cudaSuccess && cudaGetLastError() == cudaSuccess, what + ": " + last_failure());
  bool ok = true;
  for (size_t i = 0; i < count && ok; ++i) {
    if (!same_element(dtype, out + i * es, expected.data() + i * es)) {
      CHECK_MSG(false, what + ": element " + std::to_string(i) + " differs from reduce_n's");
      ok = false;
    }
  }
  // Nothing written outside the output (its guards, and the spare element before a shifted
  // output or after an aligned one) or to a source but an in-place one.
  Guarded& ob = bufs[out_index];
  bool outside_intact = ob.intact(bytes + es);
  const uint8_t* spare = shift[out_index] == 0 ? ob.data() + bytes : ob.data();
  for (size_t b = 0; b < es; ++b) outside_intact = outside_intact && spare[b] == 0xEE;
  CHECK_MSG(outside_intact, what + ": wrote outside the output");
  for (int j = 0; j < nsrcs; ++j) {
    if (in_place && j == 0) continue;
    const size_t b = static_cast<size_t>(j);
    const bool kept = bytes == 0 || std::memcmp(bufs[b].data() + shift[b], data[b].data(), bytes) == 0;
    CHECK_MSG(kept, what + ": source " + std::to_string(j) + " was modified");
    ok = ok && kept;
  }
  return ok && outside_intact;
}

const std::vector<DType> kAllDtypes = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                                       DType::kInt32,   DType::kInt64,   DType::kUInt8};

std::string reduce_case(DType dtype, braid::ReduceOp op, int nsrcs, size_t count, int divisor, Layout layout) {
  return std::string("ipc reduce ") + dtype_name(dtype) + " " + braid::reduce_op_name(op) + " of " +
         std::to_string(nsrcs) + " count " + std::to_string(count) + " divisor " + std::to_string(divisor) + " " +
         layout_name(layout);
}

}  // namespace

BRAID_TEST(emulated_ipc_reduce_matches_reduce_n_bit_for_bit) {
  std::mt19937_64 rng(16);
  const auto counts = sweep<size_t>({0, 1, 7, 1000, 4097});
  const auto nsrcs_list = sweep<int>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16});
  const Layout layouts[] = {Layout::kAligned, Layout::kShifted, Layout::kOneSourceShifted, Layout::kInPlaceShifted};
  size_t cases = 0, passed = 0;
  for (DType dtype : kAllDtypes) {
    std::vector<std::vector<uint8_t>> data;
    for (int j = 0; j < braid::cuda::kMaxIpcRanks; ++j) data.push_back(reduce_operand(rng, dtype, counts.back()));
    for (int o = 0; o < braid::kNumReduceOps; ++o) {
      const auto op = static_cast<braid::ReduceOp>(o);
      if (!braid::op_supports(op, dtype)) continue;
      for (int nsrcs : nsrcs_list) {
        for (size_t count : counts) {
          for (Layout layout : layouts) {
            const std::string what = reduce_case(dtype, op, nsrcs, count, nsrcs, layout);
            passed += ipc_reduce_matches(data, nsrcs, count, dtype, op, nsrcs, layout, what);
            ++cases;
          }
        }
      }
    }
  }
  // 4 floating types x 5 ops + 3 integer types x 8 ops.
  CHECK_EQ(cases, size_t(4 * 5 + 3 * 8) * nsrcs_list.size() * counts.size() * 4);
  CHECK_EQ(passed, cases);
}

BRAID_TEST(emulated_ipc_reduce_takes_its_grid_stride_loop_and_any_divisor) {
  // 40009 elements: more 16-byte vectors (2500 of uint8, more of the others) and more scalars
  // than the emulated device's grid has threads (8 blocks of 256 on its one SM); a divisor
  // unrelated to the number of sources, and none (avg's partial sums).
  std::mt19937_64 rng(17);
  const size_t count = 40009;
  for (DType dtype : sweep(kAllDtypes)) {
    std::vector<std::vector<uint8_t>> data;
    for (int j = 0; j < braid::cuda::kMaxIpcRanks; ++j) data.push_back(reduce_operand(rng, dtype, count));
    for (int o = 0; o < braid::kNumReduceOps; ++o) {
      const auto op = static_cast<braid::ReduceOp>(o);
      if (!braid::op_supports(op, dtype)) continue;
      for (int nsrcs : {3, 16}) {
        for (int divisor : {5, 0}) {
          if (divisor == 0 && op != braid::ReduceOp::kAvg) continue;  // only avg reads it
          for (Layout layout : {Layout::kAligned, Layout::kOneSourceShifted, Layout::kInPlaceShifted}) {
            ipc_reduce_matches(data, nsrcs, count, dtype, op, divisor, layout,
                               reduce_case(dtype, op, nsrcs, count, divisor, layout));
          }
        }
      }
    }
  }
}

BRAID_TEST(emulated_ipc_reduce_refuses_what_reduce_n_refuses) {
  std::vector<float> a(8, 1.0f), b(8, 2.0f), out(8, 0.0f);
  const void* srcs[braid::cuda::kMaxIpcRanks + 1] = {};
  for (const void*& s : srcs) s = a.data();
  srcs[1] = b.data();
  for (braid::ReduceOp op : {braid::ReduceOp::kBand, braid::ReduceOp::kBor, braid::ReduceOp::kBxor}) {
    for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
      const std::string what = std::string(braid::reduce_op_name(op)) + " of " + dtype_name(dtype);
      CHECK_MSG(braid::cuda::launch_ipc_reduce(out.data(), srcs, 2, 4, dtype, op, 0, nullptr) == cudaErrorInvalidValue,
                what + " was launched");
      const braid::Operand operands[2] = {{a.data(), false}, {b.data(), false}};
      bool refused = false;
      try {
        braid::reduce_n(dtype, op, operands, 2, braid::ReduceDst::result(out.data(), 2), 4);
      } catch (const std::invalid_argument&) {
        refused = true;
      }
      CHECK_MSG(refused, what + " is refused by launch_ipc_reduce but not by reduce_n");
    }
  }
  const auto sum = braid::ReduceOp::kSum;
  CHECK(braid::cuda::launch_ipc_reduce(out.data(), srcs, 0, 8, DType::kFloat32, sum, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(braid::cuda::launch_ipc_reduce(out.data(), srcs, braid::cuda::kMaxIpcRanks + 1, 8, DType::kFloat32, sum, 0,
                                       nullptr) == cudaErrorInvalidValue);
  CHECK(braid::cuda::launch_ipc_reduce(nullptr, srcs, 2, 8, DType::kFloat32, sum, 0, nullptr) == cudaErrorInvalidValue);
  srcs[1] = nullptr;
  CHECK(braid::cuda::launch_ipc_reduce(out.data(), srcs, 2, 8, DType::kFloat32, sum, 0, nullptr) == cudaErrorInvalidValue);
  CHECK_MSG(out == std::vector<float>(8, 0.0f), "a refused call wrote its output");
}

// The emulation itself: barriers hold (a value published before __syncthreads is seen by every
// thread after it, whatever order the scheduler runs the threads in), shuffles exchange, and what
// a GPU refuses fails.
namespace {

void reverse_through_shared(int* out) {
  __shared__ int tile[256];
  tile[threadIdx.x] = static_cast<int>(threadIdx.x * 3 + blockIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = tile[blockDim.x - 1 - threadIdx.x];
}

void butterfly_sum(unsigned* out) {
  unsigned v = threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[threadIdx.x] = v;
}

void diverging_barrier(int* out) {
  if (threadIdx.x < 7) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

}  // namespace

BRAID_TEST(emulation_barriers_shuffles_and_refused_launches) {
  std::vector<int> out(3 * 256, -1);
  cuda_host::launch(3, 256)(reverse_through_shared, out.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  bool ok = true;
  for (unsigned b = 0; b < 3; ++b)
    for (unsigned t = 0; t < 256; ++t) ok = ok && out[b * 256 + t] == static_cast<int>((255 - t) * 3 + b);
  CHECK_MSG(ok, "a value written before __syncthreads was not seen after it");

  std::vector<unsigned> sums(64, 0);
  cuda_host::launch(1, 64)(butterfly_sum, sums.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(sums[0] == 31 * 32 / 2 && sums[31] == 31 * 32 / 2 && sums[32] == (32 + 63) * 32 / 2 && sums[63] == sums[32]);

  std::vector<int> flags(64, 0);
  cuda_host::launch(1, 64)(diverging_barrier, flags.data());
  CHECK_MSG(cudaGetLastError() == cudaErrorLaunchFailure, "a barrier some threads skip must fail the launch");
  cuda_host::launch(1, 2048)(diverging_barrier, flags.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  cuda_host::launch(1, 32, 64 << 10)(diverging_barrier, flags.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);  // reading the error clears it
}
