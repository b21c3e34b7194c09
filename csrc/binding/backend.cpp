// braid as a torch.distributed backend: a c10d::Backend whose collectives run on a braid
// Communicator. c10d calls these from any thread without the GIL; argument errors are c10 errors
// (ValueError/TypeError in Python), transport errors braid's own CommError classes. In builds with
// CUDA, a call on CUDA tensors runs through the device's staging pipeline (cuda_stager.h).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "../core/communicator.h"
#include "backend.h"
#include "binding_util.h"
#include "cuda_stager.h"

#ifdef BRAID_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace braid {
namespace {

// How a tensor travels in a call that only moves data (broadcast, gathers, scatter, all-to-all,
// send/recv): as its dtype where braid has it, else as its bytes (bool, int8, int16, complex,
// ...: nothing is computed on them, as DDP's broadcast of a bool buffer needs). `scale`: wire
// elements per tensor element.
struct Moved {
  DType dtype;
  size_t scale;
};

Moved moved_as(const at::Tensor& t) {
  if (auto d = dtype_from(t.scalar_type())) return {*d, 1};
  return {DType::kUInt8, static_cast<size_t>(t.element_size())};
}

ReduceOp op_of(const c10d::ReduceOp& op, DType dtype, const char* what) {
  // PREMUL_SUM sums premul_scaled's copies.
  const std::optional<ReduceOp> known =
      op.op_ == c10d::ReduceOp::PREMUL_SUM ? ReduceOp::kSum : reduce_op_from(op.op_);
  TORCH_CHECK_VALUE(known.has_value(), "braid ", what, ": reduce op ", static_cast<int>(op.op_),
                    " is not supported (SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR and PREMUL_SUM are)");
  const ReduceOp r = *known;
  check_op_dtype(r, dtype, "tensor", what);
  return r;
}

// PREMUL_SUM(f): every rank's input times f, then summed. Returns the scaled copy of `t` (so the
// caller's input is never touched) when `op` is PREMUL_SUM, an undefined tensor otherwise. The
// product is taken in the tensor's dtype, as torch's mul does; braid then sums it with SUM. The
// factor's type is spelled NCCLPreMulSumSupplement: torch 2.11 has only that name, newer releases
// keep it as an alias of PreMulSumSupplement.
at::Tensor premul_scaled(const c10d::ReduceOp& op, const at::Tensor& t, const char* what) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return at::Tensor();
  TORCH_CHECK_VALUE(at::isFloatingType(t.scalar_type()), "braid ", what,
                    ": PREMUL_SUM needs a floating-point tensor, got ", t.scalar_type());
  const auto* factor = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK_VALUE(factor != nullptr, "braid ", what,
                    ": PREMUL_SUM needs its factor (torch.distributed._make_nccl_premul_sum(f))");
  if (factor->tensor_factor.defined())
    return t.mul(factor->tensor_factor.to(t.device()).reshape({})).contiguous();
  return t.mul(factor->double_factor).contiguous();
}

void check_tensor(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "braid ", op, ": ", arg, " must be a dense tensor");
#ifdef BRAID_WITH_CUDA
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), "braid ", op, ": ", arg,
                    " must be a CPU or CUDA tensor, got one on ", t.device());
#else
  TORCH_CHECK_VALUE(t.device().is_cpu(), "braid ", op, ": ", arg, " is on ", t.device(),
                    ", but this braid build takes CPU tensors only (CUDA tensors need braid built with CUDA)");
#endif
}

// Calls that have no staged form on a device (point-to-point, all-to-all of tensor lists, sparse
// tensors, and all-to-all with split sizes where the device-to-device path is off) take CPU
// tensors only.
void check_host(const at::Tensor& t, const char* op, const char* arg) {
  check_tensor(t, op, arg);
  TORCH_CHECK_VALUE(t.device().is_cpu(), "braid ", op, ": ", arg, " is on ", t.device(), "; braid runs ", op,
                    " on CPU tensors only (on CUDA tensors it runs all_reduce, broadcast, reduce, the all-gathers, ",
                    "reduce-scatters, gather, scatter and all-to-all of equal splits, and all-to-all with split ",
                    "sizes between the ranks of one host with CUDA IPC)");
}

// A tensor a call writes: one whose elements share memory (expand()) cannot hold a result, and
// the copy back would fail only after every rank communicated.
void check_output(const at::Tensor& t, const char* op, const char* arg) {
  check_tensor(t, op, arg);
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, "braid ", op, ": ", arg,
                    " has elements that share memory (e.g. from expand()); pass a tensor with distinct elements");
}

void check_count(const std::vector<at::Tensor>& ts, size_t n, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(ts.size() == n, "braid ", op, ": expected ", n, " tensor(s) in ", arg, ", got ", ts.size());
}

// The collectives of one c10d call, submitted in order, plus what to do when they are done.
struct Batch {
  std::vector<Request> requests;
  std::vector<at::Tensor> keep;       // buffers that must live until the last request finished
  std::vector<at::Tensor> outputs;    // the future's value
  std::vector<std::function<void()>> finish;  // copies into the caller's tensors, in order

  void add(Request r) { requests.push_back(std::move(r)); }
  void copy_back(const Contiguous& b) {
    if (b.copy_back()) finish.push_back([b] { b.user.copy_(b.buffer); });
  }
};

// A data-moving request for `count` elements of `t`'s dtype (see moved_as).
Request make_moving(CollKind kind, const at::Tensor& t, size_t count, const void* in, void* out) {
  const Moved m = moved_as(t);
  return make_request(kind, m.dtype, count * m.scale, in, out);
}

