// The error-feedback update, one streaming pass per dtype.
#include "error_feedback.h"

#include "../half.h"

namespace braid {
namespace {

template <class T>
void update_typed(const T* __restrict in, float* __restrict residual, const float* __restrict sent, size_t count) {
  if (sent != nullptr) {
    for (size_t i = 0; i < count; ++i) residual[i] = (load_f32(in[i]) + residual[i]) - sent[i];
  } else {
    for (size_t i = 0; i < count; ++i) residual[i] = load_f32(in[i]) + residual[i];
  }
}

template <class In, class Out>
void cast_typed(const In* __restrict in, float* __restrict residual, Out* __restrict out, size_t count) {
  if (residual != nullptr) {
    for (size_t i = 0; i < count; ++i) {
      const float x = load_f32(in[i]) + residual[i];
      const Out s = store_from_f32<Out>(x);
      out[i] = s;
      residual[i] = x - load_f32(s);
    }
  } else {
    for (size_t i = 0; i < count; ++i) out[i] = store_from_f32<Out>(load_f32(in[i]));
  }
}

template <class Out>
void cast_from(DType in_dtype, const void* in, float* residual, Out* out, size_t count) {
  switch (in_dtype) {
    case DType::kFloat32: return cast_typed(static_cast<const float*>(in), residual, out, count);
    case DType::kBFloat16: return cast_typed(static_cast<const BF16*>(in), residual, out, count);
    case DType::kFloat16: return cast_typed(static_cast<const F16*>(in), residual, out, count);
    default: return;
  }
}

}  // namespace

void cast_with_feedback(DType in_dtype, const void* in, float* residual, DType out_dtype, void* out, size_t count) {
  if (out_dtype == DType::kBFloat16) return cast_from(in_dtype, in, residual, static_cast<BF16*>(out), count);
  if (out_dtype == DType::kFloat16) return cast_from(in_dtype, in, residual, static_cast<F16*>(out), count);
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
