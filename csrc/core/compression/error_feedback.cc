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

}  // namespace

void error_feedback_update(DType dtype, const void* in, float* residual, const float* sent, size_t count) {
  switch (dtype) {
    case DType::kFloat32: return update_typed(static_cast<const float*>(in), residual, sent, count);
    case DType::kBFloat16: return update_typed(static_cast<const BF16*>(in), residual, sent, count);
    case DType::kFloat16: return update_typed(static_cast<const F16*>(in), residual, sent, count);
    default: return;
  }
}

}  // namespace braid