// The c10d Work of a braid call. wait() raises braid's error (c10d's future-wrapping work returns
// normally from a failed future, which would hand back unreduced tensors as if all went well),
// takes a timeout, is interruptible and refuses, as braid's own works do, to wait on the progress
// thread for work queued behind it; result() gives the output tensors.
class C10dWork final : public c10d::Work {
 public:
  C10dWork(c10::intrusive_ptr<c10::ivalue::Future> fut, std::shared_ptr<braid::Work> work,
            std::vector<at::Tensor> outputs, std::shared_ptr<int> source = nullptr)
      : fut_(std::move(fut)), work_(std::move(work)), outputs_(std::move(outputs)), source_(std::move(source)) {}

  // A receive from any source: the sender's rank, once it completed.
  int sourceRank() const override {
    TORCH_CHECK(source_ != nullptr, "braid: sourceRank() is only known for a receive from any source");
    TORCH_CHECK(fut_->completed() && !fut_->hasError(), "braid: sourceRank() is known once the receive completed");
    return *source_;
  }

  bool isCompleted() override { return fut_->completed(); }
  bool isSuccess() const override { return fut_->completed() && !fut_->hasError(); }
  std::exception_ptr exception() const override { return fut_->completed() ? fut_->exception_ptr() : nullptr; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return fut_; }

  bool wait(std::chrono::milliseconds timeout) override {
    if (work_ != nullptr && !work_->wait(timeout, /*interruptible=*/true))
      throw CommError(ErrorKind::kTimeout, "braid work not completed within the " + std::to_string(timeout.count()) +
                                               " ms given to wait()");
    fut_->wait();  // completed by the work's completion callback, which may still be running
    if (fut_->hasError()) std::rethrow_exception(fut_->exception_ptr());
    return true;
  }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> fut_;
  std::shared_ptr<braid::Work> work_;  // null for a call that completed before returning
  std::vector<at::Tensor> outputs_;
  std::shared_ptr<int> source_;
};

c10::intrusive_ptr<c10d::Work> pending_work(std::shared_ptr<Work> w, std::vector<at::Tensor> outputs,
                                            std::shared_ptr<int> source = nullptr) {
  auto fut = future_of(*w, outputs);
  return c10::make_intrusive<C10dWork>(std::move(fut), std::move(w), std::move(outputs), std::move(source));
}

class BraidBackend final : public c10d::Backend {
 public:
  explicit BraidBackend(std::shared_ptr<Communicator> comm)
      : c10d::Backend(comm->rank(), comm->world_size()), comm_(std::move(comm)) {}

  ~BraidBackend() override {
    // The last reference may go in a callback on the communicator's own progress thread, which
    // close() would have to join from itself: the communicator's destructor (its last reference
    // goes with this object's) leaves the thread to end on its own instead.
    if (comm_->on_progress_thread()) return;
    without_gil([this] { comm_->close(); });
  }

  const std::string getBackendName() const override { return "braid"; }

  void shutdown() override {
    without_gil([this] { comm_->close(); });
  }
  void abort() override {
    without_gil([this] { comm_->abort(); });
  }

