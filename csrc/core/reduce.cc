// Reduction kernels: blocked loops over a float32 (or native) accumulator that stays in L1.
#include "reduce.h"

#include "copy.h"
#include "half.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace braid {
namespace {

template <class T> struct Traits {
  using Acc = T;
  static Acc load(T x) { return x; }
  static T store(Acc x) { return x; }
};
template <> struct Traits<BF16> {
  using Acc = float;
  static float load(BF16 x) { return bf16_to_f32(x.bits); }
  static BF16 store(float x) { return BF16{f32_to_bf16(x)}; }
};
template <> struct Traits<F16> {
  using Acc = float;
  static float load(F16 x) { return f16_to_f32(x.bits); }
  static F16 store(float x) { return F16{f32_to_f16(x)}; }
};

// NaN propagates through max/min as in torch (x != x is false for integers and folds away).
// Integers wrap on overflow as in torch: computed in the unsigned type, where wrapping is defined.
template <class A, bool = std::is_integral_v<A>> struct WrapT { using type = A; };
template <class A> struct WrapT<A, true> { using type = std::make_unsigned_t<A>; };
template <class A> using Wrap = typename WrapT<A>::type;
struct SumOp {
  template <class A> static A apply(A a, A b) { return static_cast<A>(Wrap<A>(a) + Wrap<A>(b)); }
};
struct ProdOp {
  template <class A> static A apply(A a, A b) { return static_cast<A>(Wrap<A>(a) * Wrap<A>(b)); }
};
struct MaxOp {
  template <class A> static A apply(A a, A b) { return (a >= b || a != a) ? a : b; }
};
struct MinOp {
  template <class A> static A apply(A a, A b) { return (a <= b || a != a) ? a : b; }
};

struct BandOp {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a & b); }
};
struct BorOp {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a | b); }
};
struct BxorOp {
  template <class A> static A apply(A a, A b) { return static_cast<A>(a ^ b); }
};

// The accumulators of a block, rounded to the element type.
template <class T, class Acc> void store_block(const Acc* __restrict tmp, T* __restrict o, size_t m) {
  if constexpr (std::is_same_v<T, F16> || std::is_same_v<T, BF16>) {
    narrow_n<T>(tmp, reinterpret_cast<uint16_t*>(o), m);
  } else {
    for (size_t k = 0; k < m; ++k) o[k] = Traits<T>::store(tmp[k]);
  }
}

// 512 accumulators: 2-4 KB, resident in L1 across the passes over the inputs.
constexpr size_t kBlock = 512;

