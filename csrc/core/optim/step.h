// Optimizer steps over flat float32 arrays in host memory (ZeRO-Offload's CPU step, and
// braid.optim on CPU parameters): Adam / AdamW and SGD with momentum, one pass over the memory per
// step, reading float32, bfloat16 or float16 gradients and writing, beside the float32 parameter,
// its bfloat16 / float16 copy when asked. Torch-free: the binding checks every argument and
// splits the arrays over threads; a kernel runs on any contiguous sub-range of the elements.
//
// Rounding: every element takes the same sequence of float32 operations, each rounded once (no
// fused multiply-add: -ffp-contract=off), whether the compiler vectorized the loop or not, so
// the results equal the scalar reference in the comments bit for bit (tests/test_optim.py holds
// that reference in torch). Torch's own optimizers differ from it by rounding only (torch's lerp
// and add with alpha use fused multiply-adds where the CPU has them).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../dtype.h"

namespace braid {

// The float32 constants of one Adam step, computed in double from the hyperparameters and the
// step number (1 for the first step), then rounded once, as torch rounds a Python scalar
// to a float32 tensor's type:
//   decay      = 1 - lr * weight_decay          (AdamW: the parameter shrinks first)
//   wd         = weight_decay                   (Adam: the gradient takes wd * parameter)
//   w1         = 1 - beta1,  b2 = beta2,  w2 = 1 - beta2
//   inv_bc2    = 1 / float32(sqrt(1 - beta2^step))   (the reciprocal in float32, as torch divides
//                by a scalar: it multiplies by the scalar's float32 reciprocal)
//   neg_step   = -lr / (1 - beta1^step)
//   eps        = eps
struct AdamConstants {
  float decay, wd, w1, b2, w2, inv_bc2, neg_step, eps;
  bool decoupled;  // AdamW's decay of the parameter (true) or Adam's L2 term in the gradient
  bool amsgrad;    // the denominator uses the running maximum of exp_avg_sq
  bool maximize;   // ascend: the gradient's sign flips first
  bool has_wd;     // weight_decay != 0
};
// Throws std::invalid_argument naming the first hyperparameter out of range (lr >= 0,
// 0 <= beta < 1, eps >= 0, weight_decay >= 0, step >= 1).
AdamConstants adam_constants(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                             bool amsgrad, bool maximize, int64_t step);

// Per element i, in float32 (g the gradient read as float32):
//   if maximize:              g = -g
//   if has_wd and !decoupled: g = g + wd * p
//   if has_wd and decoupled:  p = p * decay
//   m = m + w1 * (g - m)
//   v = v * b2 + (w2 * g) * g
//   if amsgrad:               vmax = (v > vmax) ? v : vmax;  u = vmax, else u = v
//   p = p + neg_step * (m / (sqrt(u) * inv_bc2 + eps))
//   copy = p rounded to nearest even in copy_type (when copy is not null)
// `grad_type` and `copy_type`: kFloat32, kBFloat16 or kFloat16. `max_exp_avg_sq` only with
// amsgrad. No pointer may alias another.
void adam_step(const AdamConstants& c, float* param, const void* grad, DType grad_type, float* exp_avg,
               float* exp_avg_sq, float* max_exp_avg_sq, void* copy, DType copy_type, size_t n);

// SGD with momentum, per element (lr, momentum, dampening, weight_decay rounded to float32 once):
//   if maximize:  g = -g
//   if wd != 0:   g = g + wd * p
//   if momentum != 0:
//     buf = first ? g : buf * momentum + (1 - dampening) * g
//     g   = nesterov ? g + momentum * buf : buf
//   p = p + (-lr) * g;  copy as adam_step's
struct SgdConstants {
  float neg_lr, momentum, one_minus_dampening, wd;
  bool nesterov, maximize, first;  // first: the momentum buffer starts as the gradient
};
SgdConstants sgd_constants(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                           bool maximize, bool first);
void sgd_step(const SgdConstants& c, float* param, const void* grad, DType grad_type, float* momentum_buffer,
              void* copy, DType copy_type, size_t n);

}  // namespace braid
