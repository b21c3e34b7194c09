// Scalar reference conversions and typed buffers for the core tests.
#include "reference.h"

#include <cstring>
#include <sstream>

namespace braid_test {
namespace {

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

uint16_t ref_f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = f32_bits(f);
  uint32_t upper = u >> 16;
  const uint32_t lower = u & 0xFFFFu;
  // Above half an ulp rounds up; exactly half rounds to the even neighbour. Carrying into the
  // exponent is right, including the step from the largest finite value to infinity.
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) ++upper;
  return static_cast<uint16_t>(upper);
}

float ref_bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

uint16_t ref_f32_to_f16(float f) {
  if (std::isnan(f)) return 0x7E00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  // Doubles hold every float exactly, and the scaled values below stay exact: the rounding
  // happens only in nearbyint (the default rounding mode, nearest-even).
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7C00;  // halfway between 65504 and 2^16 rounds (to even) up
  if (a < std::ldexp(1.0, -14)) {          // subnormal: units of 2^-24
    const auto m = static_cast<uint16_t>(std::nearbyint(a * std::ldexp(1.0, 24)));
    return sign | m;  // m == 1024 is the smallest normal, whose bits are exactly 0x0400
  }
  int e2;
  std::frexp(a, &e2);  // a = fr * 2^e2, fr in [0.5, 1)
  int e = e2 - 1;      // a in [2^e, 2^(e+1))
  auto m = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, 10 - e)));  // in [1024, 2048]
  if (m == 2048) {
    m = 1024;
    ++e;
  }
  if (e > 15) return sign | 0x7C00;
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | (m - 1024));
}

float ref_f16_to_f32(uint16_t h) {
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  double v;
  if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else if (e == 31) {
    v = m == 0 ? HUGE_VAL : NAN;
  } else {
    v = std::ldexp(static_cast<double>(m + 1024), e - 25);
  }
  return static_cast<float>((h & 0x8000) ? -v : v);
}

Buffer::Buffer(braid::DType dtype, size_t count)
    : dtype_(dtype), count_(count), bytes_((count * braid::dtype_size(dtype) + 7) / 8 + 1, 0) {}

void Buffer::set(size_t i, double v) {
  visit_dtype(dtype_, [&](auto ref) {
    using R = decltype(ref);
    const auto x = R::store(static_cast<typename R::Acc>(v));
    std::memcpy(at(i), &x, sizeof(x));
  });
}

double Buffer::get(size_t i) const {
  return visit_dtype(dtype_, [&](auto ref) {
    using R = decltype(ref);
    typename R::T x;
    std::memcpy(&x, reinterpret_cast<const char*>(bytes_.data()) + i * sizeof(x), sizeof(x));
    return static_cast<double>(R::load(x));
  });
}

bool same_element(braid::DType dtype, const void* a, const void* b) {
  const size_t es = braid::dtype_size(dtype);
  if (std::memcmp(a, b, es) == 0) return true;
  switch (dtype) {
    case braid::DType::kFloat32: {
      float x, y;
      std::memcpy(&x, a, 4);
      std::memcpy(&y, b, 4);
      return std::isnan(x) && std::isnan(y);
    }
    case braid::DType::kFloat64: {
      double x, y;
      std::memcpy(&x, a, 8);
      std::memcpy(&y, b, 8);
      return std::isnan(x) && std::isnan(y);
    }
    case braid::DType::kFloat16: {
      uint16_t x, y;
      std::memcpy(&x, a, 2);
      std::memcpy(&y, b, 2);
      return (x & 0x7FFF) > 0x7C00 && (y & 0x7FFF) > 0x7C00;
    }
    default:
      return false;
  }
}

std::string compare(braid::DType dtype, const void* got, const void* want, size_t count) {
  const size_t es = braid::dtype_size(dtype);
  const auto* g = static_cast<const char*>(got);
  const auto* w = static_cast<const char*>(want);
  size_t bad = 0, first = count;
  for (size_t i = 0; i < count; ++i) {
    if (same_element(dtype, g + i * es, w + i * es)) continue;
    if (bad++ == 0) first = i;
  }
  if (bad == 0) return "";
  auto hex = [&](const char* p) {
    uint64_t v = 0;
    std::memcpy(&v, p, es);
    std::ostringstream s;
    s << "0x" << std::hex << v;
    return s.str();
  };
  Buffer one_g(dtype, 1), one_w(dtype, 1);
  std::memcpy(one_g.data(), g + first * es, es);
  std::memcpy(one_w.data(), w + first * es, es);
  std::ostringstream s;
  s << bad << " of " << count << " " << braid::dtype_name(dtype) << " elements differ; first at " << first
    << ": got " << one_g.get(0) << " (" << hex(g + first * es) << "), want " << one_w.get(0) << " ("
    << hex(w + first * es) << ")";
  return s.str();
}

}  // namespace braid_test