  // -- collectives ------------------------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    check_count(tensors, 1, "broadcast", "tensors");
    check_output(tensors[0], "broadcast", "tensor");
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "braid broadcast: root ", opts.rootRank,
                      " is not a rank of this group of ", size_);
    Batch b;
    Contiguous t = as_contiguous(tensors[0]);
    Request r = make_moving(CollKind::kBroadcast, t.buffer, t.buffer.numel(), t.buffer.data_ptr(), t.buffer.data_ptr());
    r.root = static_cast<int>(opts.rootRank);
    b.add(std::move(r));
    b.keep.push_back(t.buffer);
    b.copy_back(t);
    b.outputs = tensors;
    return run(std::move(b), opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1 && tensors[0].is_sparse()) return sparse_allreduce(tensors[0], opts.reduceOp);
    return allreduce_list(tensors, opts.reduceOp, opts.asyncOp, "allreduce");
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    return allreduce_list(tensors, opts.reduceOp, opts.asyncOp, "allreduce_coalesced");
  }

  // Only the root's tensor receives the result: other ranks reduce a copy.
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    check_count(tensors, 1, "reduce", "tensors");
    check_output(tensors[0], "reduce", "tensor");
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "braid reduce: root ", opts.rootRank,
                      " is not a rank of this group of ", size_);
    Batch b;
    at::Tensor scaled = premul_scaled(opts.reduceOp, tensors[0], "reduce");
    Contiguous t = scaled.defined()            ? Contiguous{tensors[0], scaled}
               : rank_ == opts.rootRank ? as_contiguous(tensors[0])
                                        : Contiguous{tensors[0], tensors[0].contiguous().clone()};
    Request r = make_request(CollKind::kAllReduce, to_dtype(t.buffer.scalar_type(), "tensor", "reduce"),
                             t.buffer.numel(), t.buffer.data_ptr(), t.buffer.data_ptr());
    r.op = op_of(opts.reduceOp, r.dtype, "reduce");
    r.root = static_cast<int>(opts.rootRank);  // ranks that disagree on it raise a mismatch
    b.add(std::move(r));
    b.keep.push_back(t.buffer);
    if (rank_ == opts.rootRank) b.copy_back(t);
    b.outputs = tensors;
    return run(std::move(b), opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    Batch b;
    add_all_gather(b, output, input, "_allgather_base");
    b.outputs = {output};
    return run(std::move(b), opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    check_count(inputs, outputs.size(), "allgather_into_tensor_coalesced", "inputs");
    Batch b;
    for (size_t i = 0; i < outputs.size(); ++i) add_all_gather(b, outputs[i], inputs[i], "allgather_into_tensor_coalesced");
    b.outputs = outputs;
    return run(std::move(b), opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    check_count(inputs, 1, "allgather", "input_tensors");
    TORCH_CHECK_VALUE(outputs.size() == 1, "braid allgather: expected one output list, got ", outputs.size());
    Batch b;
    add_all_gather_list(b, outputs[0], inputs[0], "allgather");
    b.outputs = outputs[0];
    return run(std::move(b), opts.asyncOp);
  }

  // torch's layout: outputs[r][j] receives input j of rank r. The inputs travel as one buffer of
  // their bytes (one all-gather whatever their dtypes), each rank's block holding its inputs in
  // order.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "braid allgather_coalesced: output_tensor_lists has ",
                      outputs.size(), " lists, expected one per rank (", size_, ")");
    std::vector<at::Tensor> bytes;
    std::vector<int64_t> sizes;
    for (size_t j = 0; j < inputs.size(); ++j) {
      check_tensor(inputs[j], "allgather_coalesced", "input_tensor_list");
      bytes.push_back(inputs[j].contiguous().reshape({-1}).view(at::kByte));
      sizes.push_back(bytes.back().numel());
    }
    for (int r = 0; r < size_; ++r) {
      check_count(outputs[r], inputs.size(), "allgather_coalesced", "output_tensor_lists[rank]");
      for (size_t j = 0; j < inputs.size(); ++j) {
        check_output(outputs[r][j], "allgather_coalesced", "output_tensor_lists[rank][i]");
        TORCH_CHECK_VALUE(outputs[r][j].numel() == inputs[j].numel() &&
                              outputs[r][j].scalar_type() == inputs[j].scalar_type(),
                          "braid allgather_coalesced: output_tensor_lists[", r, "][", j,
                          "] must have the numel and dtype of input_tensor_list[", j, "]");
      }
    }
    const int64_t block = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    at::Tensor in = bytes.empty() ? at::empty({0}, at::kByte) : at::cat(bytes);
    at::Tensor whole = at::empty({size_ * block}, in.options());
    Batch b;
    add_all_gather(b, whole, in, "allgather_coalesced");
    b.finish.push_back([outputs, whole, sizes, block] {
      for (size_t r = 0; r < outputs.size(); ++r) {
        int64_t off = static_cast<int64_t>(r) * block;
        for (size_t j = 0; j < sizes.size(); ++j) {
          const at::Tensor& o = outputs[r][j];
          at::Tensor dst = o.is_contiguous() ? o : at::empty_like(o, at::MemoryFormat::Contiguous);
          dst.reshape({-1}).view(at::kByte).copy_(whole.narrow(0, off, sizes[j]));
          if (!dst.is_same(o)) o.copy_(dst);
          off += sizes[j];
        }
      }
    });
    for (const auto& list : outputs) b.outputs.insert(b.outputs.end(), list.begin(), list.end());
    return run(std::move(b), opts.asyncOp);
  }

  // Every rank gathers, the root keeps the pieces: one all-gather, as fast as a gather here.
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    check_count(inputs, 1, "gather", "input_tensors");
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "braid gather: root ", opts.rootRank,
                      " is not a rank of this group of ", size_);
    const bool root = rank_ == opts.rootRank;
    TORCH_CHECK_VALUE(outputs.size() == (root ? 1u : 0u), "braid gather: ",
                      root ? "the root needs one output list" : "only the root passes outputs");
    Batch b;
    if (root) {
      add_all_gather_list(b, outputs[0], inputs[0], "gather");
      b.outputs = outputs[0];
    } else {
      std::vector<at::Tensor> scratch;
      for (int i = 0; i < size_; ++i) scratch.push_back(at::empty_like(inputs[0], at::MemoryFormat::Contiguous));
      add_all_gather_list(b, scratch, inputs[0], "gather");
    }
    b.requests.back().tag = static_cast<uint32_t>(opts.rootRank) + 1;  // ranks that disagree: a mismatch
    return run(std::move(b), opts.asyncOp);
  }

  // The root's pieces are broadcast as one buffer and each rank keeps its own.
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    check_count(outputs, 1, "scatter", "output_tensors");
    check_output(outputs[0], "scatter", "output");
    TORCH_CHECK_VALUE(opts.rootRank >= 0 && opts.rootRank < size_, "braid scatter: root ", opts.rootRank,
                      " is not a rank of this group of ", size_);
    const bool root = rank_ == opts.rootRank;
    TORCH_CHECK_VALUE(inputs.size() == (root ? 1u : 0u), "braid scatter: ",
                      root ? "the root needs one input list" : "only the root passes inputs");
    const int64_t n = outputs[0].numel();
    at::Tensor whole = at::empty({size_ * n}, outputs[0].options().memory_format(at::MemoryFormat::Contiguous));
    if (root) {
      check_count(inputs[0], size_, "scatter", "scatter_list");
      for (int i = 0; i < size_; ++i) {
        TORCH_CHECK_VALUE(inputs[0][i].numel() == n && inputs[0][i].scalar_type() == whole.scalar_type(),
                          "braid scatter: scatter_list[", i, "] must match the output's numel and dtype");
        whole.narrow(0, i * n, n).view(inputs[0][i].sizes()).copy_(inputs[0][i]);
      }
    }
    Batch b;
    Request r = make_moving(CollKind::kBroadcast, whole, whole.numel(), whole.data_ptr(), whole.data_ptr());
    r.root = static_cast<int>(opts.rootRank);
    b.add(std::move(r));
    b.keep.push_back(whole);
    at::Tensor out = outputs[0];
    at::Tensor mine = whole.narrow(0, rank_ * n, n);
    b.finish.push_back([out, mine] { out.copy_(mine.view(out.sizes())); });
    b.outputs = outputs;
    return run(std::move(b), opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    Batch b;
    add_reduce_scatter(b, output, input, opts.reduceOp, "_reduce_scatter_base");
    b.outputs = {output};
    return run(std::move(b), opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    check_count(inputs, outputs.size(), "reduce_scatter_tensor_coalesced", "inputs");
    Batch b;
    for (size_t i = 0; i < outputs.size(); ++i)
      add_reduce_scatter(b, outputs[i], inputs[i], opts.reduceOp, "reduce_scatter_tensor_coalesced");
    b.outputs = outputs;
    return run(std::move(b), opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    check_count(outputs, 1, "reduce_scatter", "output");
    TORCH_CHECK_VALUE(inputs.size() == 1, "braid reduce_scatter: expected one input list, got ", inputs.size());
    check_count(inputs[0], size_, "reduce_scatter", "input_list");
    for (size_t i = 0; i < inputs[0].size(); ++i) {
      check_tensor(inputs[0][i], "reduce_scatter", "input_list");
      TORCH_CHECK_VALUE(inputs[0][i].numel() == outputs[0].numel(), "braid reduce_scatter: input_list[", i,
                        "] has ", inputs[0][i].numel(), " elements, the output ", outputs[0].numel());
    }
    std::vector<at::Tensor> flat;
    for (const auto& t : inputs[0]) flat.push_back(t.reshape({-1}));
    at::Tensor whole = at::cat(flat);
    Batch b;
    add_reduce_scatter(b, outputs[0], whole, opts.reduceOp, "reduce_scatter");
    b.outputs = outputs;
    return run(std::move(b), opts.asyncOp);
  }

  // all_to_all_single. Without split sizes, equal splits of dimension 0 run as one collective
  // (chunk j of rank i to chunk i of rank j); with them, point-to-point transfers, each pair as
  // its sizes need.
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    check_output(output, "alltoall_base", "output");
    check_tensor(input, "alltoall_base", "input");
    const SplitCounts counts =
        checked_split_counts(output, input, output_splits.empty() ? nullptr : &output_splits,
                             input_splits.empty() ? nullptr : &input_splits, rank_, size_, "braid alltoall_base: ");
    at::Tensor in = input.contiguous();
    Contiguous out = as_contiguous(output);
    if (overlaps(out.buffer, in)) in = in.clone();  // the all-to-all is never in place
    // The path must be the same on every rank, and a rank sees only its own row and column of
    // the split matrix: equal splits passed explicitly on one rank may meet uneven ones on
    // another. So any split list means point-to-point (torch passes none for equal splits).
    if (!input_splits.empty() || !output_splits.empty()) {
#ifdef BRAID_WITH_CUDA
      if (input.is_cuda() && output.device() == input.device())
        if (auto w = run_exchange_on_device(out, in, counts, {output}, opts.asyncOp)) return w;
#endif
      check_host(input, "alltoall_base with split sizes", "input");
      check_host(output, "alltoall_base with split sizes", "output");
      return run_exchange(out, in, counts, {output}, opts.asyncOp);
    }
    Batch b;
    b.add(make_moving(CollKind::kAllToAll, in, static_cast<size_t>(in.numel() / size_), in.data_ptr(),
                      out.buffer.data_ptr()));
    b.keep = {in, out.buffer};
    b.copy_back(out);
    b.outputs = {output};
    return run(std::move(b), opts.asyncOp);
  }

  // all_to_all of tensor lists: input i goes to rank i, output i comes from rank i; sizes may
  // differ (numel and shape per tensor; each pair of ranks must agree on what they exchange).
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    check_count(outputs, size_, "alltoall", "output_tensor_list");
    check_count(inputs, size_, "alltoall", "input_tensor_list");
    SplitCounts counts;
    std::vector<at::Tensor> flat;
    for (int i = 0; i < size_; ++i) {
      check_host(inputs[i], "alltoall", "input_tensor_list");
      check_output(outputs[i], "alltoall", "output_tensor_list");
      check_host(outputs[i], "alltoall", "output_tensor_list");
      TORCH_CHECK_TYPE(inputs[i].scalar_type() == inputs[0].scalar_type() &&
                           outputs[i].scalar_type() == inputs[0].scalar_type(),
                       "braid alltoall: every tensor must have the same dtype");
      counts.send.push_back(inputs[i].numel());
      counts.recv.push_back(outputs[i].numel());
      flat.push_back(inputs[i].reshape({-1}));
    }
    TORCH_CHECK_VALUE(counts.send[rank_] == counts.recv[rank_], "braid alltoall: input_tensor_list[rank] has ",
                      counts.send[rank_], " elements and output_tensor_list[rank] ", counts.recv[rank_],
                      ": it is the piece this rank keeps");
    at::Tensor in = at::cat(flat);
    at::Tensor whole = at::empty({std::accumulate(counts.recv.begin(), counts.recv.end(), int64_t{0})}, in.options());
    // Blocking (the pieces are copied into the caller's tensors right after): one exchange, equal
    // sizes or not, since the list form has no single buffer to hand the collective path.
    run_exchange(Contiguous{whole, whole}, in, counts, {}, false);
    int64_t off = 0;
    for (int i = 0; i < size_; ++i) {
      outputs[i].copy_(whole.narrow(0, off, counts.recv[i]).view(outputs[i].sizes()));
      off += counts.recv[i];
    }
    return completed(outputs);
  }

  // Point-to-point through per-pair mailboxes in shared memory, matched in issue order per
  // (sender, receiver) pair; tags are not compared. Always asynchronous: a send completes once
  // its data is in the mailbox (eager up to 4 MiB in flight per pair), a recv once it arrived.
  // Point-to-point has no device-to-device path: a CUDA tensor goes through host memory (the
  // pipeline schedules' activations between stages on one GPU each). send copies it to the host
  // first, a copy that waits for the caller's current stream and for which the host waits; the
  // message then leaves from that copy, and the caller may reuse its tensor at once.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int /*tag*/) override {
    check_count(tensors, 1, "send", "tensors");
    check_tensor(tensors[0], "send", "tensor");
    check_peer(dst, "send", "dst");
    at::Tensor t = tensors[0].is_cuda() ? tensors[0].to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous()
                                        : tensors[0].contiguous();
    Batch b;
    Request r = make_moving(CollKind::kSend, t, t.numel(), t.data_ptr(), nullptr);
    r.peer = dst;
    b.add(std::move(r));
    b.keep.push_back(t);
    b.outputs = tensors[0].is_cuda() ? std::vector<at::Tensor>{t} : tensors;
    return run(std::move(b), true);
  }

  // recv into a CUDA tensor: the message arrives in pinned host memory; when it is complete the
  // progress thread copies it into the tensor on a stream of braid's that first waits for the
  // caller's current stream as it was at the call (nothing queued before the recv still reads or
  // writes the tensor), and the host waits for that copy before the work completes: whoever
  // waits on the work (or its future, whose value is the host copy) finds the data in place.
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int /*tag*/) override {
    check_count(tensors, 1, "recv", "tensors");
    check_output(tensors[0], "recv", "tensor");
    check_tensor(tensors[0], "recv", "tensor");
    check_peer(src, "recv", "src");
#ifdef BRAID_WITH_CUDA
    if (tensors[0].is_cuda()) return recv_on_device(tensors[0], src);
#endif
    check_host(tensors[0], "recv", "tensor");
    Contiguous t = as_contiguous(tensors[0]);
    Batch b;
    Request r = make_moving(CollKind::kRecv, t.buffer, t.buffer.numel(), nullptr, t.buffer.data_ptr());
    r.peer = src;
    b.add(std::move(r));
    b.keep.push_back(t.buffer);
    b.copy_back(t);
    b.outputs = tensors;
    return run(std::move(b), true);
  }

  // The first message from any peer (in the order Communicator's kAnySource defines); the Work's
  // sourceRank() names the sender. Tags are not compared, as for recv.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int /*tag*/) override {
    check_count(tensors, 1, "recv", "tensors");
    check_output(tensors[0], "recv", "tensor");
    check_host(tensors[0], "recv", "tensor");
    TORCH_CHECK_VALUE(size_ > 1, "braid recv: a receive from any source needs a peer; this group has one rank");
    Contiguous t = as_contiguous(tensors[0]);
    auto source = std::make_shared<int>(-1);
    Request r = make_moving(CollKind::kRecv, t.buffer, t.buffer.numel(), nullptr, t.buffer.data_ptr());
    r.peer = kAnySource;
    r.source = source;
    auto keep = std::make_shared<std::vector<at::Tensor>>(std::vector<at::Tensor>{t.buffer});
    r.keepalive = keep;
    if (t.copy_back()) r.epilogue = [t] { t.user.copy_(t.buffer); };
    return pending_work(comm_->submit(std::move(r), true), tensors, std::move(source));
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    Batch b;
    b.add(make_request(CollKind::kBarrier, DType::kFloat32, 0, nullptr, nullptr));
    return run(std::move(b), opts.asyncOp);
  }

  // torch's monitored barrier: every rank reports to rank 0 with a point-to-point message (matched
  // in issue order with the user's own, as every braid transfer) and waits for its answer; rank 0
  // waits for all of them for `opts.timeout` in total and names the ranks that did not arrive
  // (the first of them, or all with `wait_all_ranks`). A rank that never arrives leaves its
  // receive posted: the communicator then fails at its own timeout, as a group whose rank is
  // gone must.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + opts.timeout;
    const auto left = [&] {
      return std::max(std::chrono::nanoseconds(1), std::chrono::nanoseconds(deadline - Clock::now()));
    };
    const std::string ms = std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(opts.timeout).count());
    auto token = std::make_shared<std::vector<at::Tensor>>(std::vector<at::Tensor>{at::zeros({1}, at::kByte)});
    auto transfer = [&](CollKind kind, int peer) {
      Request r = make_request(kind, DType::kUInt8, 1, (*token)[0].data_ptr(), (*token)[0].data_ptr());
      r.peer = peer;
      r.keepalive = token;
      return comm_->submit(std::move(r), true);
    };
    if (rank_ != 0) {
      transfer(CollKind::kSend, 0);
      auto answer = transfer(CollKind::kRecv, 0);
      bool answered = false;
      std::string why = "no answer";
      try {
        answered = answer->wait(left(), true);
      } catch (const std::exception& e) {
        why = e.what();
      }
      TORCH_CHECK(answered, "Rank ", rank_, " successfully reached monitoredBarrier, but received errors while ",
                  "waiting for send/recv from rank 0 within ", ms, " ms (", why,
                  "). Please check rank 0 logs for faulty rank.");
      return;
    }
    std::vector<std::shared_ptr<Work>> arrivals;
    for (int r = 1; r < size_; ++r) arrivals.push_back(transfer(CollKind::kRecv, r));
    std::vector<int> missing;
    for (int r = 1; r < size_; ++r) {
      auto& w = arrivals[static_cast<size_t>(r - 1)];
      if (w->wait(left(), true)) continue;  // a failure (a peer gone) raises its own error
      missing.push_back(r);
      if (!wait_all_ranks) break;
    }
    if (!missing.empty()) {
      std::string ranks;
      for (int r : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      TORCH_CHECK(false, "Rank 0 timed out in monitoredBarrier after ", ms, " ms. Ranks ", ranks,
                  " failed to pass monitoredBarrier in ", ms, " ms");
    }
    for (int r = 1; r < size_; ++r) transfer(CollKind::kSend, r);
  }

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return comm_->seq(); }

 private:
  void check_peer(int peer, const char* op, const char* arg) const {
    TORCH_CHECK_VALUE(peer >= 0 && peer < size_ && peer != rank_, "braid ", op, ": ", arg, " must be another rank of ",
                      "this group of ", size_, ", got ", peer);
  }

  // An all-to-all as point-to-point transfers (Communicator::submit_exchange): `counts.send[j]`
  // elements of `in` to rank j, `counts.recv[j]` from rank j into `out`, in rank order.
  c10::intrusive_ptr<c10d::Work> run_exchange(const Contiguous& out, const at::Tensor& in, const SplitCounts& counts,
                                              std::vector<at::Tensor> outputs, bool async) {
    const Moved m = moved_as(in);
    const DType dtype = m.dtype;
    SplitCounts wire = counts;
    for (auto* v : {&wire.send, &wire.recv})
      for (int64_t& c : *v) c *= static_cast<int64_t>(m.scale);
    ExchangePlan plan = plan_uneven_all_to_all(rank_, size_, dtype, in, out.buffer, out.user, wire);
    auto keep = std::make_shared<std::vector<at::Tensor>>(std::vector<at::Tensor>{in, out.buffer});
    auto w = comm_->submit_exchange(dtype, std::move(plan.requests), std::move(plan.epilogue), keep, async);
    if (!async) return completed(outputs);
    return pending_work(std::move(w), std::move(outputs));
  }

  // A sparse COO tensor summed over the ranks: every rank gathers every rank's indices and values
  // (padded to the largest count, with the counts gathered first), and the same coalesce on every
  // rank sums them into the tensor, so the result is the same everywhere. Runs before it returns.
  c10::intrusive_ptr<c10d::Work> sparse_allreduce(at::Tensor& tensor, const c10d::ReduceOp& op) {
    const char* what = "allreduce (sparse)";
    TORCH_CHECK_VALUE(op.op_ == c10d::ReduceOp::SUM, "braid ", what, ": a sparse tensor can only be summed (SUM)");
    TORCH_CHECK_VALUE(tensor.device().is_cpu(), "braid ", what, ": tensor must be a CPU tensor, got one on ",
                      tensor.device());
    auto gather = [&](const at::Tensor& t) {
      at::Tensor in = t.contiguous().reshape({-1});
      at::Tensor out = at::empty({size_ * in.numel()}, in.options());
      Batch b;
      add_all_gather(b, out, in, what);
      run(std::move(b), false);
      return out;
    };
    at::Tensor mine = tensor.coalesce();
    at::Tensor indices = mine._indices(), values = mine._values();
    const int64_t nnz = mine._nnz();
    at::Tensor counts = gather(at::full({1}, nnz, at::kLong));
    const int64_t most = counts.max().item<int64_t>();
    std::vector<int64_t> value_shape = values.sizes().vec();
    value_shape[0] = most;
    at::Tensor idx = at::zeros({indices.size(0), most}, indices.options());
    at::Tensor val = at::zeros(value_shape, values.options());
    idx.narrow(1, 0, nnz).copy_(indices);
    val.narrow(0, 0, nnz).copy_(values);
    // Rank r's padded block, transposed back to (sparse dims, count) and trimmed to its count.
    at::Tensor all_idx = gather(idx.t()).view({size_, most, indices.size(0)});
    value_shape.insert(value_shape.begin(), size_);
    at::Tensor all_val = gather(val).view(value_shape);
    std::vector<at::Tensor> idx_parts, val_parts;
    for (int r = 0; r < size_; ++r) {
      const int64_t n = counts[r].item<int64_t>();
      idx_parts.push_back(all_idx[r].narrow(0, 0, n).t());
      val_parts.push_back(all_val[r].narrow(0, 0, n));
    }
    at::Tensor sum = at::sparse_coo_tensor(at::cat(idx_parts, 1), at::cat(val_parts, 0), tensor.sizes(),
                                           tensor.options()).coalesce();
    tensor.copy_(sum);
    return completed({tensor});
  }

  c10::intrusive_ptr<c10d::Work> allreduce_list(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, bool async,
                                                const char* what) {
    TORCH_CHECK_VALUE(!tensors.empty(), "braid ", what, ": no tensors given");
    Batch b;
    for (const auto& tensor : tensors) {
      check_output(tensor, what, "tensor");
      at::Tensor scaled = premul_scaled(op, tensor, what);
      Contiguous t = scaled.defined() ? Contiguous{tensor, scaled} : as_contiguous(tensor);
      Request r = make_request(CollKind::kAllReduce, to_dtype(t.buffer.scalar_type(), "tensor", what),
                               t.buffer.numel(), t.buffer.data_ptr(), t.buffer.data_ptr());
      r.op = op_of(op, r.dtype, what);
      b.add(std::move(r));
      b.keep.push_back(t.buffer);
      b.copy_back(t);
    }
    b.outputs = tensors;
    return run(std::move(b), async);
  }

  void add_all_gather(Batch& b, const at::Tensor& output, const at::Tensor& input, const char* what) {
    check_output(output, what, "output");
    check_tensor(input, what, "input");
    TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(), "braid ", what, ": output and input dtypes differ");
    TORCH_CHECK_VALUE(output.numel() == size_ * input.numel(), "braid ", what, ": output.numel() must be ", size_,
                      " * input.numel() (", input.numel(), "), got ", output.numel());
    Contiguous out = as_contiguous(output);
    at::Tensor in = input.contiguous();
    b.add(make_moving(CollKind::kAllGather, in, in.numel(), in.data_ptr(), out.buffer.data_ptr()));
    b.keep.push_back(in);
    b.keep.push_back(out.buffer);
    b.copy_back(out);
  }

  void add_all_gather_list(Batch& b, const std::vector<at::Tensor>& outputs, const at::Tensor& input, const char* what) {
    check_count(outputs, size_, what, "output list");
    for (const auto& o : outputs) {
      check_output(o, what, "output");
      TORCH_CHECK_VALUE(o.numel() == input.numel() && o.scalar_type() == input.scalar_type(), "braid ", what,
                        ": every output must have the input's numel and dtype");
    }
    at::Tensor whole = at::empty({size_ * input.numel()}, input.options().memory_format(at::MemoryFormat::Contiguous));
    add_all_gather(b, whole, input.reshape({-1}), what);
    const int64_t n = input.numel();
    b.finish.push_back([outputs, whole, n] {
      for (size_t i = 0; i < outputs.size(); ++i)
        outputs[i].copy_(whole.narrow(0, static_cast<int64_t>(i) * n, n).view(outputs[i].sizes()));
    });
  }

  void add_reduce_scatter(Batch& b, const at::Tensor& output, const at::Tensor& input, const c10d::ReduceOp& op,
                          const char* what) {
    check_output(output, what, "output");
    check_tensor(input, what, "input");
    TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(), "braid ", what, ": output and input dtypes differ");
    TORCH_CHECK_VALUE(input.numel() == size_ * output.numel(), "braid ", what, ": input.numel() must be ", size_,
                      " * output.numel() (", output.numel(), "), got ", input.numel());
    Contiguous out = as_contiguous(output);
    at::Tensor in = premul_scaled(op, input, what);
    if (!in.defined()) {
      in = input.contiguous();
      // The core accepts only an exact in-place alias (output = the rank's slice of input); any
      // other overlap goes through a copy of the input.
      const auto* ib = static_cast<const char*>(in.data_ptr());
      if (overlaps(in, out.buffer) && out.buffer.data_ptr() != ib + rank_ * out.buffer.nbytes()) in = in.clone();
    }
    Request r = make_request(CollKind::kReduceScatter, to_dtype(in.scalar_type(), "tensor", what),
                             out.buffer.numel(), in.data_ptr(), out.buffer.data_ptr());
    r.op = op_of(op, r.dtype, what);
    b.add(std::move(r));
    b.keep.push_back(in);
    b.keep.push_back(out.buffer);
    b.copy_back(out);
  }

  static c10::intrusive_ptr<c10d::Work> completed(const std::vector<at::Tensor>& outputs) {
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    fut->markCompleted(c10::IValue(c10::List<at::Tensor>(outputs)));
    return c10::make_intrusive<C10dWork>(std::move(fut), nullptr, outputs);
  }

  // Blocking calls run on the caller's thread (inline when nothing is queued) and return a
  // finished Work; async ones are queued in issue order and complete the future from the
  // progress thread after the last request and the copies back.
  c10::intrusive_ptr<c10d::Work> run(Batch b, bool async) {
    if (b.requests.empty()) return completed(b.outputs);
#ifdef BRAID_WITH_CUDA
    if (auto device = cuda_device_of(b)) return run_on_device(std::move(b), *device, async);
#endif
    if (!async) {
      for (auto& r : b.requests) comm_->submit(std::move(r), false);
      for (auto& f : b.finish) f();
      return completed(b.outputs);
    }
    auto keep = std::make_shared<std::vector<at::Tensor>>(std::move(b.keep));
    auto finish = std::make_shared<std::vector<std::function<void()>>>(std::move(b.finish));
    std::shared_ptr<Work> last;
    for (size_t i = 0; i < b.requests.size(); ++i) {
      Request& r = b.requests[i];
      r.keepalive = keep;
      if (i + 1 == b.requests.size()) r.epilogue = [finish] { for (auto& f : *finish) f(); };
      last = comm_->submit(std::move(r), true);
    }
    return pending_work(std::move(last), std::move(b.outputs));
  }

