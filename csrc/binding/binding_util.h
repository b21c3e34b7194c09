// Helpers shared by the binding files (the Python module's and the torch.distributed backend's):
// the one translation of torch's dtypes and reduce ops into the core's, tensor argument checks
// that name the argument, staging of non-contiguous tensors, torch futures completed by core work,
// and the Python handle of async work.
#pragma once

// Only the headers used: torch's umbrella headers (ATen/ATen.h, torch/python.h) cost each binding
// file about 16 s of compile time more than these.
#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../core/communicator.h"
#include "../core/compression/quantize.h"
#include "../core/dtype.h"
#include "../core/work.h"

namespace braid {

namespace py = pybind11;

constexpr const char* kSupportedDTypes = "float32, float64, float16, bfloat16, int32, int64 and uint8";

// The core's element type of a torch dtype, or nothing when the core has none.
inline std::optional<DType> dtype_from(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    default: return std::nullopt;
  }
}

// The core's dtype of a tensor that `arg` names (in c10d's call `call`, when given), or a TypeError.
// The message is built only on failure: this runs on every call.
inline DType to_dtype(at::ScalarType t, const char* arg, const char* call = nullptr) {
  if (auto d = dtype_from(t)) return *d;
  C10_THROW_ERROR(TypeError, c10::str(call ? "braid " : "", call ? call : "", call ? ": " : "", arg,
                                      " has unsupported dtype ", t, "; braid supports ", kSupportedDTypes));
}

// The core's reduce op of a torch.distributed one, or nothing when the core has none. PREMUL_SUM
// is none: the backend sums copies that it scaled itself (backend.cpp's premul_scaled).
inline std::optional<ReduceOp> reduce_op_from(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case c10d::ReduceOp::MAX: return ReduceOp::kMax;
    case c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case c10d::ReduceOp::PRODUCT: return ReduceOp::kProd;
    case c10d::ReduceOp::BAND: return ReduceOp::kBand;
    case c10d::ReduceOp::BOR: return ReduceOp::kBor;
    case c10d::ReduceOp::BXOR: return ReduceOp::kBxor;
    default: return std::nullopt;
  }
}

// Whether two tensors' memory ranges intersect (empty tensors intersect nothing).
inline bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto* a0 = static_cast<const char*>(a.data_ptr());
  auto* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// Completes `fut` with the outcome of the finished `done`: `outputs` on success, braid's error
// class and message (as the text of a RuntimeError) on failure.
inline void settle(const Work& done, c10::ivalue::Future& fut, const std::vector<at::Tensor>& outputs) {
  if (done.succeeded()) {
    fut.markCompleted(c10::IValue(c10::List<at::Tensor>(outputs)));
  } else {
    const char* cls = error_class_name(done.error_kind());
    fut.setError(std::make_exception_ptr(std::runtime_error(std::string(cls) + ": " + done.error_message())));
  }
}

// Completes `fut` when `w` does (see settle). Runs on the completing thread.
inline void complete_with(Work& w, c10::intrusive_ptr<c10::ivalue::Future> fut, std::vector<at::Tensor> outputs) {
  w.on_complete([fut = std::move(fut), outputs = std::move(outputs)](const Work& done) { settle(done, *fut, outputs); });
}

// A torch future of `outputs` that `w` completes (see complete_with).
inline c10::intrusive_ptr<c10::ivalue::Future> future_of(Work& w, std::vector<at::Tensor> outputs) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  complete_with(w, fut, std::move(outputs));
  return fut;
}

inline ReduceOp to_op(int op) {
  TORCH_CHECK_VALUE(!(op < 0 || op >= kNumReduceOps), "op code out of range: " + std::to_string(op));
  return static_cast<ReduceOp>(op);
}

// That `r` applies to elements of `dtype`, which `arg` holds (in c10d's call `call`, when given):
// bitwise ops need an integer dtype. The message is built only on failure.
inline void check_op_dtype(ReduceOp r, DType dtype, const char* arg, const char* call = nullptr) {
  TORCH_CHECK_VALUE(op_supports(r, dtype), "op '", reduce_op_name(r), "' needs an integer tensor (int32, int64, uint8); ",
                    call ? "braid " : "", call ? call : "", call ? ": " : "", arg, " has dtype ", dtype_name(dtype));
}

