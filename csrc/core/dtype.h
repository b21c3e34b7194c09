// Element types and reduction operators understood by the torch-free core.
#pragma once

#include <cstddef>
#include <cstdint>

namespace braid {

// Values are part of the binding ABI (the Python layer passes them as ints).
enum class DType : uint32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,  // raw bytes (compressed payloads); sums wrap as in torch
};

enum class ReduceOp : uint32_t {
  kSum = 0,
  kAvg = 1,
  kMax = 2,
  kMin = 3,
  kProd = 4,
  // Bitwise, integer types only (as in torch.distributed's BAND, BOR, BXOR).
  kBand = 5,
  kBor = 6,
  kBxor = 7,
};
constexpr int kNumReduceOps = 8;

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

// Half types travel as themselves but accumulate in float32; other types accumulate in place.
inline bool dtype_is_half(DType t) { return t == DType::kFloat16 || t == DType::kBFloat16; }
inline size_t acc_size(DType t) { return dtype_is_half(t) ? 4 : dtype_size(t); }

inline bool dtype_is_integral(DType t) { return t == DType::kInt32 || t == DType::kInt64 || t == DType::kUInt8; }
inline bool op_is_bitwise(ReduceOp op) { return op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor; }
// Whether `op` can reduce elements of `t` (bitwise ops need integers).
inline bool op_supports(ReduceOp op, DType t) { return !op_is_bitwise(op) || dtype_is_integral(t); }

const char* dtype_name(DType t);
const char* reduce_op_name(ReduceOp op);

}  // namespace braid