#ifdef BRAID_WITH_CUDA
  // The CUDA device of a call's tensors, nothing when they are all on the CPU. A call's pointers
  // go to one place (the host collective, or one device's pipeline), so a call that mixes devices
  // is refused before anything is sent.
  static std::optional<c10::Device> cuda_device_of(const Batch& b) {
    std::optional<c10::Device> device;
    for (const auto* tensors : {&b.keep, &b.outputs})
      for (const auto& t : *tensors) {
        if (!device) device = t.device();
        TORCH_CHECK_VALUE(t.device() == *device, "braid: the tensors of one call must be on one device, got ",
                          *device, " and ", t.device());
      }
    if (device && device->is_cuda()) return device;
    return std::nullopt;
  }

  // A call on CUDA tensors: its requests through the device's staging pipeline, after the caller's
  // current stream; the copies into the caller's tensors (b.finish) run on the copy-back lane, and
  // the future (devices=[device]) completes there, so wait() and the future's waiters are ordered
  // after them. wait() blocks the host until the last request's collective is done.
  c10::intrusive_ptr<c10d::Work> run_on_device(Batch b, c10::Device device, bool async) {
    bool device_to_device = true;
    for (const Request& r : b.requests) device_to_device = device_to_device && ipc_runs(r.kind);
    if (device_to_device)
      if (auto ch = ipc_channel(device)) return run_ipc(std::move(b), *ch, async);
    auto stager = stagers_of(*comm_).get(device.index());
    DeviceCall call;
    call.requests = std::move(b.requests);
    call.used = b.keep;
    call.used.insert(call.used.end(), b.outputs.begin(), b.outputs.end());
    call.finish = [finish = std::move(b.finish)] {
      for (const auto& f : finish) f();
    };
    std::shared_ptr<Work> last = submit_device_call(*comm_, *stager, std::move(call), async);
    auto fut = lane_future(last, stager->lane(Lane::kToDevice), b.outputs);
    return c10::make_intrusive<C10dWork>(std::move(fut), std::move(last), std::move(b.outputs));
  }

  c10::intrusive_ptr<c10d::Work> recv_on_device(const at::Tensor& user, int src) {
    const c10::Device device = user.device();
    at::Tensor host = at::empty(user.sizes(), user.options().device(at::kCPU).pinned_memory(true));
    auto issued = std::make_shared<cuda::CudaEvent>(device.index());
    issued->record(c10::cuda::getCurrentCUDAStream(device.index()).stream());
    const c10::cuda::CUDAStream lane = stagers_of(*comm_).get(device.index())->lane(Lane::kToDevice);
    Batch b;
    Request r = make_moving(CollKind::kRecv, host, host.numel(), nullptr, host.data_ptr());
    r.peer = src;
    b.add(std::move(r));
    b.keep.push_back(host);
    b.finish.push_back([user, host, issued, lane] {
      c10::cuda::CUDAStreamGuard guard(lane);
      issued->block(lane.stream());
      user.copy_(host, /*non_blocking=*/false);
    });
    b.outputs = {host};
    return run(std::move(b), true);
  }

  // The communicator's device-to-device channel of `device` (set up at its first call, with every
  // rank), or null when calls on it go through the staging pipeline.
  std::shared_ptr<CudaIpcChannel> ipc_channel(c10::Device device) {
    try {
      return ipc_channels_of(*comm_).get(*comm_, device.index());
    } catch (const std::invalid_argument& e) {
      C10_THROW_ERROR(ValueError, e.what());
    }
  }

  // A call on CUDA tensors device to device (cuda_ipc.h): its requests queued on the channel's
  // stream after the caller's current stream, then the copies into the caller's tensors; the
  // future completes on that stream.
  c10::intrusive_ptr<c10d::Work> run_ipc(Batch b, CudaIpcChannel& ch, bool async) {
    std::vector<at::Tensor> used = b.keep;
    used.insert(used.end(), b.outputs.begin(), b.outputs.end());
    auto finish = [finish = std::move(b.finish)] {
      for (const auto& f : finish) f();
    };
    std::shared_ptr<Work> last = submit_ipc_call(*comm_, ch, std::move(b.requests), std::move(used),
                                                 std::move(finish), async);
    auto fut = lane_future(last, ch.stream(), b.outputs);
    return c10::make_intrusive<C10dWork>(std::move(fut), std::move(last), std::move(b.outputs));
  }

  // An all-to-all with split sizes on CUDA tensors, device to device; null when the channel is off.
  c10::intrusive_ptr<c10d::Work> run_exchange_on_device(const Contiguous& out, const at::Tensor& in,
                                                        const SplitCounts& counts, std::vector<at::Tensor> outputs,
                                                        bool async) {
    auto ch = ipc_channel(in.device());
    if (ch == nullptr) return {};
    auto finish = [out] {
      if (out.copy_back()) out.user.copy_(out.buffer);
    };
    std::shared_ptr<Work> last = submit_ipc_all_to_all_v(
        *comm_, *ch, to_dtype(in.scalar_type(), "input", "alltoall_base"), in.data_ptr(), out.buffer.data_ptr(),
        counts, {in, out.buffer, out.user}, std::move(finish), async);
    auto fut = lane_future(last, ch->stream(), outputs);
    return c10::make_intrusive<C10dWork>(std::move(fut), std::move(last), std::move(outputs));
  }

