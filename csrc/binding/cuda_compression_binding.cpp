// Torch binding of the CUDA compression kernels (CUDA builds only): checks device, dtype and
// sizes by argument name, then launches on torch's current stream of the tensor's device.
#ifdef BRAID_WITH_CUDA

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>

#include "../cuda/compression/compression_cuda.h"
#include "binding_util.h"

namespace braid {
namespace {

// A contiguous CUDA tensor of one of `allowed` dtypes, on `device` when given.
at::Tensor cuda_tensor(const py::handle& obj, const char* arg, std::initializer_list<at::ScalarType> allowed,
                       const c10::Device* device = nullptr) {
  at::Tensor t;
  TORCH_CHECK_TYPE(unpack_tensor(obj, t), std::string(arg) + " must be a torch.Tensor");
  TORCH_CHECK_VALUE(t.is_cuda(), std::string(arg) + " must be a CUDA tensor, got one on " + t.device().str());
  TORCH_CHECK_VALUE(!(device != nullptr && t.device() != *device),
                    std::string(arg) + " must be on " + device->str() + ", got " + t.device().str());
  bool ok = false;
  for (auto a : allowed) ok = ok || t.scalar_type() == a;
  TORCH_CHECK_TYPE(ok, std::string(arg) + " has unsupported dtype " + c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.is_contiguous(), std::string(arg) + " must be contiguous");
  return t;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

const std::initializer_list<at::ScalarType> kFloats = {at::kFloat, at::kBFloat16, at::kHalf};

at::Tensor quantize_cuda(py::handle input, py::handle residual, int bits, int64_t block, bool stochastic, uint64_t seed,
                         uint64_t index_base, int64_t chunk_arg, int64_t nchunks) {
  const QuantFormat fmt = checked_format(bits, block);
  at::Tensor in = cuda_tensor(input, "input", kFloats);
  const c10::Device dev = in.device();
  const size_t n = static_cast<size_t>(in.numel());
  const size_t chunk = checked_chunk(chunk_arg, nchunks, n, fmt);
  at::Tensor r;
  if (!residual.is_none()) {
    r = cuda_tensor(residual, "residual", {at::kFloat}, &dev);
    TORCH_CHECK_VALUE(r.numel() == in.numel(), "residual.numel() must equal input.numel()");
  }
  c10::cuda::CUDAGuard guard(dev);
  at::Tensor q = at::empty({static_cast<int64_t>(checked_payload_bytes(fmt, chunk, static_cast<size_t>(nchunks)))},
                           in.options().dtype(at::kByte));
  check_cuda(cuda::quantize(fmt, to_dtype(in.scalar_type(), "input"), in.data_ptr(),
                            r.defined() ? r.data_ptr<float>() : nullptr, n, chunk, static_cast<size_t>(nchunks),
                            stochastic, seed, index_base, q.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream()),
             "quantize");
  return q;
}

void dequantize_cuda(py::handle payload, int bits, int64_t block, py::handle output, int64_t chunk_arg) {
  const QuantFormat fmt = checked_format(bits, block);
  at::Tensor out = cuda_tensor(output, "output", kFloats);
  const c10::Device dev = out.device();
  at::Tensor q = cuda_tensor(payload, "payload", {at::kByte}, &dev);
  const size_t n = static_cast<size_t>(out.numel());
  const int64_t needed = chunk_arg > 0 ? (static_cast<int64_t>(n) + chunk_arg - 1) / chunk_arg : 1;
  const size_t chunk = checked_chunk(chunk_arg, std::max<int64_t>(needed, 1), n, fmt);
  const size_t nchunks = chunk == 0 ? 0 : (n + chunk - 1) / chunk;
  const size_t need = checked_payload_bytes(fmt, chunk, nchunks);
  TORCH_CHECK_VALUE(static_cast<size_t>(q.numel()) >= need,
                    "payload must hold at least " + std::to_string(need) + " bytes");
  c10::cuda::CUDAGuard guard(dev);
  check_cuda(cuda::dequantize(fmt, q.data_ptr<uint8_t>(), n, chunk, to_dtype(out.scalar_type(), "output"),
                              out.data_ptr(), c10::cuda::getCurrentCUDAStream()),
             "dequantize");
}

void dequantize_accumulate_cuda(py::handle payload, int bits, int64_t block, py::handle accumulator) {
  const QuantFormat fmt = checked_format(bits, block);
  at::Tensor acc = cuda_tensor(accumulator, "accumulator", {at::kFloat});
  const c10::Device dev = acc.device();
  at::Tensor q = cuda_tensor(payload, "payload", {at::kByte}, &dev);
  const size_t n = static_cast<size_t>(acc.numel());
  TORCH_CHECK_VALUE(static_cast<size_t>(q.numel()) == fmt.bytes(n),
                    "payload must hold " + std::to_string(fmt.bytes(n)) + " bytes");
  c10::cuda::CUDAGuard guard(dev);
  check_cuda(cuda::dequantize_accumulate(fmt, q.data_ptr<uint8_t>(), n, acc.data_ptr<float>(),
                                         c10::cuda::getCurrentCUDAStream()),
             "dequantize_accumulate");
}

void error_feedback_cuda(py::handle input, py::handle residual, py::handle sent) {
  at::Tensor in = cuda_tensor(input, "input", kFloats);
  const c10::Device dev = in.device();
  at::Tensor r = cuda_tensor(residual, "residual", {at::kFloat}, &dev);
  TORCH_CHECK_VALUE(r.numel() == in.numel(), "residual.numel() must equal input.numel()");
  at::Tensor s;
  if (!sent.is_none()) {
    s = cuda_tensor(sent, "sent", {at::kFloat}, &dev);
    TORCH_CHECK_VALUE(s.numel() == in.numel(), "sent.numel() must equal input.numel()");
  }
  c10::cuda::CUDAGuard guard(dev);
  check_cuda(cuda::error_feedback_update(to_dtype(in.scalar_type(), "input"), in.data_ptr(), r.data_ptr<float>(),
                                         s.defined() ? s.data_ptr<float>() : nullptr, static_cast<size_t>(in.numel()),
                                         c10::cuda::getCurrentCUDAStream()),
             "error_feedback");
}

py::tuple top_k_cuda(py::handle input, int64_t k) {
  at::Tensor in = cuda_tensor(input, "input", kFloats);
  TORCH_CHECK_VALUE(k >= 0, "k must be >= 0, got " + std::to_string(k));
  TORCH_CHECK_VALUE(in.numel() <= INT32_MAX, "input has more elements than int32 indices can address");
  const int64_t kk = std::min<int64_t>(k, in.numel());
  c10::cuda::CUDAGuard guard(in.device());
  at::Tensor values = at::empty({kk}, in.options().dtype(at::kFloat));
  at::Tensor indices = at::empty({kk}, in.options().dtype(at::kInt));
  TopKPath path;
  {
    py::gil_scoped_release nogil;  // waits for the stream (the candidate count)
    check_cuda(cuda::top_k_select(to_dtype(in.scalar_type(), "input"), in.data_ptr(), static_cast<size_t>(in.numel()),
                                  static_cast<size_t>(kk), values.data_ptr<float>(), indices.data_ptr<int32_t>(),
                                  &path, c10::cuda::getCurrentCUDAStream()),
               "top_k");
  }
  return py::make_tuple(values, indices, path == TopKPath::kExact);
}

void scatter_add_cuda(py::handle accumulator, py::handle indices, py::handle values) {
  at::Tensor acc = cuda_tensor(accumulator, "accumulator", {at::kFloat});
  const c10::Device dev = acc.device();
  at::Tensor idx = cuda_tensor(indices, "indices", {at::kInt}, &dev);
  at::Tensor val = cuda_tensor(values, "values", {at::kFloat}, &dev);
  TORCH_CHECK_VALUE(idx.numel() == val.numel(), "values.numel() must equal indices.numel()");
  if (idx.numel() > 0) {
    const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
    TORCH_CHECK_VALUE(!(lo < 0 || hi >= acc.numel()), "indices must lie in [0, " + std::to_string(acc.numel()) + ")");
  }
  c10::cuda::CUDAGuard guard(dev);
  check_cuda(cuda::scatter_add(acc.data_ptr<float>(), idx.data_ptr<int32_t>(), val.data_ptr<float>(),
                               static_cast<size_t>(idx.numel()), c10::cuda::getCurrentCUDAStream()),
             "scatter_add");
}

}  // namespace

void bind_cuda_compression(py::module_& m) {
  m.def("cuda_quantize", &quantize_cuda, py::arg("input"), py::arg("residual"), py::arg("bits"), py::arg("block"),
        py::arg("stochastic"), py::arg("seed"), py::arg("index_base") = 0, py::arg("chunk") = 0,
        py::arg("nchunks") = 1);
  m.def("cuda_dequantize", &dequantize_cuda, py::arg("payload"), py::arg("bits"), py::arg("block"), py::arg("output"),
        py::arg("chunk") = 0);
  m.def("cuda_dequantize_accumulate", &dequantize_accumulate_cuda, py::arg("payload"), py::arg("bits"),
        py::arg("block"), py::arg("accumulator"));
  m.def("cuda_error_feedback", &error_feedback_cuda, py::arg("input"), py::arg("residual"), py::arg("sent"));
  m.def("cuda_top_k", &top_k_cuda, py::arg("input"), py::arg("k"));
  m.def("cuda_scatter_add", &scatter_add_cuda, py::arg("accumulator"), py::arg("indices"), py::arg("values"));
}

}  // namespace braid

#endif  // BRAID_WITH_CUDA
