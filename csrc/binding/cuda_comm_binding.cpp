// Torch binding of the communicator's collectives on CUDA tensors (CUDA builds only): an event on
// the caller's current stream orders braid's two copy lanes after it, the staging pipeline
// (core/staging.h over cuda/staging) carries the data through pinned host memory, and the work's
// wait() and future make the caller's stream wait for the copies back.
#ifdef BRAID_WITH_CUDA

#include <memory>
#include <string>
#include <vector>

#include "binding_util.h"
#include "cuda_stager.h"

namespace braid {
namespace {

// The Python handle of a staged collective, with HostWork's methods: wait() blocks until the host
// collective is done (raising its error), then makes the caller's current stream wait for the
// copies back; get_future() gives a Future(devices=[device]) completed on the copy-back lane.
class CudaWork {
 public:
  CudaWork(std::shared_ptr<Work> w, std::shared_ptr<cuda::CudaEvent> done, c10::Device device,
           c10::cuda::CUDAStream lane, std::vector<at::Tensor> outputs)
      : host_(w, outputs), work_(std::move(w)), done_(std::move(done)), device_(device), lane_(lane),
        outputs_(std::move(outputs)) {}

  bool wait(py::object timeout) {
    if (!host_.wait(std::move(timeout))) return false;
    done_->block(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
    return true;
  }
  bool is_completed() const { return host_.is_completed(); }
  bool is_success() const { return host_.is_success(); }
  py::object exception_message() const { return host_.exception_message(); }

  c10::intrusive_ptr<c10::ivalue::Future> future() {
    work_->check_same_process();
    if (!future_) future_ = lane_future(work_, lane_, outputs_);
    return future_;
  }

 private:
  HostWork host_;
  std::shared_ptr<Work> work_;
  std::shared_ptr<cuda::CudaEvent> done_;
  c10::Device device_;
  c10::cuda::CUDAStream lane_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A dense CUDA tensor on the stager's device; `arg` names it in errors.
at::Tensor device_tensor(const py::handle& obj, const char* arg, const CudaStager& s) {
  TORCH_CHECK_TYPE(THPVariable_Check(obj.ptr()), std::string(arg) + " must be a torch.Tensor");
  at::Tensor t = THPVariable_Unpack(obj.ptr());
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, std::string(arg) + " must be a dense (strided) tensor");
  TORCH_CHECK_VALUE(t.device() == s.device(),
                    std::string(arg) + " must be on " + s.device().str() + " (the other tensors' device), got " +
                    t.device().str());
  return t;
}

// Submits `r` (pointers into `out.buffer` and `in`) to the pipeline, ordered after the caller's
// current stream; returns a CudaWork for async calls, None otherwise (the caller's stream then
// already waits for the copies back).
py::object submit(Communicator& c, const CudaStager& s, Request r, const Contiguous& out, const at::Tensor& in, bool async) {
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(s.device().index());
  const c10::cuda::CUDAStream to_device = s.lane(Lane::kToDevice);
  auto done = std::make_shared<cuda::CudaEvent>(s.device().index());
  DeviceCall call;
  call.requests.push_back(std::move(r));
  call.used = {out.buffer, out.user};
  if (in.defined()) call.used.push_back(in);
  call.finish = [done, to_device, out] {
    if (out.copy_back()) out.user.copy_(out.buffer);
    done->record(to_device.stream());
  };
  std::shared_ptr<Work> w;
  {
    py::gil_scoped_release nogil;
    w = submit_device_call(c, s, std::move(call), async);
  }
  if (!async) {
    done->block(caller.stream());
    return py::none();
  }
  return py::cast(std::make_shared<CudaWork>(std::move(w), std::move(done), s.device(), to_device,
                                             std::vector<at::Tensor>{out.user}));
}

py::object all_reduce(Communicator& c, const CudaStager& s, py::handle tensor, int op, bool async) {
  RECORD_USER_SCOPE("braid::all_reduce");
  at::Tensor t = device_tensor(tensor, "tensor", s);
  Request r = make_request(CollKind::kAllReduce, to_dtype(t.scalar_type(), "tensor"), static_cast<size_t>(t.numel()));
  r.op = to_op(op, r.dtype, "tensor");
  Contiguous out = contiguous_output(t, "tensor");
  r.in = out.buffer.data_ptr();
  r.out = out.buffer.data_ptr();
  return submit(c, s, std::move(r), out, at::Tensor(), async);
}

py::object broadcast(Communicator& c, const CudaStager& s, py::handle tensor, int src, bool async) {
  RECORD_USER_SCOPE("braid::broadcast");
  at::Tensor t = device_tensor(tensor, "tensor", s);
  TORCH_CHECK_VALUE(!(src < 0 || src >= c.world_size()),
                    "src must be a rank in [0, " + std::to_string(c.world_size()) + "), got " + std::to_string(src));
  Request r = make_request(CollKind::kBroadcast, to_dtype(t.scalar_type(), "tensor"), static_cast<size_t>(t.numel()));
  r.root = src;
  Contiguous out = contiguous_output(t, "tensor");
  r.in = out.buffer.data_ptr();
  r.out = out.buffer.data_ptr();
  return submit(c, s, std::move(r), out, at::Tensor(), async);
}

py::object reduce_scatter(Communicator& c, const CudaStager& s, py::handle output, py::handle input, int op, bool async) {
  RECORD_USER_SCOPE("braid::reduce_scatter");
  at::Tensor o = device_tensor(output, "output", s);
  at::Tensor i = device_tensor(input, "input", s);
  check_whole_and_part(o, i, i, "input", o, "output", c.world_size());
  Request r = make_request(CollKind::kReduceScatter, to_dtype(o.scalar_type(), "output"), static_cast<size_t>(o.numel()));
  r.op = to_op(op, r.dtype, "output");
  at::Tensor in = i.contiguous();
  Contiguous out = contiguous_output(o, "output");
  check_aliasing(in, "input", out.buffer, "output", c.rank());
  r.in = in.data_ptr();
  r.out = out.buffer.data_ptr();
  return submit(c, s, std::move(r), out, in, async);
}

py::object all_gather(Communicator& c, const CudaStager& s, py::handle output, py::handle input, bool async) {
  RECORD_USER_SCOPE("braid::all_gather");
  at::Tensor o = device_tensor(output, "output", s);
  at::Tensor i = device_tensor(input, "input", s);
  check_whole_and_part(o, i, o, "output", i, "input", c.world_size());
  Request r = make_request(CollKind::kAllGather, to_dtype(o.scalar_type(), "output"), static_cast<size_t>(i.numel()));
  Contiguous out = contiguous_output(o, "output");
  at::Tensor in = i.contiguous();
  check_aliasing(out.buffer, "output", in, "input", c.rank());
  r.in = in.data_ptr();
  r.out = out.buffer.data_ptr();
  return submit(c, s, std::move(r), out, in, async);
}

py::object all_to_all(Communicator& c, const CudaStager& s, py::handle output, py::handle input, bool async) {
  RECORD_USER_SCOPE("braid::all_to_all");
  at::Tensor o = device_tensor(output, "output", s);
  at::Tensor i = device_tensor(input, "input", s);
  check_all_to_all(o, i, c.world_size());
  Request r = make_request(CollKind::kAllToAll, to_dtype(o.scalar_type(), "output"),
                      static_cast<size_t>(i.numel() / c.world_size()));
  Contiguous out = contiguous_output(o, "output");
  at::Tensor in = i.contiguous();
  r.in = in.data_ptr();
  r.out = out.buffer.data_ptr();
  return submit(c, s, std::move(r), out, in, async);
}

}  // namespace

void bind_cuda_comm(py::module_& m, py::class_<Communicator, std::shared_ptr<Communicator>>& communicator) {
  py::class_<CudaStager, std::shared_ptr<CudaStager>>(m, "CudaStager")
      .def(py::init([](int device, size_t chunk_bytes, int slots) {
             StagingOptions o;
             o.chunk_bytes = chunk_bytes;
             o.slots = slots;
             try {
               return std::make_shared<CudaStager>(device, o);
             } catch (const std::invalid_argument& e) {
               C10_THROW_ERROR(ValueError, e.what());
             }
           }),
           py::arg("device"), py::arg("chunk_bytes"), py::arg("slots"))
      .def_property_readonly("device", [](const CudaStager& s) { return s.device().str(); })
      .def_property_readonly("chunk_bytes", [](const CudaStager& s) { return s.options().chunk_bytes; })
      .def_property_readonly("slots", [](const CudaStager& s) { return s.options().slots; });
  m.def("staging_options_from_env", [] {
    const StagingOptions o = StagingOptions::from_env();
    return py::make_tuple(o.chunk_bytes, o.slots);
  });
  py::class_<CudaWork, std::shared_ptr<CudaWork>>(m, "CudaWork")
      .def("wait", &CudaWork::wait, py::arg("timeout") = py::none())
      .def("is_completed", &CudaWork::is_completed)
      .def("is_success", &CudaWork::is_success)
      .def("exception_message", &CudaWork::exception_message)
      .def("get_future", [](CudaWork& w) { return std::make_shared<torch::jit::PythonFutureWrapper>(w.future()); });
  communicator
      .def("cuda_all_reduce", &all_reduce, py::arg("stager"), py::arg("tensor"), py::arg("op"), py::arg("async_op"))
      .def("cuda_broadcast", &broadcast, py::arg("stager"), py::arg("tensor"), py::arg("src"), py::arg("async_op"))
      .def("cuda_reduce_scatter", &reduce_scatter, py::arg("stager"), py::arg("output"), py::arg("input"),
           py::arg("op"), py::arg("async_op"))
      .def("cuda_all_gather", &all_gather, py::arg("stager"), py::arg("output"), py::arg("input"),
           py::arg("async_op"))
      .def("cuda_all_to_all", &all_to_all, py::arg("stager"), py::arg("output"), py::arg("input"),
           py::arg("async_op"));
}

}  // namespace braid

#endif  // BRAID_WITH_CUDA