#endif

  std::shared_ptr<Communicator> comm_;
};

// The process group of a group that runs on braid alone. torch names a plugin's group "custom"
// (c10d::ProcessGroup::getBackendName gives the name of its BackendType, and a plugin's is
// CUSTOM), and code that asks the group rather than torch.distributed (DDP's logging, for one)
// would report that; a group torch receives from the backend factory is used as it is (torch
// asks the factory once, for the group's first device), so this one reports "braid", with the one
// braid backend serving every device type of the group (CPU, and CUDA for "cpu:braid,cuda:braid").
class BraidProcessGroup final : public c10d::ProcessGroup {
 public:
  BraidProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, c10::intrusive_ptr<BraidBackend> backend,
                    const std::vector<c10::DeviceType>& devices)
      : c10d::ProcessGroup(store, backend->getRank(), backend->getSize()) {
    for (c10::DeviceType d : devices) setBackend(d, BackendType::CUSTOM, c10::intrusive_ptr<c10d::Backend>(backend));
    setDefaultBackend(BackendType::CUSTOM);
  }
  const std::string getBackendName() const override { return "braid"; }
};

}  // namespace

py::object python_future(c10::intrusive_ptr<c10::ivalue::Future> fut) {
  c10::intrusive_ptr<c10d::Work> work = c10::make_intrusive<C10dWork>(std::move(fut), nullptr, std::vector<at::Tensor>{});
  return py::cast(work).attr("get_future")();
}

