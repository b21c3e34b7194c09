// Optimizer steps over flat float32 arrays (step.h). Each kernel walks the elements in blocks
// that stay in the L1 cache: the gradient block is read (and widened) once into float32, then a
// few simple loops over the block, each of which the compiler vectorizes, update the state; the
// memory sees one pass. The sqrt of the denominator vectorizes because the build drops errno
// semantics (-fno-math-errno, csrc/flags.txt).

#include "step.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../half.h"

namespace braid {
namespace {

constexpr size_t kBlock = 512;  // elements per block: 2 KiB of each float32 array

void check_grad_type(DType t, const char* what) {
  if (t != DType::kFloat32 && t != DType::kBFloat16 && t != DType::kFloat16)
    throw std::invalid_argument(std::string(what) + " must be float32, bfloat16 or float16");
}

// Reads `len` gradient elements of type `grad_type` from `grad` + `off` as float32 into `g`.
void load_grad(const void* grad, DType grad_type, size_t off, size_t len, float* __restrict g) {
  if (grad_type == DType::kFloat32) {
    const float* __restrict src = static_cast<const float*>(grad) + off;
    for (size_t i = 0; i < len; ++i) g[i] = src[i];
  } else if (grad_type == DType::kBFloat16) {
    widen_n<BF16>(static_cast<const uint16_t*>(grad) + off, g, len);
  } else {
    widen_n<F16>(static_cast<const uint16_t*>(grad) + off, g, len);
  }
}

void store_copy(void* copy, DType copy_type, size_t off, size_t len, const float* __restrict p) {
  if (copy == nullptr) return;
  if (copy_type == DType::kFloat32) {
    float* __restrict dst = static_cast<float*>(copy) + off;
    for (size_t i = 0; i < len; ++i) dst[i] = p[i];
  } else if (copy_type == DType::kBFloat16) {
    narrow_n<BF16>(p, static_cast<uint16_t*>(copy) + off, len);
  } else {
    narrow_n<F16>(p, static_cast<uint16_t*>(copy) + off, len);
  }
}

void check_range(double v, double lo, bool lo_open, double hi, bool hi_open, const char* name) {
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (!ok)
    throw std::invalid_argument(std::string(name) + " must be in " + (lo_open ? "(" : "[") +
                                std::to_string(lo) + ", " + (std::isinf(hi) ? std::string("inf") : std::to_string(hi)) +
                                (hi_open ? ")" : "]") + ", got " + std::to_string(v));
}

}  // namespace

AdamConstants adam_constants(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                             bool amsgrad, bool maximize, int64_t step) {
  const double inf = INFINITY;
  check_range(lr, 0, false, inf, true, "lr");
  check_range(beta1, 0, false, 1, true, "beta1 (betas[0])");
  check_range(beta2, 0, false, 1, true, "beta2 (betas[1])");
  check_range(eps, 0, false, inf, true, "eps");
  check_range(weight_decay, 0, false, inf, true, "weight_decay");
  if (step < 1) throw std::invalid_argument("step must be >= 1 (the first step is 1), got " + std::to_string(step));
  AdamConstants c{};
  const double s = static_cast<double>(step);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.wd = static_cast<float>(weight_decay);
  c.w1 = static_cast<float>(1.0 - beta1);
  c.b2 = static_cast<float>(beta2);
  c.w2 = static_cast<float>(1.0 - beta2);
  c.inv_bc2 = 1.0f / static_cast<float>(std::sqrt(1.0 - std::pow(beta2, s)));
  c.neg_step = static_cast<float>(-(lr / (1.0 - std::pow(beta1, s))));
  c.eps = static_cast<float>(eps);
  c.decoupled = decoupled;
  c.amsgrad = amsgrad;
  c.maximize = maximize;
  c.has_wd = weight_decay != 0.0;
  return c;
}

void adam_step(const AdamConstants& c, float* param, const void* grad, DType grad_type, float* exp_avg,
               float* exp_avg_sq, float* max_exp_avg_sq, void* copy, DType copy_type, size_t n) {
  check_grad_type(grad_type, "the gradient");
  if (copy != nullptr) check_grad_type(copy_type, "the parameter copy");
  if (c.amsgrad && max_exp_avg_sq == nullptr) throw std::invalid_argument("amsgrad needs max_exp_avg_sq");
  alignas(64) float g[kBlock];
  const float decay = c.decay, wd = c.wd, w1 = c.w1, b2 = c.b2, w2 = c.w2, inv_bc2 = c.inv_bc2, ns = c.neg_step,
              eps = c.eps;
  const bool direct = grad_type == DType::kFloat32 && !c.maximize && !(c.has_wd && !c.decoupled);
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t len = std::min(kBlock, n - off);
    float* __restrict p = param + off;
    float* __restrict m = exp_avg + off;
    float* __restrict v = exp_avg_sq + off;
    // A float32 gradient used as it is is read in place; any other goes through the block buffer.
    const float* __restrict gr = g;
    if (direct) {
      gr = static_cast<const float*>(grad) + off;
    } else {
      load_grad(grad, grad_type, off, len, g);
      if (c.maximize)
        for (size_t i = 0; i < len; ++i) g[i] = -g[i];
      if (c.has_wd && !c.decoupled)
        for (size_t i = 0; i < len; ++i) g[i] = g[i] + wd * p[i];
    }
    // The common case in one loop (each array loaded and stored once per element); AMSGrad
    // through the running maximum first.
    const float scale = c.has_wd && c.decoupled ? decay : 1.0f;  // p * 1.0f is p, exactly
    if (!c.amsgrad) {
      for (size_t i = 0; i < len; ++i) {
        const float mi = m[i] + w1 * (gr[i] - m[i]);
        const float vi = v[i] * b2 + (w2 * gr[i]) * gr[i];
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * scale + ns * (mi / (std::sqrt(vi) * inv_bc2 + eps));
      }
    } else {
      float* __restrict vmax = max_exp_avg_sq + off;
      for (size_t i = 0; i < len; ++i) {
        const float mi = m[i] + w1 * (gr[i] - m[i]);
        const float vi = v[i] * b2 + (w2 * gr[i]) * gr[i];
        const float ui = vi > vmax[i] ? vi : vmax[i];
        m[i] = mi;
        v[i] = vi;
        vmax[i] = ui;
        p[i] = p[i] * scale + ns * (mi / (std::sqrt(ui) * inv_bc2 + eps));
      }
    }
    store_copy(copy, copy_type, off, len, p);
  }
}

