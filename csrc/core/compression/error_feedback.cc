// The error-feedback update, one streaming pass per dtype.
#include "error_feedback.h"

#include "../half.h"

#include <algorithm>
#include <cstdint>

namespace braid {
namespace {

template <class T>
void update_typed(const T* __restrict in, float* __restrict residual, const float* __restrict sent, size_t count) {
  if (sent != nullptr) {
    for (size_t i = 0; i < count; ++i) residual[i] = finite_or_zero((load_f32(in[i]) + residual[i]) - sent[i]);
  } else {
    for (size_t i = 0; i < count; ++i) residual[i] = load_f32(in[i]) + residual[i];
  }
}

// A block at a time, each step its own loop (rounding and widening in one loop body do not
// vectorize for float16): x = in + residual, out = round(x), residual = x - widen(out).
template <class In, class Out>
void cast_typed(const In* __restrict in, float* __restrict residual, uint16_t* __restrict out, size_t count) {
  constexpr size_t kBlock = 512;
  alignas(64) float x[kBlock];
  alignas(64) float back[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const In* __restrict src = in + base;
    if (residual != nullptr) {
      float* __restrict r = residual + base;
      for (size_t k = 0; k < m; ++k) x[k] = load_f32(src[k]) + r[k];
      narrow_n<Out>(x, out + base, m);
      widen_n<Out>(out + base, back, m);
      for (size_t k = 0; k < m; ++k) r[k] = finite_or_zero(x[k] - back[k]);
    } else {
      for (size_t k = 0; k < m; ++k) x[k] = load_f32(src[k]);
      narrow_n<Out>(x, out + base, m);
    }
  }
}

template <class Out>
void cast_from(DType in_dtype, const void* in, float* residual, uint16_t* out, size_t count) {
  switch (in_dtype) {
    case DType::kFloat32: return cast_typed<float, Out>(static_cast<const float*>(in), residual, out, count);
    case DType::kBFloat16: return cast_typed<BF16, Out>(static_cast<const BF16*>(in), residual, out, count);
    case DType::kFloat16: return cast_typed<F16, Out>(static_cast<const F16*>(in), residual, out, count);
    default: return;
  }
}

}  // namespace

void cast_with_feedback(DType in_dtype, const void* in, float* residual, DType out_dtype, void* out, size_t count) {
  auto* bits = static_cast<uint16_t*>(out);
  if (out_dtype == DType::kBFloat16) return cast_from<BF16>(in_dtype, in, residual, bits, count);
  if (out_dtype == DType::kFloat16) return cast_from<F16>(in_dtype, in, residual, bits, count);
}

void error_feedback_update(DType dtype, const void* in, float* residual, const float* sent, size_t count) {
  switch (dtype) {
    case DType::kFloat32: return update_typed(static_cast<const float*>(in), residual, sent, count);
    case DType::kBFloat16: return update_typed(static_cast<const BF16*>(in), residual, sent, count);
    case DType::kFloat16: return update_typed(static_cast<const F16*>(in), residual, sent, count);
    default: return;
  }
}

}  // namespace braid
