// Submission of calls on CUDA tensors to a device's staging pipeline (CUDA builds only).
#ifdef BRAID_WITH_CUDA

#include "cuda_stager.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <stdexcept>
#include <utility>

#include "binding_util.h"

namespace braid {

namespace {
std::mutex g_stagers_mu;  // guards the making of a communicator's CudaStagers
}  // namespace

CudaStagers& stagers_of(Communicator& c) {
  std::lock_guard<std::mutex> lock(g_stagers_mu);
  std::shared_ptr<void>& state = c.device_staging();
  if (state == nullptr) state = std::make_shared<CudaStagers>();
  return *std::static_pointer_cast<CudaStagers>(state);
}

void set_stagers(Communicator& c, StagingOptions options) {
  auto made = std::make_shared<CudaStagers>(options);
  std::lock_guard<std::mutex> lock(g_stagers_mu);
  c.device_staging() = std::move(made);
}

std::shared_ptr<Work> submit_device_call(Communicator& comm, const CudaStager& s, DeviceCall call, bool async) {
  if (call.requests.empty()) throw std::invalid_argument("submit_device_call: a call needs at least one request");
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(s.device().index());
  const c10::cuda::CUDAStream to_host = s.lane(Lane::kToHost), to_device = s.lane(Lane::kToDevice);
  auto start = std::make_shared<cuda::CudaEvent>(s.device().index());
  start->record(caller.stream());
  for (const auto& t : call.used)
    for (const auto& lane : {to_host, to_device})
      if (t.defined() && t.is_cuda() && t.numel() > 0)
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), lane);
  auto keep = std::make_shared<std::vector<at::Tensor>>(std::move(call.used));
  std::shared_ptr<Work> last;
  const size_t n = call.requests.size();
  for (size_t i = 0; i < n; ++i) {
    StagedHooks hooks;
    hooks.before = [start, to_host, to_device] {
      start->block(to_host.stream());
      start->block(to_device.stream());
    };
    if (i + 1 == n)
      hooks.after = [finish = std::move(call.finish), to_device] {
        c10::cuda::CUDAStreamGuard guard(to_device);
        if (finish) finish();
      };
    last = submit_staged(comm, s.engine(), std::move(call.requests[i]), s.options(), std::move(hooks), keep,
                         i + 1 < n || async);
  }
  return last;
}

c10::intrusive_ptr<c10::ivalue::Future> lane_future(const std::shared_ptr<Work>& w, const c10::cuda::CUDAStream& lane,
                                                    std::vector<at::Tensor> outputs) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(),
                                                      std::vector<c10::Device>{lane.device()});
  if (w == nullptr) {
    {
      c10::cuda::CUDAStreamGuard guard(lane);
      fut->markCompleted(c10::IValue(c10::List<at::Tensor>(outputs)));
    }
    fut->wait();  // the caller's current stream waits for the lane's event
    return fut;
  }
  w->on_complete([fut, lane, outputs = std::move(outputs)](const Work& done) {
    c10::cuda::CUDAStreamGuard guard(lane);
    settle(done, *fut, outputs);
  });
  return fut;
}

}  // namespace braid

#endif  // BRAID_WITH_CUDA