SgdConstants sgd_constants(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                           bool maximize, bool first) {
  const double inf = INFINITY;
  check_range(lr, 0, false, inf, true, "lr");
  check_range(momentum, 0, false, inf, true, "momentum");
  check_range(dampening, -inf, false, inf, true, "dampening");
  check_range(weight_decay, 0, false, inf, true, "weight_decay");
  if (nesterov && (momentum <= 0 || dampening != 0))
    throw std::invalid_argument("nesterov momentum needs momentum > 0 and dampening = 0");
  SgdConstants c{};
  c.neg_lr = static_cast<float>(-lr);
  c.momentum = static_cast<float>(momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - dampening);
  c.wd = static_cast<float>(weight_decay);
  c.nesterov = nesterov;
  c.maximize = maximize;
  c.first = first;
  return c;
}

void sgd_step(const SgdConstants& c, float* param, const void* grad, DType grad_type, float* momentum_buffer,
              void* copy, DType copy_type, size_t n) {
  check_grad_type(grad_type, "the gradient");
  if (copy != nullptr) check_grad_type(copy_type, "the parameter copy");
  const bool with_momentum = c.momentum != 0.0f;
  if (with_momentum && momentum_buffer == nullptr) throw std::invalid_argument("momentum needs a momentum buffer");
  alignas(64) float g[kBlock];
  const float nl = c.neg_lr, mu = c.momentum, od = c.one_minus_dampening, wd = c.wd;
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t len = std::min(kBlock, n - off);
    float* __restrict p = param + off;
    load_grad(grad, grad_type, off, len, g);
    if (c.maximize)
      for (size_t i = 0; i < len; ++i) g[i] = -g[i];
    if (wd != 0.0f)
      for (size_t i = 0; i < len; ++i) g[i] = g[i] + wd * p[i];
    if (with_momentum) {
      float* __restrict b = momentum_buffer + off;
      if (c.first) {
        for (size_t i = 0; i < len; ++i) b[i] = g[i];
      } else {
        for (size_t i = 0; i < len; ++i) b[i] = b[i] * mu + od * g[i];
      }
      if (c.nesterov) {
        for (size_t i = 0; i < len; ++i) g[i] = g[i] + mu * b[i];
      } else {
        for (size_t i = 0; i < len; ++i) g[i] = b[i];
      }
    }
    for (size_t i = 0; i < len; ++i) p[i] = p[i] + nl * g[i];
    store_copy(copy, copy_type, off, len, p);
  }
}

}  // namespace braid
