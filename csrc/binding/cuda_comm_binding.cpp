// The communicator's collectives on CUDA tensors (CUDA builds only). torch_binding.cpp's
// collectives check their tensors and build the request on any device, and send those on CUDA
// tensors here (dispatch_cuda): an event on the caller's current stream orders braid's two copy
// lanes after it, the staging pipeline (core/staging.h over cuda/staging) carries the data
// through pinned host memory, and the work's wait() and future make the caller's stream wait for
// the copies back.
#ifdef BRAID_WITH_CUDA


#include <memory>
#include <string>
#include <vector>

#include "backend.h"
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

// A call on the device-to-device path (cuda_ipc.h): `submit(finish)` queues it on the channel's
// stream after the caller's (the GIL released), with `finish` last: the copy into a
// non-contiguous output, then the completion event. Blocking: the caller's stream waits for that
// event; async: a CudaWork.
py::object on_channel(CudaIpcChannel& ch, const Contiguous& out,
                      const std::function<std::shared_ptr<Work>(std::function<void()>)>& submit, bool async) {
  const c10::cuda::CUDAStream stream = ch.stream();
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(stream.device_index());
  auto done = std::make_shared<cuda::CudaEvent>(stream.device_index());
  std::shared_ptr<Work> w;
  {
    py::gil_scoped_release nogil;
    w = submit([done, stream, out] {
      if (out.copy_back()) out.user.copy_(out.buffer);
      done->record(stream.stream());
    });
  }
  if (!async) {
    done->block(caller.stream());
    return py::none();
  }
  return py::cast(std::make_shared<CudaWork>(std::move(w), std::move(done), stream.device(), stream,
                                             std::vector<at::Tensor>{out.user}));
}

py::object dispatch_ipc(Communicator& c, CudaIpcChannel& ch, Request r, const Contiguous& out, const at::Tensor& in,
                        bool async) {
  std::vector<at::Tensor> used = {out.buffer, out.user};
  if (in.defined()) used.push_back(in);
  std::vector<Request> requests;
  requests.push_back(std::move(r));
  return on_channel(ch, out, [&](std::function<void()> finish) {
    return submit_ipc_call(c, ch, std::move(requests), std::move(used), std::move(finish), async);
  }, async);
}

}  // namespace

std::shared_ptr<CudaIpcChannel> ipc_channel(Communicator& c, c10::Device device) {
  try {
    py::gil_scoped_release nogil;  // the first call sets the channel up with every rank
    return ipc_channels_of(c).get(c, device.index());
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, e.what());
  }
}

py::object all_to_all_v_cuda(Communicator& c, c10::Device device, const Contiguous& out, const at::Tensor& in,
                             const SplitCounts& counts, bool async) {
  const std::shared_ptr<CudaIpcChannel> ch = ipc_channel(c, device);
  TORCH_CHECK_VALUE(ch != nullptr, "all_to_all with split sizes on CUDA tensors runs device to device between the "
                    "ranks of one host (CUDA IPC), which is off for this communicator (",
                    ipc_channels_of(c).path(device.index()), ")");
  const DType dtype = to_dtype(in.scalar_type(), "input");
  return on_channel(*ch, out, [&](std::function<void()> finish) {
    return submit_ipc_all_to_all_v(c, *ch, dtype, in.data_ptr(), out.buffer.data_ptr(), counts,
                                   {in, out.buffer, out.user}, std::move(finish), async);
  }, async);
}

py::object dispatch_cuda(Communicator& c, c10::Device device, Request r, const Contiguous& out, const at::Tensor& in,
                         bool async) {
  if (ipc_runs(r.kind))
    if (auto ch = ipc_channel(c, device)) return dispatch_ipc(c, *ch, std::move(r), out, in, async);
  const std::shared_ptr<CudaStager> stager = stagers_of(c).get(device.index());
  const CudaStager& s = *stager;
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

void bind_cuda_comm(py::module_& m, py::class_<Communicator, std::shared_ptr<Communicator>>& communicator) {
  py::class_<CudaWork, std::shared_ptr<CudaWork>>(m, "CudaWork")
      .def("wait", &CudaWork::wait, py::arg("timeout") = py::none())
      .def("is_completed", &CudaWork::is_completed)
      .def("is_success", &CudaWork::is_success)
      .def("exception_message", &CudaWork::exception_message)
      .def("get_future", [](CudaWork& w) { return python_future(w.future()); });
  communicator
      .def(
          "set_staging_options",
          [](Communicator& c, size_t chunk_bytes, int slots) {
            StagingOptions o = StagingOptions::from_env();
            if (chunk_bytes != 0) o.chunk_bytes = chunk_bytes;
            if (slots != 0) o.slots = slots;
            try {
              set_stagers(c, o);
            } catch (const std::invalid_argument& e) {
              C10_THROW_ERROR(ValueError, e.what());
            }
          },
          py::arg("chunk_bytes"), py::arg("slots"),
          "The staging pipelines' options for this communicator's calls on CUDA tensors (0: the "
          "BRAID_STAGING_* variable's or the default); before its first such call.")
      .def(
          "prepare_device",
          [](Communicator& c, int device) {
            try {
              stagers_of(c).get(static_cast<c10::DeviceIndex>(device));
            } catch (const std::invalid_argument& e) {
              C10_THROW_ERROR(ValueError, e.what());
            }
          },
          py::arg("device"), "Sets up the staging pipeline of CUDA device `device` now rather than at its first call.")
      .def(
          "device_ipc",
          [](Communicator& c, int device) {
            return ipc_channel(c, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))) != nullptr;
          },
          py::arg("device"),
          "Whether calls on CUDA device `device` go device to device (CUDA IPC) between this host's ranks; "
          "the first call sets the path up, a collective of every rank.")
      .def(
          "device_path",
          [](Communicator& c, int device) {
            try {
              return ipc_channels_of(c).path(static_cast<c10::DeviceIndex>(device));
            } catch (const std::invalid_argument& e) {
              C10_THROW_ERROR(ValueError, e.what());
            }
          },
          py::arg("device"),
          "How calls on CUDA device `device` travel between this host's ranks: 'ipc' (device to device), "
          "'staged: <why>' (through pinned host memory), or '' before the device's first call.");
}

}  // namespace braid

#endif  // BRAID_WITH_CUDA