// `op` for elements of `dtype`, which `arg` holds.
inline ReduceOp to_op(int op, DType dtype, const char* arg) {
  const ReduceOp r = to_op(op);
  check_op_dtype(r, dtype, arg);
  return r;
}

// A dense tensor argument on any device (a collective's: collective_device() checks where its
// tensors are); `arg` names it in errors.
// The tensor `obj` holds, into `out`; false when it is no torch.Tensor. Through the pybind caster
// torch defines in libtorch_python (python_variable.h's inline checks would cost each binding file
// about 10 s of compile time).
inline bool unpack_tensor(const py::handle& obj, at::Tensor& out) {
  py::detail::make_caster<at::Tensor> caster;
  if (!caster.load(obj, /*convert=*/false)) return false;
  out = py::detail::cast_op<at::Tensor>(std::move(caster));
  return true;
}

inline at::Tensor dense_tensor(const py::handle& obj, const char* arg) {
  at::Tensor t;
  TORCH_CHECK_TYPE(unpack_tensor(obj, t),
                   std::string(arg) + " must be a torch.Tensor, got " +
                   std::string(py::str(py::type::of(obj).attr("__name__"))));
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, std::string(arg) + " must be a dense (strided) tensor");
  return t;
}

// A dense CPU tensor argument (calls that take CPU tensors only).
inline at::Tensor as_tensor(const py::handle& obj, const char* arg) {
  at::Tensor t = dense_tensor(obj, arg);
  TORCH_CHECK_VALUE(t.device().is_cpu(),
                    std::string(arg) + " must be a CPU tensor, got a tensor on " + t.device().str());
  return t;
}

// A collective's tensor argument and its name.
struct NamedTensor {
  const at::Tensor* tensor;
  const char* arg;
};

// Where a collective's tensors are, checked: the CPU, or (in a build with CUDA) one CUDA device,
// that of the first tensor off the CPU (the output's before the input's), which every other
// tensor must then be on. Errors name the argument and its device. The device decides the path:
// the core works on CPU tensors in place; CUDA tensors travel through the staging pipeline
// (dispatch_cuda).
inline c10::Device collective_device(std::initializer_list<NamedTensor> tensors) {
  const NamedTensor* off = nullptr;
  for (const NamedTensor& t : tensors)
    if (!t.tensor->device().is_cpu()) {
      off = &t;
      break;
    }
  if (off == nullptr) return c10::Device(c10::kCPU);
  const c10::Device d = off->tensor->device();
#ifdef BRAID_WITH_CUDA
  TORCH_CHECK_VALUE(d.is_cuda(), off->arg, " must be a CPU or CUDA tensor, got a tensor on ", d.str());
  for (const NamedTensor& t : tensors)
    TORCH_CHECK_VALUE(t.tensor->device() == d, t.arg, " must be on ", d.str(), " (the other tensors' device), got ",
                      t.tensor->device().str());
  return d;
#else
  TORCH_CHECK_VALUE(false, off->arg, " is on ", d.str(),
                    ", but this braid build takes CPU tensors only (it was built where torch had no CUDA or nvcc "
                    "was not found): reinstall braid on a machine with both, or move the tensor to the CPU");
  return d;
#endif
}

// A tensor and the contiguous memory the core works on: the tensor itself when it is contiguous,
// else a copy, whose results are copied back into the tensor afterwards (when copy_back()).
struct Contiguous {
  at::Tensor user;     // what the caller passed
  at::Tensor buffer;   // contiguous memory the core works on (== user when contiguous)
  bool copy_back() const { return !buffer.is_same(user); }
};

// `t` as contiguous memory, unchecked (an input; outputs go through contiguous_output()).
inline Contiguous as_contiguous(const at::Tensor& t) { return Contiguous{t, t.is_contiguous() ? t : t.contiguous()}; }

// Outputs are written through a contiguous buffer; one whose elements share memory (expand())
// cannot hold distinct results.
inline Contiguous contiguous_output(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes,
                    std::string(arg) +
                    " has elements that share memory (e.g. from expand()); pass a tensor with distinct elements");
  return as_contiguous(t);
}