template <class T, class Op>
void reduce_typed(const Operand* srcs, int nsrc, const ReduceDst& to, size_t count, int divisor) {
  void* const dst = to.ptr;
  void* const dst2 = to.copy;
  const bool dst_acc = to.acc, stream = to.stream;
  using Acc = typename Traits<T>::Acc;
  alignas(64) Acc tmp[kBlock];
  alignas(64) T rounded[kBlock];  // the block in element type, for streaming stores
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    for (int j = 0; j < nsrc; ++j) {
      if (srcs[j].acc) {
        const Acc* __restrict s = static_cast<const Acc*>(srcs[j].ptr) + base;
        if (j == 0) {
          for (size_t k = 0; k < m; ++k) tmp[k] = s[k];
        } else {
          for (size_t k = 0; k < m; ++k) tmp[k] = Op::apply(tmp[k], s[k]);
        }
      } else if constexpr (std::is_same_v<T, F16>) {  // converted a block at a time (F16C)
        const uint16_t* s = static_cast<const uint16_t*>(srcs[j].ptr) + base;
        if (j == 0) {
          widen_n<F16>(s, tmp, m);
        } else {
          alignas(64) float conv[kBlock];
          widen_n<F16>(s, conv, m);
          for (size_t k = 0; k < m; ++k) tmp[k] = Op::apply(tmp[k], conv[k]);
        }
      } else {
        const T* __restrict s = static_cast<const T*>(srcs[j].ptr) + base;
        if (j == 0) {
          for (size_t k = 0; k < m; ++k) tmp[k] = Traits<T>::load(s[k]);
        } else {
          for (size_t k = 0; k < m; ++k) tmp[k] = Op::apply(tmp[k], Traits<T>::load(s[k]));
        }
      }
    }
    if (divisor > 1) {
      const Acc d = static_cast<Acc>(divisor);
      for (size_t k = 0; k < m; ++k) tmp[k] = tmp[k] / d;
    }
    if (stream && !dst_acc && dst2 == nullptr) {
      store_block(tmp, rounded, m);
      copy_streaming(static_cast<T*>(dst) + base, rounded, m * sizeof(T), /*fence=*/false);
      continue;
    }
    if (!dst_acc && dst2 != nullptr && !std::is_same_v<T, Acc>) {
      // Two destinations of a half type: round once, store the bits twice.
      store_block(tmp, rounded, m);
      std::memcpy(static_cast<T*>(dst) + base, rounded, m * sizeof(T));
      std::memcpy(static_cast<T*>(dst2) + base, rounded, m * sizeof(T));
      continue;
    }
    void* outs[2] = {dst, dst2};
    for (void* out : outs) {
      if (out == nullptr) continue;
      if (dst_acc) {
        Acc* __restrict o = static_cast<Acc*>(out) + base;
        for (size_t k = 0; k < m; ++k) o[k] = tmp[k];
      } else {
        store_block(tmp, static_cast<T*>(out) + base, m);
      }
    }
  }
}

template <class T>
void reduce_op(ReduceOp op, const Operand* srcs, int nsrc, const ReduceDst& to, size_t count, int divisor) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return reduce_typed<T, SumOp>(srcs, nsrc, to, count, divisor);
    case ReduceOp::kProd:
      return reduce_typed<T, ProdOp>(srcs, nsrc, to, count, divisor);
    case ReduceOp::kMax:
      return reduce_typed<T, MaxOp>(srcs, nsrc, to, count, divisor);
    case ReduceOp::kMin:
      return reduce_typed<T, MinOp>(srcs, nsrc, to, count, divisor);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::kBand) return reduce_typed<T, BandOp>(srcs, nsrc, to, count, divisor);
        if (op == ReduceOp::kBor) return reduce_typed<T, BorOp>(srcs, nsrc, to, count, divisor);
        return reduce_typed<T, BxorOp>(srcs, nsrc, to, count, divisor);
      } else {
        throw std::invalid_argument(std::string("bitwise reduce op ") + reduce_op_name(op) +
                                    " needs an integer dtype");
      }
  }
}

}  // namespace

void reduce_n(DType dtype, ReduceOp op, const Operand* srcs, int nsrc, const ReduceDst& to, size_t count) {
  const int divisor = (to.finalize && op == ReduceOp::kAvg) ? to.world_size : 0;
  struct Fence {
    bool on;
    ~Fence() {
      if (on) streaming_fence();
    }
  } fence{to.stream};
  switch (dtype) {
    case DType::kFloat32: return reduce_op<float>(op, srcs, nsrc, to, count, divisor);
    case DType::kFloat64: return reduce_op<double>(op, srcs, nsrc, to, count, divisor);
    case DType::kFloat16: return reduce_op<F16>(op, srcs, nsrc, to, count, divisor);
    case DType::kBFloat16: return reduce_op<BF16>(op, srcs, nsrc, to, count, divisor);
    case DType::kInt32: return reduce_op<int32_t>(op, srcs, nsrc, to, count, divisor);
    case DType::kInt64: return reduce_op<int64_t>(op, srcs, nsrc, to, count, divisor);
    case DType::kUInt8: return reduce_op<uint8_t>(op, srcs, nsrc, to, count, divisor);
  }
}

}  // namespace braid
