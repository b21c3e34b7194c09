// Torch binding of the host-memory optimizer steps (core/optim/step.h): every tensor is checked
// here, by name, and the elements are split over torch's intra-op threads in blocks of whole
// cache lines, each thread running the kernel on its own range.
#include <ATen/Parallel.h>

#include <optional>
#include <string>
#include <vector>

#include "../core/optim/step.h"
#include "binding_util.h"

namespace braid {
namespace {

// Elements per unit of work: large enough that a thread's share amortizes its start, a multiple
// of 16 so that no two threads write the same cache line of a float32 array.
constexpr int64_t kGrain = 1 << 16;

const std::initializer_list<at::ScalarType> kStepGradTypes = {at::kFloat, at::kBFloat16, at::kHalf};

struct Operand {
  at::Tensor t;
  const char* name;
};

// A CPU tensor (checked_contiguous) of `allowed` dtypes, with `n` elements (n < 0: takes its count).
at::Tensor operand(const py::handle& obj, const char* name, std::initializer_list<at::ScalarType> allowed,
                   int64_t n) {
  at::Tensor t = checked_contiguous(obj, name, allowed);
  TORCH_CHECK_VALUE(n < 0 || t.numel() == n, std::string(name) + " must have " + std::to_string(n) +
                                                 " elements (as param), got " + std::to_string(t.numel()));
  return t;
}

void check_apart(const std::vector<Operand>& ops) {
  for (size_t i = 0; i < ops.size(); ++i)
    for (size_t j = i + 1; j < ops.size(); ++j)
      TORCH_CHECK_VALUE(!overlaps(ops[i].t, ops[j].t),
                        std::string(ops[i].name) + " and " + ops[j].name + " must not share memory");
}

// Runs fn(begin, end) over [0, n) on torch's threads; no GIL held.
template <class Fn>
void over_threads(int64_t n, Fn fn) {
  py::gil_scoped_release nogil;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

const char* byte_ptr(const at::Tensor& t, int64_t elem) {
  return static_cast<const char*>(t.data_ptr()) + elem * static_cast<int64_t>(t.element_size());
}

void adam(py::handle param, py::handle grad, py::handle exp_avg, py::handle exp_avg_sq, py::handle max_exp_avg_sq,
          int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
          bool amsgrad, bool maximize, py::handle param_copy) {
  at::Tensor p = operand(param, "param", {at::kFloat}, -1);
  const int64_t n = p.numel();
  std::vector<Operand> ops{{p, "param"},
                           {operand(grad, "grad", kStepGradTypes, n), "grad"},
                           {operand(exp_avg, "exp_avg", {at::kFloat}, n), "exp_avg"},
                           {operand(exp_avg_sq, "exp_avg_sq", {at::kFloat}, n), "exp_avg_sq"}};
  at::Tensor vmax, copy;
  TORCH_CHECK_VALUE(amsgrad == !max_exp_avg_sq.is_none(), amsgrad ? "amsgrad needs max_exp_avg_sq"
                                                                   : "max_exp_avg_sq is only for amsgrad");
  if (amsgrad) ops.push_back({vmax = operand(max_exp_avg_sq, "max_exp_avg_sq", {at::kFloat}, n), "max_exp_avg_sq"});
  if (!param_copy.is_none()) ops.push_back({copy = operand(param_copy, "param_copy", kStepGradTypes, n), "param_copy"});
  check_apart(ops);
  AdamConstants c;
  try {
    c = adam_constants(lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, step);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  const at::Tensor g = ops[1].t, m = ops[2].t, v = ops[3].t;
  const DType gt = to_dtype(g.scalar_type(), "grad");
  const DType ct = copy.defined() ? to_dtype(copy.scalar_type(), "param_copy") : DType::kFloat32;
  over_threads(n, [&](int64_t b, int64_t e) {
    adam_step(c, p.data_ptr<float>() + b, byte_ptr(g, b), gt, m.data_ptr<float>() + b, v.data_ptr<float>() + b,
              vmax.defined() ? vmax.data_ptr<float>() + b : nullptr,
              copy.defined() ? const_cast<char*>(byte_ptr(copy, b)) : nullptr, ct, static_cast<size_t>(e - b));
  });
}

void sgd(py::handle param, py::handle grad, py::handle momentum_buffer, double lr, double momentum,
         double dampening, double weight_decay, bool nesterov, bool maximize, bool first, py::handle param_copy) {
  at::Tensor p = operand(param, "param", {at::kFloat}, -1);
  const int64_t n = p.numel();
  std::vector<Operand> ops{{p, "param"}, {operand(grad, "grad", kStepGradTypes, n), "grad"}};
  at::Tensor buf, copy;
  TORCH_CHECK_VALUE((momentum != 0) == !momentum_buffer.is_none(),
                    momentum != 0 ? "momentum needs momentum_buffer" : "momentum_buffer is only for momentum != 0");
  if (momentum != 0) ops.push_back({buf = operand(momentum_buffer, "momentum_buffer", {at::kFloat}, n), "momentum_buffer"});
  if (!param_copy.is_none()) ops.push_back({copy = operand(param_copy, "param_copy", kStepGradTypes, n), "param_copy"});
  check_apart(ops);
  SgdConstants c;
  try {
    c = sgd_constants(lr, momentum, dampening, weight_decay, nesterov, maximize, first);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  const at::Tensor g = ops[1].t;
  const DType gt = to_dtype(g.scalar_type(), "grad");
  const DType ct = copy.defined() ? to_dtype(copy.scalar_type(), "param_copy") : DType::kFloat32;
  over_threads(n, [&](int64_t b, int64_t e) {
    sgd_step(c, p.data_ptr<float>() + b, byte_ptr(g, b), gt, buf.defined() ? buf.data_ptr<float>() + b : nullptr,
             copy.defined() ? const_cast<char*>(byte_ptr(copy, b)) : nullptr, ct, static_cast<size_t>(e - b));
  });
}

}  // namespace

void bind_optim(py::module_& m) {
  m.def("adam_step", &adam, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("max_exp_avg_sq") = py::none(), py::kw_only(), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"), py::arg("amsgrad"),
        py::arg("maximize"), py::arg("param_copy") = py::none(),
        "One Adam (decoupled=False) or AdamW (True) step over flat float32 CPU tensors, in place: "
        "core/optim/step.h gives the arithmetic. grad and param_copy: float32, bfloat16 or float16.");
  m.def("sgd_step", &sgd, py::arg("param"), py::arg("grad"), py::arg("momentum_buffer") = py::none(), py::kw_only(),
        py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"),
        py::arg("maximize"), py::arg("first"), py::arg("param_copy") = py::none(),
        "One SGD step (with momentum when momentum != 0) over flat float32 CPU tensors, in place.");
}

}  // namespace braid