// reduce_scatter and all_gather pair a "whole" tensor (world_size * n elements) with a "part" (n).
inline void check_whole_and_part(const at::Tensor& out, const at::Tensor& in, const at::Tensor& whole,
                                 const char* whole_name, const at::Tensor& part, const char* part_name, int64_t world_size) {
  TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(),
                   "output and input must have the same dtype, got " + std::string(c10::toString(out.scalar_type())) +
                   " and " + c10::toString(in.scalar_type()));
  TORCH_CHECK_VALUE(whole.numel() == world_size * part.numel(),
                    std::string(whole_name) + ".numel() must be world_size * " + part_name + ".numel() (" +
                    std::to_string(world_size) + " * " + std::to_string(part.numel()) + "), got " +
                    std::to_string(whole.numel()));
}

// The buffers may overlap only NCCL-style in place: `part` exactly the rank's slice of `whole`.
inline void check_aliasing(const at::Tensor& whole, const char* whole_name, const at::Tensor& part,
                           const char* part_name, int rank) {
  const bool in_place = whole.numel() > 0 && part.numel() > 0 &&
                        part.data_ptr() == static_cast<char*>(whole.data_ptr()) + rank * part.nbytes();
  TORCH_CHECK_VALUE(!(!in_place && overlaps(whole, part)),
                    "output overlaps input; the only overlap allowed is " + std::string(part_name) + " being " +
                    whole_name + "'s own slice (rank * " + part_name + ".numel())");
}

// all_to_all with equal splits: same dtype and size, a multiple of world_size, never in place.
inline void check_all_to_all(const at::Tensor& out, const at::Tensor& in, int world_size) {
  TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(),
                   "output and input must have the same dtype, got " + std::string(c10::toString(out.scalar_type())) +
                   " and " + c10::toString(in.scalar_type()));
  TORCH_CHECK_VALUE(out.numel() == in.numel(),
                    "output.numel() must equal input.numel(), got " + std::to_string(out.numel()) + " and " +
                    std::to_string(in.numel()));
  TORCH_CHECK_VALUE(in.numel() % world_size == 0,
                    "input.numel() must be a multiple of world_size (" + std::to_string(world_size) + "), got " +
                    std::to_string(in.numel()));
  TORCH_CHECK_VALUE(!overlaps(out, in), "output must not overlap input (all_to_all is never in place)");
}

// Runs f with the GIL released when this thread holds it. Closing a communicator joins its
// progress thread, and that thread may need the GIL to finish the work in flight (a Python callback
// chained on a future, the last reference to a tensor whose Python object it keeps alive): a close
// reached from a Python deallocation (the GIL held) would wait for it for ever.
template <class F>
void without_gil(F&& f) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release nogil;
    f();
  } else {
    f();
  }
}

// A Communicator owned from Python: its last reference may go in a deallocation, with the GIL
// held, and destroying it closes it.
inline std::shared_ptr<Communicator> python_owned(Communicator* c) {
  return std::shared_ptr<Communicator>(c, [](Communicator* p) { without_gil([p] { delete p; }); });
}

// The Python handle (`_C.Work`, wrapped by comm/core/work.py's Work) of an async collective on host
// memory; CudaWork (cuda_comm_binding.cpp) is its counterpart for CUDA tensors.
class HostWork {
 public:
  // `also`: a second work this one completes with (the send of a send_recv, whose receive is `w`).
  HostWork(std::shared_ptr<Work> w, std::vector<at::Tensor> outputs, std::shared_ptr<Work> also = nullptr)
      : work_(std::move(w)), also_(std::move(also)), outputs_(std::move(outputs)) {}

