// Torch binding of the CPU compression kernels and the quantized all-reduce: every argument is
// checked here, by name, so the core kernels can trust their callers.
#include <memory>
#include <string>
#include <vector>

#include "../core/compression/error_feedback.h"
#include "../core/compression/quantize.h"
#include "../core/algorithms/between_hosts.h"
#include "../core/algorithms/quantized_all_reduce.h"
#include "../core/algorithms/quantized_direct.h"
#include "../core/compression/top_k.h"
#include "binding_util.h"

namespace braid {
namespace {

const std::initializer_list<at::ScalarType> kFloatTypes = {at::kFloat, at::kBFloat16, at::kHalf};

// A uint8 buffer of exactly `bytes` bytes, 4-byte aligned (the scales are float32).
at::Tensor checked_payload(const py::handle& obj, const char* arg, size_t bytes) {
  at::Tensor q = checked_contiguous(obj, arg, {at::kByte});
  TORCH_CHECK_VALUE(static_cast<size_t>(q.numel()) == bytes,
                    std::string(arg) + " must hold " + std::to_string(bytes) + " bytes, got " +
                    std::to_string(q.numel()));
  TORCH_CHECK_VALUE(!(q.numel() > 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 4 != 0),
                    std::string(arg) + " must be 4-byte aligned (its scales are float32)");
  return q;
}

void check_same_numel(const at::Tensor& a, const char* an, const at::Tensor& b, const char* bn) {
  TORCH_CHECK_VALUE(a.numel() == b.numel(),
                    std::string(bn) + ".numel() must equal " + an + ".numel() (" + std::to_string(a.numel()) +
                    "), got " + std::to_string(b.numel()));
}

at::Tensor quantize_tensor(py::handle input, py::handle residual, int bits, int64_t block, bool stochastic,
                           uint64_t seed, uint64_t index_base, int64_t chunk_arg, int64_t nchunks, py::handle out) {
  const QuantFormat fmt = checked_format(bits, block);
  at::Tensor in = checked_contiguous(input, "input", kFloatTypes);
  const size_t n = static_cast<size_t>(in.numel());
  const size_t chunk = checked_chunk(chunk_arg, nchunks, n, fmt);
  const size_t total = checked_payload_bytes(fmt, chunk, static_cast<size_t>(nchunks));
  float* res = nullptr;
  at::Tensor r;
  if (!residual.is_none()) {
    r = checked_contiguous(residual, "residual", {at::kFloat});
    check_same_numel(in, "input", r, "residual");
    res = r.data_ptr<float>();
  }
  at::Tensor q = out.is_none() ? at::empty({static_cast<int64_t>(total)}, at::kByte)
                               : checked_payload(out, "out", total);
  const DType dt = to_dtype(in.scalar_type(), "input");
  {
    py::gil_scoped_release nogil;
    quantize(fmt, dt, in.data_ptr(), res, n, chunk, static_cast<size_t>(nchunks), stochastic, seed, index_base,
             q.data_ptr<uint8_t>());
  }
  return q;
}

void dequantize_tensor(py::handle payload, int bits, int64_t block, py::handle output, int64_t chunk_arg) {
  const QuantFormat fmt = checked_format(bits, block);
  at::Tensor out = checked_contiguous(output, "output", kFloatTypes);
  const size_t n = static_cast<size_t>(out.numel());
  const int64_t chunks_needed = chunk_arg > 0 ? (static_cast<int64_t>(n) + chunk_arg - 1) / chunk_arg : 1;
  const size_t chunk = checked_chunk(chunk_arg, std::max<int64_t>(chunks_needed, 1), n, fmt);
  const size_t nchunks = chunk == 0 ? 0 : (n + chunk - 1) / chunk;
  at::Tensor q = checked_contiguous(payload, "payload", {at::kByte});
  const size_t need = checked_payload_bytes(fmt, chunk, nchunks);
  TORCH_CHECK_VALUE(static_cast<size_t>(q.numel()) >= need,
                    "payload must hold at least " + std::to_string(need) + " bytes for " + std::to_string(n) +
                    " elements in chunks of " + std::to_string(chunk) + ", got " + std::to_string(q.numel()));
  TORCH_CHECK_VALUE(!(q.numel() > 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 4 != 0),
                    "payload must be 4-byte aligned (its scales are float32)");
  const DType dt = to_dtype(out.scalar_type(), "output");
  py::gil_scoped_release nogil;
  dequantize(fmt, q.data_ptr<uint8_t>(), n, chunk, dt, out.data_ptr());
}

void dequantize_accumulate_tensor(py::handle payload, int bits, int64_t block, py::handle accumulator) {
  const QuantFormat fmt = checked_format(bits, block);
  at::Tensor acc = checked_contiguous(accumulator, "accumulator", {at::kFloat});
  const size_t n = static_cast<size_t>(acc.numel());
  at::Tensor q = checked_payload(payload, "payload", fmt.bytes(n));
  py::gil_scoped_release nogil;
  dequantize_accumulate(fmt, q.data_ptr<uint8_t>(), n, acc.data_ptr<float>());
}

py::tuple top_k_tensor(py::handle input, int64_t k) {
  at::Tensor in = checked_contiguous(input, "input", kFloatTypes);
  TORCH_CHECK_VALUE(k >= 0, "k must be >= 0, got " + std::to_string(k));
  TORCH_CHECK_VALUE(in.numel() <= INT32_MAX, "input has more elements than int32 indices can address");
  const int64_t kk = std::min<int64_t>(k, in.numel());
  at::Tensor values = at::empty({kk}, at::kFloat);
  at::Tensor indices = at::empty({kk}, at::kInt);
  const DType dt = to_dtype(in.scalar_type(), "input");
  TopKPath path;
  {
    py::gil_scoped_release nogil;
    path = top_k_select(dt, in.data_ptr(), static_cast<size_t>(in.numel()), static_cast<size_t>(kk),
                        values.data_ptr<float>(), indices.data_ptr<int32_t>());
  }
  return py::make_tuple(values, indices, path == TopKPath::kExact);
}

void scatter_add_tensor(py::handle accumulator, py::handle indices, py::handle values) {
  at::Tensor acc = checked_contiguous(accumulator, "accumulator", {at::kFloat});
  at::Tensor idx = checked_contiguous(indices, "indices", {at::kInt});
  at::Tensor val = checked_contiguous(values, "values", {at::kFloat});
  check_same_numel(idx, "indices", val, "values");
  if (idx.numel() > 0) {
    // Indices come off the wire: bounds are checked here, once, not trusted.
    const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
    TORCH_CHECK_VALUE(!(lo < 0 || hi >= acc.numel()),
                      "indices must lie in [0, " + std::to_string(acc.numel()) + "), got [" + std::to_string(lo) +
                      ", " + std::to_string(hi) + "]");
  }
  py::gil_scoped_release nogil;
  scatter_add(acc.data_ptr<float>(), idx.data_ptr<int32_t>(), val.data_ptr<float>(), static_cast<size_t>(idx.numel()));
}

void error_feedback_tensor(py::handle input, py::handle residual, py::handle sent) {
  at::Tensor in = checked_contiguous(input, "input", kFloatTypes);
  at::Tensor res = checked_contiguous(residual, "residual", {at::kFloat});
  check_same_numel(in, "input", res, "residual");
  at::Tensor s;
  if (!sent.is_none()) {
    s = checked_contiguous(sent, "sent", {at::kFloat});
    check_same_numel(in, "input", s, "sent");
  }
  const DType dt = to_dtype(in.scalar_type(), "input");
  py::gil_scoped_release nogil;
  error_feedback_update(dt, in.data_ptr(), res.data_ptr<float>(), s.defined() ? s.data_ptr<float>() : nullptr,
                        static_cast<size_t>(in.numel()));
}

void cast_tensor(py::handle input, py::handle residual, py::handle out) {
  at::Tensor in = checked_contiguous(input, "input", kFloatTypes);
  at::Tensor o = checked_contiguous(out, "out", {at::kBFloat16, at::kHalf});
  check_same_numel(in, "input", o, "out");
  at::Tensor res;
  if (!residual.is_none()) {
    res = checked_contiguous(residual, "residual", {at::kFloat});
    check_same_numel(in, "input", res, "residual");
  }
  TORCH_CHECK_VALUE(!(overlaps(in, o) || (res.defined() && overlaps(res, o))),
                    "out must not overlap input or residual");
  const DType dt = to_dtype(in.scalar_type(), "input"), odt = to_dtype(o.scalar_type(), "out");
  py::gil_scoped_release nogil;
  cast_with_feedback(dt, in.data_ptr(), res.defined() ? res.data_ptr<float>() : nullptr, odt, o.data_ptr(),
                     static_cast<size_t>(in.numel()));
}

// The byte buffers of a quantized all-reduce among `n` ranks (`who`: what n counts) hold one
// chunk of `cb` bytes per rank, 4-byte aligned for the scales; the accumulator `chunk` floats.
void check_chunk_buffers(std::initializer_list<std::pair<const at::Tensor*, const char*>> payloads,
                         const at::Tensor& acc, const char* who, size_t n, size_t cb, int64_t chunk) {
  for (auto [t, name] : payloads) {
    TORCH_CHECK_VALUE(static_cast<size_t>(t->numel()) == n * cb,
                      std::string(name) + " must hold " + who + " * " + std::to_string(cb) + " bytes, got " +
                      std::to_string(t->numel()));
    TORCH_CHECK_VALUE(!(t->numel() > 0 && reinterpret_cast<uintptr_t>(t->data_ptr()) % 4 != 0),
                      std::string(name) + " must be 4-byte aligned (its scales are float32)");
  }
  TORCH_CHECK_VALUE(acc.numel() == chunk,
                    "accumulator must hold chunk (" + std::to_string(chunk) + ") floats, got " +
                    std::to_string(acc.numel()));
}

// The middle of a quantized all-reduce as one unit of work (see quantized_all_reduce.h).
py::object quantized_all_reduce_tensors(Communicator& c, py::handle send, py::handle recv, py::handle accumulator,
                                        py::handle gathered, int bits, int64_t block, int64_t chunk, bool average,
                                        bool stochastic, uint64_t seed, bool async, uint32_t tag) {
  const QuantFormat fmt = checked_format(bits, block);
  TORCH_CHECK_VALUE(!(chunk < 0 || chunk % block != 0),
                    "chunk must be a non-negative multiple of block (" + std::to_string(block) + "), got " +
                    std::to_string(chunk));
  const size_t n = static_cast<size_t>(c.world_size());
  const size_t cb = checked_payload_bytes(fmt, static_cast<size_t>(chunk), n) / n;
  at::Tensor s = checked_contiguous(send, "send", {at::kByte});
  at::Tensor r = checked_contiguous(recv, "recv", {at::kByte});
  at::Tensor g = checked_contiguous(gathered, "gathered", {at::kByte});
  at::Tensor acc = checked_contiguous(accumulator, "accumulator", {at::kFloat});
  check_chunk_buffers({{&s, "send"}, {&r, "recv"}, {&g, "gathered"}}, acc, "world_size", n, cb, chunk);
  QuantizedAllReduceArgs a;
  a.fmt = fmt;
  a.chunk = static_cast<size_t>(chunk);
  a.average = average;
  a.stochastic = stochastic;
  a.seed = seed;
  a.tag = tag;
  a.send = s.data_ptr<uint8_t>();
  a.recv = r.data_ptr<uint8_t>();
  a.acc = acc.data_ptr<float>();
  a.gathered = g.data_ptr<uint8_t>();
  auto keep = std::make_shared<std::vector<at::Tensor>>(std::vector<at::Tensor>{s, r, acc, g});
  std::shared_ptr<Work> w;
  {
    py::gil_scoped_release nogil;
    const double ratio = chunk > 0 ? static_cast<double>(cb) / (static_cast<double>(chunk) * 4.0) : -1.0;
    w = c.submit_task([&c, a] { quantized_all_reduce(c, a); }, async ? keep : nullptr, async,
                      {"compressed_all_reduce", DType::kFloat32, static_cast<uint64_t>(chunk) * n, ratio});
  }
  if (!async) return py::none();
  return py::cast(std::make_shared<HostWork>(std::move(w), std::vector<at::Tensor>{g}));
}

// The tensor of an all-reduce that is exact on the host and compressed between hosts, with its
// slice and padded staging (host_compressed_all_reduce): checked here, once.
struct CheckedSlice {
  HostSlice s;
  std::vector<at::Tensor> keep;  // what an async call holds until it is done
};

CheckedSlice checked_slice(Communicator& c, py::handle tensor, py::handle padded, py::handle mine) {
  CheckedSlice out;
  at::Tensor data = checked_contiguous(tensor, "tensor", kFloatTypes);
  const size_t local = static_cast<size_t>(c.scope_size(Scope::kHost));
  const size_t numel = static_cast<size_t>(data.numel());
  const size_t slice = (numel + local - 1) / local;
  at::Tensor m = checked_contiguous(mine, "mine", kFloatTypes);
  at::Tensor p = checked_contiguous(padded, "padded", kFloatTypes);
  TORCH_CHECK_TYPE(!(m.scalar_type() != data.scalar_type() || p.scalar_type() != data.scalar_type()),
                   "mine and padded must have the tensor's dtype");
  TORCH_CHECK_VALUE(static_cast<size_t>(m.numel()) == slice,
                    "mine must hold " + std::to_string(slice) + " elements, got " + std::to_string(m.numel()));
  TORCH_CHECK_VALUE(!(slice * local != numel && static_cast<size_t>(p.numel()) != slice * local),
                    "padded must hold " + std::to_string(slice * local) + " elements, got " +
                    std::to_string(p.numel()));
  out.s.dtype = to_dtype(data.scalar_type(), "tensor");
  out.s.data = data.data_ptr();
  out.s.numel = numel;
  out.s.slice = slice;
  out.s.padded = p.data_ptr();
  out.s.mine = m.data_ptr();
  out.keep = {data, p, m};
  return out;
}

float* checked_slice_floats(py::handle t, const char* name, size_t n, std::vector<at::Tensor>& keep, bool optional) {
  if (optional && t.is_none()) return nullptr;
  at::Tensor r = checked_contiguous(t, name, {at::kFloat});
  TORCH_CHECK_VALUE(static_cast<size_t>(r.numel()) == n,
                    std::string(name) + " must hold " + std::to_string(n) + " floats, got " +
                    std::to_string(r.numel()));
  keep.push_back(r);
  return r.data_ptr<float>();
}

// Runs `between_hosts` inside host_compressed_all_reduce as one unit of work on the communicator.
py::object submit_host_compressed(Communicator& c, CheckedSlice& cs, std::function<void(const HostSlice&)> between_hosts,
                                  bool async, double wire_ratio = -1.0) {
  auto keep = std::make_shared<std::vector<at::Tensor>>(cs.keep);
  const HostSlice s = cs.s;
  std::shared_ptr<Work> w;
  {
    py::gil_scoped_release nogil;
    w = c.submit_task([&c, s, between_hosts] { host_compressed_all_reduce(c, s, [&] { between_hosts(s); }); },
                      async ? keep : nullptr, async, {"compressed_all_reduce", s.dtype, s.numel, wire_ratio});
  }
  if (!async) return py::none();
  return py::cast(std::make_shared<HostWork>(std::move(w), std::vector<at::Tensor>{cs.keep[0]}));
}

// The pipelined quantized all-reduce's settings (quantized_between_hosts), checked.
PipelinedQuantizeArgs checked_pipelined(int bits, int64_t block, int64_t chunk, size_t count, size_t members,
                                        bool average, int divisor, bool stochastic, uint64_t seed,
                                        uint64_t requant_seed) {
  PipelinedQuantizeArgs a;
  a.fmt = checked_format(bits, block);
  TORCH_CHECK_VALUE(!(chunk < block || chunk % block != 0 || static_cast<size_t>(chunk) * members < count),
                    "chunk must be a positive multiple of block (" + std::to_string(block) + ") covering " +
                    std::to_string(count) + " elements over " + std::to_string(members) + " ranks, got " +
                    std::to_string(chunk));
  (void)checked_payload_bytes(a.fmt, static_cast<size_t>(chunk), members);  // sizes fit
  a.chunk = static_cast<size_t>(chunk);
  a.count = count;
  a.average = average;
  a.divisor = divisor;
  a.stochastic = stochastic;
  a.seed = seed;
  a.requant_seed = requant_seed;
  return a;
}

py::object host_quantized_all_reduce_tensors(Communicator& c, py::handle tensor, py::handle residual, py::handle padded,
                                             py::handle mine, int bits, int64_t block, int64_t chunk, bool average,
                                             bool stochastic, uint64_t seed, uint64_t quantize_seed, bool async,
                                             uint32_t tag) {
  CheckedSlice cs = checked_slice(c, tensor, padded, mine);
  const size_t hosts = static_cast<size_t>(c.scope_size(Scope::kCross));
  PipelinedQuantizeArgs a = checked_pipelined(bits, block, chunk, cs.s.slice, hosts, average, c.world_size(),
                                              stochastic, quantize_seed, seed);
  a.residual = checked_slice_floats(residual, "residual", cs.s.slice, cs.keep, true);
  a.dtype = cs.s.dtype;
  a.in = a.out = cs.s.mine;
  const double ratio = static_cast<double>(checked_payload_bytes(a.fmt, a.chunk, 1)) /
                       (static_cast<double>(a.chunk) * static_cast<double>(dtype_size(a.dtype)));
  return submit_host_compressed(
      c, cs, [&c, a, tag](const HostSlice&) { quantized_between_hosts(c, Scope::kCross, tag, a); }, async, ratio);
}

// Every host has one rank: the whole quantized all-reduce between hosts, pipelined.
py::object pipelined_quantized_all_reduce_tensors(Communicator& c, py::handle tensor, py::handle residual, int bits,
                                                  int64_t block, int64_t chunk, bool average, bool stochastic,
                                                  uint64_t seed, uint64_t requant_seed, bool async, uint32_t tag) {
  TORCH_CHECK_VALUE(!(c.topology().num_hosts() != c.world_size() || c.world_size() < 2),
                    "pipelined_quantized_all_reduce needs every rank on a host of its own");
  at::Tensor data = checked_contiguous(tensor, "tensor", kFloatTypes);
  const size_t numel = static_cast<size_t>(data.numel());
  PipelinedQuantizeArgs a = checked_pipelined(bits, block, chunk, numel, static_cast<size_t>(c.world_size()), average,
                                              c.world_size(), stochastic, seed, requant_seed);
  std::vector<at::Tensor> keep{data};
  a.residual = checked_slice_floats(residual, "residual", numel, keep, true);
  a.dtype = to_dtype(data.scalar_type(), "tensor");
  a.in = a.out = data.data_ptr();
  auto held = std::make_shared<std::vector<at::Tensor>>(keep);
  std::shared_ptr<Work> w;
  {
    py::gil_scoped_release nogil;
    const double ratio = static_cast<double>(checked_payload_bytes(a.fmt, a.chunk, 1)) /
                         (static_cast<double>(a.chunk) * static_cast<double>(dtype_size(a.dtype)));
    w = c.submit_task([&c, a, tag] { quantized_between_hosts(c, Scope::kAll, tag, a); }, async ? held : nullptr,
                      async, {"compressed_all_reduce", a.dtype, numel, ratio});
  }
  if (!async) return py::none();
  return py::cast(std::make_shared<HostWork>(std::move(w), std::vector<at::Tensor>{data}));
}

py::object host_top_k_all_reduce_tensors(Communicator& c, py::handle tensor, py::handle residual, py::handle padded,
                                         py::handle mine, py::handle values, py::handle indices, py::handle send,
                                         py::handle gathered, py::handle accumulator, int64_t k, bool sparse,
                                         bool average, bool async, uint32_t tag) {
  CheckedSlice cs = checked_slice(c, tensor, padded, mine);
  const size_t hosts = static_cast<size_t>(c.scope_size(Scope::kCross)), per = cs.s.slice;
  TORCH_CHECK_VALUE(!(k < 1 || static_cast<size_t>(k) > per),
                    "k must be in [1, " + std::to_string(per) + "] (the slice), got " + std::to_string(k));
  TORCH_CHECK_VALUE(per <= static_cast<size_t>(INT32_MAX), "the slice has more elements than int32 indices address");
  SliceTopKArgs a;
  a.k = static_cast<size_t>(k);
  a.sparse = sparse;
  a.average = average;
  a.divisor = c.world_size();
  a.tag = tag;
  a.residual = checked_slice_floats(residual, "residual", per, cs.keep, true);
  a.values = checked_slice_floats(values, "values", a.k, cs.keep, false);
  a.acc = checked_slice_floats(accumulator, "accumulator", per, cs.keep, false);
  at::Tensor idx = checked_contiguous(indices, "indices", {at::kInt});
  at::Tensor s = checked_contiguous(send, "send", {at::kByte});
  at::Tensor g = checked_contiguous(gathered, "gathered", {at::kByte});
  TORCH_CHECK_VALUE(static_cast<size_t>(idx.numel()) == a.k && static_cast<size_t>(s.numel()) == 8 * a.k &&
                        static_cast<size_t>(g.numel()) == hosts * 8 * a.k,
                    "indices, send and gathered must hold k ints, 8 k bytes and hosts * 8 k bytes");
  cs.keep.insert(cs.keep.end(), {idx, s, g});
  a.indices = idx.data_ptr<int32_t>();
  a.send = s.data_ptr<uint8_t>();
  a.gathered = g.data_ptr<uint8_t>();
  return submit_host_compressed(c, cs, [&c, a](const HostSlice& hs) { top_k_between_hosts(c, hs, a); }, async);
}

py::object host_cast_all_reduce_tensors(Communicator& c, py::handle tensor, py::handle residual, py::handle padded,
                                        py::handle mine, py::handle sent, py::handle accumulator, bool average,
                                        bool async) {
  CheckedSlice cs = checked_slice(c, tensor, padded, mine);
  const size_t per = cs.s.slice;
  SliceCastArgs a;
  a.average = average;
  a.divisor = c.world_size();
  a.residual = checked_slice_floats(residual, "residual", per, cs.keep, true);
  a.acc = checked_slice_floats(accumulator, "accumulator", per, cs.keep, false);
  at::Tensor out = checked_contiguous(sent, "sent", {at::kBFloat16, at::kHalf});
  TORCH_CHECK_VALUE(static_cast<size_t>(out.numel()) == per,
                    "sent must hold the slice's " + std::to_string(per) + " elements, got " +
                    std::to_string(out.numel()));
  cs.keep.push_back(out);
  a.wire = to_dtype(out.scalar_type(), "sent");
  a.sent = out.data_ptr();
  return submit_host_compressed(c, cs, [&c, a](const HostSlice& hs) { cast_between_hosts(c, hs, a); }, async);
}

}  // namespace

void bind_compression(py::module_& m, py::class_<Communicator, std::shared_ptr<Communicator>>& communicator) {
  m.def("quantized_bytes",
        [](int64_t count, int bits, int64_t block) {
          TORCH_CHECK_VALUE(count >= 0, "count must be >= 0");
          return checked_payload_bytes(checked_format(bits, block), static_cast<size_t>(count), 1);
        },
        py::arg("count"), py::arg("bits"), py::arg("block"));
  m.def("quantize", &quantize_tensor, py::arg("input"), py::arg("residual"), py::arg("bits"), py::arg("block"),
        py::arg("stochastic"), py::arg("seed"), py::arg("index_base") = 0, py::arg("chunk") = 0, py::arg("nchunks") = 1,
        py::arg("out") = py::none());
  m.def("dequantize", &dequantize_tensor, py::arg("payload"), py::arg("bits"), py::arg("block"), py::arg("output"),
        py::arg("chunk") = 0);
  m.def("dequantize_accumulate", &dequantize_accumulate_tensor, py::arg("payload"), py::arg("bits"), py::arg("block"),
        py::arg("accumulator"));
  m.def("top_k", &top_k_tensor, py::arg("input"), py::arg("k"));
  m.def("scatter_add", &scatter_add_tensor, py::arg("accumulator"), py::arg("indices"), py::arg("values"));
  m.def("error_feedback", &error_feedback_tensor, py::arg("input"), py::arg("residual"), py::arg("sent"));
  m.def("cast", &cast_tensor, py::arg("input"), py::arg("residual"), py::arg("out"));
  communicator.def("quantized_all_reduce", &quantized_all_reduce_tensors, py::arg("send"), py::arg("recv"),
                   py::arg("accumulator"), py::arg("gathered"), py::arg("bits"), py::arg("block"), py::arg("chunk"),
                   py::arg("average"), py::arg("stochastic"), py::arg("seed"), py::arg("async_op"),
                   py::arg("tag") = 0);
  communicator.def("host_quantized_all_reduce", &host_quantized_all_reduce_tensors, py::arg("tensor"),
                   py::arg("residual"), py::arg("padded"), py::arg("mine"), py::arg("bits"), py::arg("block"),
                   py::arg("chunk"), py::arg("average"), py::arg("stochastic"), py::arg("seed"),
                   py::arg("quantize_seed"), py::arg("async_op"), py::arg("tag") = 0);
  communicator.def("pipelined_quantized_all_reduce", &pipelined_quantized_all_reduce_tensors, py::arg("tensor"),
                   py::arg("residual"), py::arg("bits"), py::arg("block"), py::arg("chunk"), py::arg("average"),
                   py::arg("stochastic"), py::arg("seed"), py::arg("requant_seed"), py::arg("async_op"),
                   py::arg("tag") = 0);
  communicator.def("host_top_k_all_reduce", &host_top_k_all_reduce_tensors, py::arg("tensor"), py::arg("residual"),
                   py::arg("padded"), py::arg("mine"), py::arg("values"), py::arg("indices"), py::arg("send"),
                   py::arg("gathered"), py::arg("accumulator"), py::arg("k"), py::arg("sparse"), py::arg("average"),
                   py::arg("async_op"), py::arg("tag") = 0);
  communicator.def("host_cast_all_reduce", &host_cast_all_reduce_tensors, py::arg("tensor"), py::arg("residual"),
                   py::arg("padded"), py::arg("mine"), py::arg("sent"), py::arg("accumulator"), py::arg("average"),
                   py::arg("async_op"));
  communicator.def_property_readonly("uniform_hosts", [](const Communicator& c) { return c.topology().uniform(); });
}

}  // namespace braid
