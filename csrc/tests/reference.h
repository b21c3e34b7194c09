// Scalar references for the core's element types and reductions, written independently of the
// kernels (bit-level half rounding, plain loops) so that the tests compare with something else.
#pragma once

#include <cmath>
#include <stdexcept>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtype.h"

namespace braid_test {

// Round-to-nearest-even conversions; float -> bfloat16 maps every NaN to 0x7FC0 (as torch does).
uint16_t ref_f32_to_bf16(float f);
float ref_bf16_to_f32(uint16_t h);
uint16_t ref_f32_to_f16(float f);
float ref_f16_to_f32(uint16_t h);

// Per-dtype element type, accumulator type and conversions: half types accumulate in float32.
template <braid::DType D> struct Ref;
template <class E> struct SelfAccumulating {
  using T = E;
  using Acc = E;
  static Acc load(T x) { return x; }
  static T store(Acc a) { return a; }
};
template <> struct Ref<braid::DType::kFloat32> : SelfAccumulating<float> {};
template <> struct Ref<braid::DType::kFloat64> : SelfAccumulating<double> {};
template <> struct Ref<braid::DType::kFloat16> {
  using T = uint16_t;
  using Acc = float;
  static Acc load(T x) { return ref_f16_to_f32(x); }
  static T store(Acc a) { return ref_f32_to_f16(a); }
};
template <> struct Ref<braid::DType::kBFloat16> {
  using T = uint16_t;
  using Acc = float;
  static Acc load(T x) { return ref_bf16_to_f32(x); }
  static T store(Acc a) { return ref_f32_to_bf16(a); }
};
template <> struct Ref<braid::DType::kInt32> : SelfAccumulating<int32_t> {};
template <> struct Ref<braid::DType::kInt64> : SelfAccumulating<int64_t> {};
template <> struct Ref<braid::DType::kUInt8> : SelfAccumulating<uint8_t> {};

// Calls f(Ref<d>{}) for a runtime dtype.
template <class F>
decltype(auto) visit_dtype(braid::DType d, F&& f) {
  using braid::DType;
  switch (d) {
    case DType::kFloat32: return f(Ref<DType::kFloat32>{});
    case DType::kFloat64: return f(Ref<DType::kFloat64>{});
    case DType::kFloat16: return f(Ref<DType::kFloat16>{});
    case DType::kBFloat16: return f(Ref<DType::kBFloat16>{});
    case DType::kInt32: return f(Ref<DType::kInt32>{});
    case DType::kUInt8: return f(Ref<DType::kUInt8>{});
    case DType::kInt64: break;  // shares the return below, which every path needs
  }
  return f(Ref<DType::kInt64>{});
}

template <class A> bool is_nan(A a) {
  if constexpr (std::is_floating_point_v<A>) {
    return std::isnan(a);
  } else {
    return false;
  }
}

// One step of a reduction (avg sums; its division is the caller's last step). NaN propagates
// through max and min, as in torch.maximum / torch.minimum.
template <class A> A ref_apply(braid::ReduceOp op, A a, A b) {
  switch (op) {
    case braid::ReduceOp::kSum:
    case braid::ReduceOp::kAvg: return a + b;
    case braid::ReduceOp::kProd: return a * b;
    case braid::ReduceOp::kMax: return is_nan(a) ? a : is_nan(b) ? b : (a < b ? b : a);
    case braid::ReduceOp::kMin: return is_nan(a) ? a : is_nan(b) ? b : (b < a ? b : a);
    case braid::ReduceOp::kBand:
    case braid::ReduceOp::kBor:
    case braid::ReduceOp::kBxor:
      if constexpr (std::is_integral_v<A>) {
        return op == braid::ReduceOp::kBand ? (a & b) : op == braid::ReduceOp::kBor ? (a | b) : (a ^ b);
      } else {
        throw std::logic_error("bitwise reduce op on a floating-point accumulator");
      }
  }
  return a;
}

constexpr braid::DType kAllDTypes[] = {braid::DType::kFloat32, braid::DType::kFloat64, braid::DType::kFloat16,
                                       braid::DType::kBFloat16, braid::DType::kInt32, braid::DType::kInt64};
constexpr braid::ReduceOp kAllOps[] = {braid::ReduceOp::kSum, braid::ReduceOp::kAvg, braid::ReduceOp::kMax,
                                       braid::ReduceOp::kMin, braid::ReduceOp::kProd};
// Integer dtypes only.
constexpr braid::ReduceOp kBitwiseOps[] = {braid::ReduceOp::kBand, braid::ReduceOp::kBor, braid::ReduceOp::kBxor};

// A typed host buffer, written and read through doubles (exact for the values the tests use).
class Buffer {
 public:
  Buffer(braid::DType dtype, size_t count);
  void set(size_t i, double v);  // rounds to the element type
  double get(size_t i) const;
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  // Byte address of element i (one past the end allowed).
  char* at(size_t i) { return reinterpret_cast<char*>(bytes_.data()) + i * braid::dtype_size(dtype_); }
  size_t count() const { return count_; }
  braid::DType dtype() const { return dtype_; }

 private:
  braid::DType dtype_;
  size_t count_;
  // Never empty (count 0 still gets a valid address), 8-byte aligned for every element type.
  std::vector<uint64_t> bytes_;
};

// Equal bits, or both NaN (any payload) for float32/float64/float16; bfloat16 NaN must be 0x7FC0.
bool same_element(braid::DType dtype, const void* a, const void* b);
// "" when the first `count` elements match, else a description of the first difference.
std::string compare(braid::DType dtype, const void* got, const void* want, size_t count);

}  // namespace braid_test