  bool wait(py::object timeout) {
    std::chrono::nanoseconds ns{0};
    if (!timeout.is_none()) {
      double s = timeout.cast<double>();
      TORCH_CHECK_VALUE(s > 0, "timeout must be positive seconds or None");
      s = std::min(s, kMaxTimeoutSeconds);
      ns = std::chrono::nanoseconds(std::max<int64_t>(1, static_cast<int64_t>(s * 1e9)));
    }
    if (is_completed()) {  // done on the posting thread (most small transfers): no GIL round trip
      if (also_) also_->wait(ns, false);
      return work_->wait(ns, false);  // both raise a failure's error
    }
    py::gil_scoped_release nogil;
    if (also_ && !also_->wait(ns, /*interruptible=*/true)) return false;
    return work_->wait(ns, /*interruptible=*/true);
  }
  bool is_completed() const { return work_->is_completed() && (!also_ || also_->is_completed()); }
  bool is_success() const { return work_->succeeded() && (!also_ || also_->succeeded()); }
  py::object exception_message() const {
    for (const Work* w : {also_.get(), work_.get()})
      if (w != nullptr && w->is_completed() && !w->succeeded()) return py::str(w->error_message());
    return py::none();
  }
  // Seconds on the steady clock (time.perf_counter()'s on Linux) when it completed, or None.
  py::object completed_at() const {
    auto at = work_->completed_at();
    if (at && also_) {
      const auto other = also_->completed_at();
      at = other ? std::max(*at, *other) : other;
    }
    if (!at) return py::none();
    return py::float_(std::chrono::duration<double>(at->time_since_epoch()).count());
  }

  c10::intrusive_ptr<c10::ivalue::Future> future() {
    work_->check_same_process();  // in a forked child nothing would ever complete the future
    if (!future_) {
      if (!also_) {
        future_ = future_of(*work_, outputs_);
      } else {  // completed by the second of the two, or failed by the first that fails
        future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
        also_->on_complete([w = work_, fut = future_, outputs = outputs_](const Work& first) {
          if (!first.succeeded()) {
            settle(first, *fut, outputs);
            return;
          }
          complete_with(*w, fut, outputs);
        });
      }
    }
    return future_;
  }

 private:
  std::shared_ptr<Work> work_;
  std::shared_ptr<Work> also_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};


// A contiguous tensor of one of `allowed` dtypes, on the CPU; `arg` names it in errors.
inline at::Tensor checked_contiguous(const py::handle& obj, const char* arg, std::initializer_list<at::ScalarType> allowed) {
  at::Tensor t = as_tensor(obj, arg);
  bool ok = false;
  std::string names;
  for (auto a : allowed) {
    ok = ok || t.scalar_type() == a;
    names += (names.empty() ? "" : ", ") + std::string(c10::toString(a));
  }
  TORCH_CHECK_TYPE(ok, std::string(arg) + " must have dtype " + names + ", got " + c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.is_contiguous(), std::string(arg) + " must be contiguous");
  return t;
}

// The quantization format of (bits, block), validated.
inline QuantFormat checked_format(int bits, int64_t block) {
  TORCH_CHECK_VALUE(!(bits != 8 && bits != 4), "bits must be 8 or 4, got " + std::to_string(bits));
  TORCH_CHECK_VALUE(!(block < 1 || block > static_cast<int64_t>(kMaxQuantBlock)),
                    "block must be in [1, " + std::to_string(kMaxQuantBlock) + "], got " + std::to_string(block));
  TORCH_CHECK_VALUE(!(bits == 4 && block % 2 != 0),
                    "block must be even for 4-bit quantization (two values per byte), got " + std::to_string(block));
  return QuantFormat{bits, static_cast<size_t>(block)};
}

// nchunks * fmt.bytes(chunk), the size of a chunked payload, or a ValueError when it would not fit
// in an int64 (a chunk far larger than the input, or too many of them: the byte count would wrap
// and the kernels would write past a small buffer).
inline size_t checked_payload_bytes(QuantFormat fmt, size_t chunk, size_t nchunks) {
  constexpr size_t kMax = static_cast<size_t>(INT64_MAX);
  // bytes(chunk) <= chunk + 3 + 4 * (chunk / block + 1) <= 5 * chunk + 7: bound chunk first.
  TORCH_CHECK_VALUE(!(chunk > (kMax - 7) / 5 || (nchunks != 0 && fmt.bytes(chunk) > kMax / nchunks)),
                    "chunk (" + std::to_string(chunk) + ") times nchunks (" + std::to_string(nchunks) +
                    ") is too large: the payload would exceed 2^63 bytes");
  return nchunks * fmt.bytes(chunk);
}