void register_backend(py::module_& m) {
  // c10d's Python classes (the Backend base) exist once torch.distributed is imported.
  py::module_::import("torch.distributed");
  py::class_<BraidBackend, c10d::Backend, c10::intrusive_ptr<BraidBackend>>(m, "Backend")
      .def(py::init([](std::shared_ptr<Communicator> comm) { return c10::make_intrusive<BraidBackend>(std::move(comm)); }),
           py::arg("communicator"));
  py::class_<BraidProcessGroup, c10d::ProcessGroup, c10::intrusive_ptr<BraidProcessGroup>>(m, "ProcessGroup")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, const c10::intrusive_ptr<BraidBackend>& backend,
                       const std::vector<std::string>& devices) {
             TORCH_CHECK_VALUE(!devices.empty(), "braid ProcessGroup: devices must name at least one device type");
             std::vector<c10::DeviceType> types;
             for (const auto& d : devices) {
               TORCH_CHECK_VALUE(d == "cpu" || d == "cuda", "braid ProcessGroup: devices may hold 'cpu' and 'cuda', got '",
                                 d, "'");
               types.push_back(d == "cpu" ? c10::DeviceType::CPU : c10::DeviceType::CUDA);
             }
             return c10::make_intrusive<BraidProcessGroup>(store, backend, types);
           }),
           py::arg("store"), py::arg("backend"), py::arg("devices") = std::vector<std::string>{"cpu"});
  // How many owners a process group has (its Python object counts one). torch's Python object
  // frees the group with the GIL released, but an owner in C++ (a DDP Reducer) frees it with the
  // GIL held, and gloo's destructor joins threads that may need the GIL; code that must let a
  // group go safely drops its Python object only once nothing else owns the group.
  m.def(
      "_process_group_owners",
      [](const py::handle& group) {
        return c10::raw::intrusive_ptr::use_count(py::cast<c10d::ProcessGroup*>(group));
      },
      py::arg("group"));
}

}  // namespace braid