// `chunk` 0 means one chunk of the whole input (the plain layout).
inline size_t checked_chunk(int64_t chunk, int64_t nchunks, size_t count, QuantFormat fmt) {
  if (chunk == 0) {
    TORCH_CHECK_VALUE(nchunks == 1, "nchunks must be 1 when chunk is 0 (one chunk of the whole input)");
    return count;
  }
  TORCH_CHECK_VALUE(!(chunk < 0 || chunk % static_cast<int64_t>(fmt.block) != 0),
                    "chunk must be a positive multiple of block (" + std::to_string(fmt.block) + "), got " +
                    std::to_string(chunk));
  TORCH_CHECK_VALUE(!(nchunks < 1 || static_cast<size_t>(nchunks) < (count + static_cast<size_t>(chunk) - 1) / chunk),
                    "nchunks * chunk must cover the " + std::to_string(count) + " elements, got " +
                    std::to_string(nchunks) + " * " + std::to_string(chunk));
  checked_payload_bytes(fmt, static_cast<size_t>(chunk), static_cast<size_t>(nchunks));
  return static_cast<size_t>(chunk);
}

// Split sizes of dimension 0 per rank, as torch.distributed.all_to_all_single takes them:
// `splits` checked, or equal splits when it is null. Messages start with `where`.
inline std::vector<int64_t> checked_row_splits(const std::vector<int64_t>* splits, int64_t rows, int world,
                                               const char* arg, const char* tensor_arg, const char* where) {
  if (splits == nullptr) {
    TORCH_CHECK_VALUE(rows % world == 0, where, tensor_arg, ".size(0) (", rows, ") must be a multiple of world_size (",
                      world, ") when ", arg, " is not given");
    return std::vector<int64_t>(static_cast<size_t>(world), rows / world);
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits->size()) == world, where, arg, " must have world_size (", world,
                    ") entries, got ", splits->size());
  // Summed without overflow: every entry is checked against what is left of `rows` (a sum that
  // wrapped around to `rows` would pass the final check and send from past the tensor's end).
  int64_t sum = 0;
  for (int64_t v : *splits) {
    TORCH_CHECK_VALUE(v >= 0, where, arg, " must not be negative, got ", v);
    TORCH_CHECK_VALUE(v <= rows - sum, where, arg, " must sum to ", tensor_arg, ".size(0) (", rows,
                      "), but its entries exceed it");
    sum += v;
  }
  TORCH_CHECK_VALUE(sum == rows, where, arg, " must sum to ", tensor_arg, ".size(0) (", rows, "), got ", sum);
  return *splits;
}

// The element counts of an all-to-all with split sizes of dimension 0 (null: equal splits):
// this rank sends `send[j]` elements of `in` to rank j and receives `recv[j]` from rank j.
// Checks dtypes, shapes, the split lists and this rank's own piece (it must keep what it sends
// itself); messages start with `where`.
struct SplitCounts {
  std::vector<int64_t> send, recv;
};

inline SplitCounts checked_split_counts(const at::Tensor& out, const at::Tensor& in,
                                        const std::vector<int64_t>* out_splits,
                                        const std::vector<int64_t>* in_splits, int rank, int world, const char* where) {
  TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), where, "output and input must have the same dtype, got ",
                   out.scalar_type(), " and ", in.scalar_type());
  TORCH_CHECK_VALUE(out.dim() > 0 && in.dim() > 0, where,
                    "output and input need a dimension 0 to split (got a 0-d tensor)");
  const int64_t row = c10::multiply_integers(in.sizes().slice(1));
  const int64_t out_row = c10::multiply_integers(out.sizes().slice(1));
  TORCH_CHECK_VALUE(out_row == row, where, "output and input rows must have the same number of elements (the product "
                    "of the dimensions after the first), got ", out_row, " and ", row);
  SplitCounts c{checked_row_splits(in_splits, in.size(0), world, "input_split_sizes", "input", where),
                checked_row_splits(out_splits, out.size(0), world, "output_split_sizes", "output", where)};
  TORCH_CHECK_VALUE(c.send[rank] == c.recv[rank], where, "input_split_sizes[rank] (", c.send[rank],
                    ") must equal output_split_sizes[rank] (", c.recv[rank], "): it is the piece this rank keeps");
  for (auto& v : c.send) v *= row;
  for (auto& v : c.recv) v *= row;
  return c;
}

// The transfers of an all-to-all with split sizes over contiguous buffers, for
// Communicator::submit_exchange: `counts.send[j]` elements (consecutive in `in`, in rank order) to
// rank j, `counts.recv[j]` from rank j (consecutive in `out`). This rank's own piece is not a
// transfer: `epilogue` copies it, then copies `out` into `user` when that is another tensor (a
// non-contiguous output written through its contiguous copy `out`).
struct ExchangePlan {
  std::vector<Request> requests;
  std::function<void()> epilogue;
};

inline ExchangePlan plan_uneven_all_to_all(int rank, int world, DType dtype, const at::Tensor& in, const at::Tensor& out,
                                           const at::Tensor& user, const SplitCounts& counts) {
  const size_t es = dtype_size(dtype);
  std::vector<size_t> send_off(world + 1, 0), recv_off(world + 1, 0);
  for (int j = 0; j < world; ++j) {
    send_off[j + 1] = send_off[j] + static_cast<size_t>(counts.send[j]) * es;
    recv_off[j + 1] = recv_off[j] + static_cast<size_t>(counts.recv[j]) * es;
  }
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  ExchangePlan plan;
  for (int step = 1; step < world; ++step) {  // the peers in ring order from this rank
    const int to = (rank + step) % world;
    const int from = (rank - step + world) % world;
    Request s = make_request(CollKind::kSend, dtype, static_cast<size_t>(counts.send[to]), src + send_off[to]);
    s.peer = to;
    plan.requests.push_back(std::move(s));
    Request r = make_request(CollKind::kRecv, dtype, static_cast<size_t>(counts.recv[from]), nullptr,
                             dst + recv_off[from]);
    r.peer = from;
    plan.requests.push_back(std::move(r));
  }
  const char* own = src + send_off[rank];
  char* kept = dst + recv_off[rank];
  const size_t bytes = send_off[rank + 1] - send_off[rank];
  const bool copied = !out.is_same(user);
  plan.epilogue = [own, kept, bytes, copied, out, user] {
    if (bytes > 0) std::memcpy(kept, own, bytes);
    if (copied) user.copy_(out);
  };
  return plan;
}

// Python bindings of the compression kernels and the quantized all-reduce (compression_binding.cpp).
void bind_compression(py::module_& m, py::class_<Communicator, std::shared_ptr<Communicator>>& communicator);
// Python bindings of the host-memory optimizer steps (optim_binding.cpp).
void bind_optim(py::module_& m);
#ifdef BRAID_WITH_CUDA
// Python bindings of the CUDA compression kernels (cuda_compression_binding.cpp, CUDA builds only).
void bind_cuda_compression(py::module_& m);
// Python bindings of the communicator's collectives on CUDA tensors (cuda_comm_binding.cpp).
void bind_cuda_comm(py::module_& m, py::class_<Communicator, std::shared_ptr<Communicator>>& communicator);
#endif

#ifdef BRAID_WITH_CUDA
// A collective on CUDA tensors of `device` (cuda_comm_binding.cpp): `r` points into `out.buffer`
// and `in` (undefined for a call in place), ordered after the caller's current stream and carried
// device to device between the ranks of one host (CUDA IPC, cuda_ipc.h) where the communicator's
// channel for the device is on, else through the device's staging pipeline (pinned host memory).
// A CudaWork for async calls, else None (the caller's stream then waits for the results).
py::object dispatch_cuda(Communicator& c, c10::Device device, Request r, const Contiguous& out, const at::Tensor& in,
                         bool async);
// An all-to-all with split sizes on CUDA tensors (`counts` in elements, from checked_split_counts):
// device to device where the channel is on; otherwise a ValueError saying why (the Python
// Communicator then stages it through host memory itself).
py::object all_to_all_v_cuda(Communicator& c, c10::Device device, const Contiguous& out, const at::Tensor& in,
                             const SplitCounts& counts, bool async);
#endif

}  // namespace braid
