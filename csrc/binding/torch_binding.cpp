// The extension module braid.comm._C: the communicator's Python methods (argument checks at the
// boundary, tensors to raw pointers, futures for async work) and core errors mapped to braid.comm's
// Python exception classes. The other binding files (csrc/binding/) include torch as well: the
// torch.distributed backend (backend.cpp), compression, CUDA builds' parts, and the helpers they
// share (binding_util.h).
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sparse_coo_tensor.h>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../core/communicator.h"
#include "../core/interrupt.h"
#include "../core/reduce.h"
#include "../core/tunables.h"
#include "backend.h"
#include "binding_util.h"

namespace py = pybind11;

namespace braid {
namespace {

// BRAID_TRACE_STACK=1 (read at import, or set_trace_stack()): the flight recorder keeps the
// Python stack of each call issued here.
bool g_trace_stack = false;

std::string python_stack() {
  try {
    std::string out;
    for (py::handle line : py::module_::import("traceback").attr("format_stack")()) out += line.cast<std::string>();
    return out;
  } catch (const py::error_already_set&) {
    return {};
  }
}

// An async CPU request's copy back into the caller's tensor (where `output` is not contiguous) and
// what it keeps alive until it completes: the output's buffer and the contiguous input.
void prepare_async(Request& req, const Contiguous* output, const at::Tensor* input) {
  if (output != nullptr && output->copy_back()) req.epilogue = [s = *output] { s.user.copy_(s.buffer); };
  auto keep = std::make_shared<std::vector<at::Tensor>>();
  if (output != nullptr) keep->push_back(output->buffer);
  if (input != nullptr) keep->push_back(*input);
  req.keepalive = std::move(keep);
}

// Sends a request to the core, by the device of its tensors (collective_device): CPU tensors
// straight, CUDA tensors through the staging pipeline (dispatch_cuda). Returns a HostWork (a
// CudaWork) for async calls, None otherwise. `output` is the output and its contiguous copy (or
// nothing, for barrier); `input` the contiguous input of out-of-place collectives. The blocking
// CPU path allocates nothing here: it is the latency of every small collective.
py::object dispatch(Communicator& c, Request req, bool async, const Contiguous* output, const at::Tensor* input,
                    c10::Device device = c10::Device(c10::kCPU)) {
  if (g_trace_stack) req.trace_stack = python_stack();
#ifdef BRAID_WITH_CUDA
  if (device.is_cuda()) return dispatch_cuda(c, device, std::move(req), *output, input ? *input : at::Tensor(), async);
#endif
  if (!async) {
    if (output != nullptr && output->copy_back()) req.epilogue = [s = *output] { s.user.copy_(s.buffer); };
    py::gil_scoped_release nogil;
    c.submit(std::move(req), false);
    return py::none();
  }
  prepare_async(req, output, input);
  std::shared_ptr<Work> w;
  {
    py::gil_scoped_release nogil;
    w = c.submit(std::move(req), true);
  }
  std::vector<at::Tensor> outputs;
  if (output != nullptr) outputs.push_back(output->user);
  return py::cast(std::make_shared<HostWork>(std::move(w), std::move(outputs)));
}

py::object all_reduce(Communicator& c, py::handle tensor, int op, bool async) {
  RECORD_USER_SCOPE("braid::all_reduce");  // a named range in torch.profiler traces
  at::Tensor t = dense_tensor(tensor, "tensor");
  const c10::Device device = collective_device({{&t, "tensor"}});
  Contiguous s = contiguous_output(t, "tensor");
  Request r = make_request(CollKind::kAllReduce, to_dtype(t.scalar_type(), "tensor"), static_cast<size_t>(t.numel()),
                           s.buffer.data_ptr(), s.buffer.data_ptr());
  r.op = to_op(op, r.dtype, "tensor");
  return dispatch(c, std::move(r), async, &s, nullptr, device);
}

py::object reduce_scatter(Communicator& c, py::handle output, py::handle input, int op, bool async) {
  RECORD_USER_SCOPE("braid::reduce_scatter");  // a named range in torch.profiler traces
  at::Tensor out = dense_tensor(output, "output");
  at::Tensor in = dense_tensor(input, "input");
  const c10::Device device = collective_device({{&out, "output"}, {&in, "input"}});
  check_whole_and_part(out, in, in, "input", out, "output", c.world_size());
  const DType dtype = to_dtype(out.scalar_type(), "output");
  const ReduceOp rop = to_op(op, dtype, "output");
  at::Tensor in_c = in.contiguous();
  Contiguous s = contiguous_output(out, "output");
  check_aliasing(in_c, "input", s.buffer, "output", c.rank());
  Request r = make_request(CollKind::kReduceScatter, dtype, static_cast<size_t>(out.numel()), in_c.data_ptr(),
                           s.buffer.data_ptr());
  r.op = rop;
  return dispatch(c, std::move(r), async, &s, &in_c, device);
}

py::object all_gather(Communicator& c, py::handle output, py::handle input, bool async, uint32_t tag) {
  RECORD_USER_SCOPE("braid::all_gather");  // a named range in torch.profiler traces
  at::Tensor out = dense_tensor(output, "output");
  at::Tensor in = dense_tensor(input, "input");
  const c10::Device device = collective_device({{&out, "output"}, {&in, "input"}});
  check_whole_and_part(out, in, out, "output", in, "input", c.world_size());
  const DType dtype = to_dtype(out.scalar_type(), "output");
  Contiguous s = contiguous_output(out, "output");
  at::Tensor in_c = in.contiguous();
  check_aliasing(s.buffer, "output", in_c, "input", c.rank());
  Request r = make_request(CollKind::kAllGather, dtype, static_cast<size_t>(in.numel()), in_c.data_ptr(),
                           s.buffer.data_ptr());
  r.tag = tag;
  return dispatch(c, std::move(r), async, &s, &in_c, device);
}

py::object all_to_all(Communicator& c, py::handle output, py::handle input, bool async) {
  RECORD_USER_SCOPE("braid::all_to_all");  // a named range in torch.profiler traces
  at::Tensor out = dense_tensor(output, "output");
  at::Tensor in = dense_tensor(input, "input");
  const c10::Device device = collective_device({{&out, "output"}, {&in, "input"}});
  check_all_to_all(out, in, c.world_size());
  const DType dtype = to_dtype(out.scalar_type(), "output");
  Contiguous s = contiguous_output(out, "output");
  at::Tensor in_c = in.contiguous();
  Request r = make_request(CollKind::kAllToAll, dtype, static_cast<size_t>(in.numel() / c.world_size()),
                           in_c.data_ptr(), s.buffer.data_ptr());
  return dispatch(c, std::move(r), async, &s, &in_c, device);
}

// all_to_all with split sizes: rank j receives rows [sum(input_splits[:j]), ...) of this rank's
// input; the pieces from each rank land in rank order in `output`. Point-to-point underneath.
py::object all_to_all_v(Communicator& c, py::handle output, py::handle input,
                        const std::optional<std::vector<int64_t>>& output_splits,
                        const std::optional<std::vector<int64_t>>& input_splits, bool async) {
  RECORD_USER_SCOPE("braid::all_to_all_v");  // a named range in torch.profiler traces
  at::Tensor out = dense_tensor(output, "output");
  at::Tensor in = dense_tensor(input, "input");
  [[maybe_unused]] const c10::Device device = collective_device({{&out, "output"}, {&in, "input"}});
  const SplitCounts counts = checked_split_counts(out, in, output_splits ? &*output_splits : nullptr,
                                                  input_splits ? &*input_splits : nullptr, c.rank(), c.world_size(), "");
  TORCH_CHECK_VALUE(!overlaps(out, in), "output must not overlap input (all_to_all is never in place)");
  const DType dtype = to_dtype(out.scalar_type(), "output");
  Contiguous s = contiguous_output(out, "output");
  at::Tensor in_c = in.contiguous();
#ifdef BRAID_WITH_CUDA
  if (device.is_cuda()) return all_to_all_v_cuda(c, device, s, in_c, counts, async);
#endif
  auto keep = std::make_shared<std::vector<at::Tensor>>(std::vector<at::Tensor>{in_c, s.buffer});
  ExchangePlan plan = plan_uneven_all_to_all(c.rank(), c.world_size(), dtype, in_c, s.buffer, s.user, counts);
  std::shared_ptr<Work> w;
  {
    py::gil_scoped_release nogil;
    w = c.submit_exchange(dtype, std::move(plan.requests), std::move(plan.epilogue), keep, async);
  }
  if (!async) return py::none();
  return py::cast(std::make_shared<HostWork>(std::move(w), std::vector<at::Tensor>{s.user}));
}

py::object broadcast(Communicator& c, py::handle tensor, int src, bool async) {
  RECORD_USER_SCOPE("braid::broadcast");  // a named range in torch.profiler traces
  at::Tensor t = dense_tensor(tensor, "tensor");
  const c10::Device device = collective_device({{&t, "tensor"}});
  TORCH_CHECK_VALUE(!(src < 0 || src >= c.world_size()),
                    "src must be a rank in [0, " + std::to_string(c.world_size()) + "), got " + std::to_string(src));
  const DType dtype = to_dtype(t.scalar_type(), "tensor");
  Contiguous s = contiguous_output(t, "tensor");
  Request r = make_request(CollKind::kBroadcast, dtype, static_cast<size_t>(t.numel()), s.buffer.data_ptr(),
                           s.buffer.data_ptr());
  r.root = src;
  return dispatch(c, std::move(r), async, &s, nullptr, device);
}

// Point-to-point: one transfer of `tensor` to (send) or from rank `peer`. Transfers between two
// ranks are matched in issue order per direction (no tags); the receiver checks that dtype and
// element count agree with the sender's. `arg` and `peer_arg` name the arguments in errors.
struct P2PTransfer {
  Request req;
  Contiguous tensor;  // the tensor and its contiguous copy (recv: written, then copied back)
};

P2PTransfer make_p2p(const Communicator& c, bool send, py::handle tensor, int peer, const std::string& arg,
                     const std::string& peer_arg) {
  at::Tensor t = as_tensor(tensor, arg.c_str());
  TORCH_CHECK_VALUE(!(peer < 0 || peer >= c.world_size() || peer == c.rank()),
                    peer_arg + " must be another rank in [0, " + std::to_string(c.world_size()) +
                    "), not this rank (" + std::to_string(c.rank()) + "), got " + std::to_string(peer));
  P2PTransfer p;
  p.tensor = send ? as_contiguous(t) : contiguous_output(t, arg.c_str());
  void* data = p.tensor.buffer.data_ptr();
  p.req = make_request(send ? CollKind::kSend : CollKind::kRecv, to_dtype(t.scalar_type(), arg.c_str()),
                       static_cast<size_t>(t.numel()), send ? data : nullptr, send ? nullptr : data);
  p.req.peer = peer;
  return p;
}

// A send keeps its contiguous input alive and copies nothing back; a receive copies a contiguous
// result into the caller's tensor.
py::object submit_p2p(Communicator& c, P2PTransfer p, bool async) {
  if (p.req.kind == CollKind::kSend) return dispatch(c, std::move(p.req), async, nullptr, &p.tensor.buffer);
  return dispatch(c, std::move(p.req), async, &p.tensor, nullptr);
}

py::object send_tensor(Communicator& c, py::handle tensor, int dst, bool async) {
  RECORD_USER_SCOPE("braid::send");  // a named range in torch.profiler traces
  return submit_p2p(c, make_p2p(c, true, tensor, dst, "tensor", "dst"), async);
}

py::object recv_tensor(Communicator& c, py::handle tensor, int src, bool async) {
  RECORD_USER_SCOPE("braid::recv");  // a named range in torch.profiler traces
  return submit_p2p(c, make_p2p(c, false, tensor, src, "tensor", "src"), async);
}

// Several transfers posted together, each async (the progress thread advances all of them at once,
// so a ring exchange of large messages cannot block on its own send). Every one is checked before
// any is posted. `ops`: (is_send, tensor, peer) tuples; returns one work per transfer.
std::vector<py::object> p2p_batch(Communicator& c, const std::vector<std::tuple<bool, py::object, int>>& ops) {
  std::vector<P2PTransfer> transfers;
  transfers.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& [is_send, tensor, peer] = ops[i];
    const std::string where = "ops[" + std::to_string(i) + "]";
    transfers.push_back(make_p2p(c, is_send, tensor, peer, where + ".tensor", where + ".peer"));
  }
  std::vector<py::object> works;
  works.reserve(transfers.size());
  for (auto& p : transfers) works.push_back(submit_p2p(c, std::move(p), true));
  return works;
}

// A send of `send` to `dst` and a receive into `recv` from `src`, posted together on host tensors
// (the Python Communicator stages CUDA tensors itself): one work that completes with both. The
// latency path of every ring step and pipeline hand-over: one call, one release of the GIL.
py::object send_recv(Communicator& c, py::handle send, int dst, py::handle recv, int src) {
  RECORD_USER_SCOPE("braid::send_recv");  // a named range in torch.profiler traces
  P2PTransfer s = make_p2p(c, true, send, dst, "send", "dst");
  P2PTransfer r = make_p2p(c, false, recv, src, "recv", "src");
  TORCH_CHECK_VALUE(s.tensor.user.device().is_cpu(), "send must be a CPU tensor here, got one on ",
                    s.tensor.user.device().str());
  TORCH_CHECK_VALUE(r.tensor.user.device().is_cpu(), "recv must be a CPU tensor here, got one on ",
                    r.tensor.user.device().str());
  if (g_trace_stack) s.req.trace_stack = r.req.trace_stack = python_stack();
  prepare_async(s.req, nullptr, &s.tensor.buffer);
  prepare_async(r.req, &r.tensor, nullptr);
  std::shared_ptr<Work> sent, received;
  {
    py::gil_scoped_release nogil;
    sent = c.submit(std::move(s.req), true);
    received = c.submit(std::move(r.req), true);
  }
  return py::cast(
      std::make_shared<HostWork>(std::move(received), std::vector<at::Tensor>{r.tensor.user}, std::move(sent)));
}

py::object barrier(Communicator& c, bool async) {
  RECORD_USER_SCOPE("braid::barrier");  // a named range in torch.profiler traces
  return dispatch(c, make_request(CollKind::kBarrier, DType::kFloat32, 0), async, nullptr, nullptr);
}

// Reduces `inputs` (same shape and dtype, contiguous) into a new tensor with the core kernel, in
// list order: lets tests check the kernel against torch without a communicator.
at::Tensor reduce_tensors(const std::vector<at::Tensor>& inputs, int op, int world_size) {
  TORCH_CHECK_VALUE(!inputs.empty(), "inputs must not be empty");
  std::vector<at::Tensor> cs;
  std::vector<Operand> srcs;
  for (const auto& t : inputs) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), "inputs must be CPU tensors");
    TORCH_CHECK_VALUE(!(t.sizes() != inputs[0].sizes() || t.scalar_type() != inputs[0].scalar_type()),
                      "inputs must share shape and dtype");
    cs.push_back(t.contiguous());
    srcs.push_back({cs.back().data_ptr(), false});
  }
  at::Tensor out = at::empty_like(cs[0]);
  reduce_n(to_dtype(out.scalar_type(), "inputs"), to_op(op, to_dtype(out.scalar_type(), "inputs"), "inputs"), srcs.data(), static_cast<int>(srcs.size()),
           ReduceDst::result(out.data_ptr(), world_size), static_cast<size_t>(out.numel()));
  return out;
}

// Ctrl-C during a long wait (core/interrupt.h). Python runs signal handlers on its main thread
// only; there the hook runs them, and an exception one raises (KeyboardInterrupt) is kept until
// the wait has unwound to the exception translator, which raises it instead of the core's error.
unsigned long g_main_thread = 0;

struct PendingError {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};
thread_local PendingError t_pending;

bool run_python_signal_handlers() {
  if (static_cast<unsigned long>(::pthread_self()) != g_main_thread) return false;
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  Py_XDECREF(t_pending.type);
  Py_XDECREF(t_pending.value);
  Py_XDECREF(t_pending.traceback);
  PyErr_Fetch(&t_pending.type, &t_pending.value, &t_pending.traceback);
  return true;
}

// With the GIL held: makes the exception a signal handler raised the current Python error.
bool restore_pending_error() {
  if (t_pending.type == nullptr) return false;
  PyErr_Restore(t_pending.type, t_pending.value, t_pending.traceback);
  t_pending = PendingError{};
  return true;
}

}  // namespace
}  // namespace braid

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace braid;
  m.doc() = "braid core: shared-memory collectives (torch binding)";
  if (const char* s = std::getenv("BRAID_TRACE_STACK")) g_trace_stack = std::string(s) == "1";
  m.def("set_trace_stack", [](bool on) { g_trace_stack = on; }, py::arg("on"),
        "Whether the flight recorder keeps each call's Python stack (BRAID_TRACE_STACK=1 at import).");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CommError& e) {
      if (restore_pending_error()) return;
      py::object errors = py::module_::import("braid.comm.core.errors");
      py::object cls = errors.attr(error_class_name(e.kind()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  set_interrupt_hook(&run_python_signal_handlers);

  py::class_<Tunables>(m, "Tunables")
      .def(py::init<>())
      .def_static("from_env", &Tunables::from_env)
      .def("resolve", &Tunables::resolve, py::arg("local_world_size"), py::arg("host_cores") = 0,
           "Fills in the defaults that depend on the number of local ranks and the host (host_cores: "
           "the CPUs the host's ranks may run on together; 0: this process's own).")
      .def_property(
          "algo", [](const Tunables& t) { return std::string(algo_name(t.algo)); },
          [](Tunables& t, const std::string& s) { t.algo = parse_algo(s); })
      .def_readwrite("oneshot_max_bytes", &Tunables::oneshot_max_bytes)
      .def_readwrite("slot_bytes", &Tunables::slot_bytes)
      .def_readwrite("nslots", &Tunables::nslots)
      .def_readwrite("stream_min_bytes", &Tunables::stream_min_bytes)
      .def_readwrite("spin_us", &Tunables::spin_us)
      .def_readwrite("yield_us", &Tunables::yield_us)
      .def_readwrite("skew_rounds", &Tunables::skew_rounds)
      .def(
          "validate",
          [](Tunables t) {  // a copy: the defaults that depend on the host stay unresolved
            t.resolve(1);
            t.validate();
          },
          "Raises ValueError naming the first knob out of its range.")
      .def_readwrite("nsocks", &Tunables::nsocks)
      .def_readwrite("tcp_lazy", &Tunables::tcp_lazy)
      .def_readwrite("socket_chunk_bytes", &Tunables::socket_chunk_bytes)
      .def_readwrite("cross_oneshot_max_bytes", &Tunables::cross_oneshot_max_bytes)
      .def_readwrite("cross_doubling_min_hosts", &Tunables::cross_doubling_min_hosts)
      .def_readwrite("cross_piece_bytes", &Tunables::cross_piece_bytes)
      .def_readwrite("trace_buffer", &Tunables::trace_buffer);

  py::class_<HostWork, std::shared_ptr<HostWork>>(m, "Work")
      .def("wait", &HostWork::wait, py::arg("timeout") = py::none())
      .def("is_completed", &HostWork::is_completed)
      .def("is_success", &HostWork::is_success)
      .def("exception_message", &HostWork::exception_message)
      .def("completed_at", &HostWork::completed_at,
           "When it completed, in time.perf_counter()'s seconds (the steady clock); None before.")
      .def("get_future", [](HostWork& w) { return python_future(w.future()); });

  py::class_<Communicator, std::shared_ptr<Communicator>> communicator(m, "Communicator");
  communicator
      .def(py::init([](int rank, int world_size, Tunables tunables, double timeout_s, std::vector<int> host_ids) {
             return python_owned(new Communicator(rank, world_size, tunables, timeout_s, std::move(host_ids)));
           }),
           py::arg("rank"), py::arg("world_size"),
           py::arg("tunables"), py::arg("timeout_s"), py::arg("host_ids") = std::vector<int>{})
      .def_property_readonly("local_rank", [](const Communicator& c) { return c.topology().local_rank(); })
      .def_property_readonly("local_world_size", [](const Communicator& c) { return c.topology().local_world(); })
      .def_property_readonly("num_hosts", [](const Communicator& c) { return c.topology().num_hosts(); })
      .def("listen_tcp",
           [](Communicator& c, const std::string& bind_ip, const py::bytes& secret) {
             const std::string s = secret;
             return c.listen_tcp(bind_ip, std::vector<uint8_t>(s.begin(), s.end()));
           })
      .def("connect_tcp", &Communicator::connect_tcp, py::arg("endpoints"), py::arg("labels"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_trace_identity",
           [](Communicator& c, const std::string& comm_id, std::vector<int> hosts, const std::string& hostname,
              const std::string& version) { c.set_trace_identity({comm_id, std::move(hosts), hostname, version}); },
           py::arg("comm_id"), py::arg("hosts"), py::arg("hostname"), py::arg("version"))
      .def("dump_trace", &Communicator::dump_trace, py::arg("directory"), py::arg("reason"),
           py::call_guard<py::gil_scoped_release>())
      .def("trace_json", &Communicator::trace_json, py::arg("reason"))
      .def_property_readonly("trace_dir", &Communicator::trace_dir)
      .def_property("trace_enabled", &Communicator::trace_enabled, &Communicator::set_trace_enabled)
      .def_property_readonly("tcp_bytes_sent", &Communicator::tcp_bytes_sent)
      .def_property_readonly("tcp_peers", &Communicator::tcp_peers)
      .def_property_readonly("tcp_sockets", &Communicator::tcp_sockets)
      .def_property_readonly("tcp_bytes_received", &Communicator::tcp_bytes_received)
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def_property_readonly("seq", &Communicator::seq)
      .def_property_readonly("closed", &Communicator::closed)
      .def("on_progress_thread", &Communicator::on_progress_thread)
      .def_property_readonly("tunables", &Communicator::tunables)
      .def("segment_name", &Communicator::segment_name)
      .def("attach",
           [](Communicator& c, const std::vector<std::tuple<std::string, int, std::string>>& peers) {
             std::vector<PeerInfo> infos;
             for (const auto& [seg, pid, host] : peers) infos.push_back(PeerInfo{seg, static_cast<pid_t>(pid), host});
             py::gil_scoped_release nogil;
             c.attach(infos);
           })
      .def("unlink_own", &Communicator::unlink_own)
      // Registered buffers (ShmGroup's windows; comm/core/windows.py runs the steps).
      .def("window_create",
           [](Communicator& c, int64_t id, size_t bytes) -> std::string {
             ShmGroup* g = c.host_group();
             return g ? g->window_create(id, bytes) : std::string();
           })
      .def("window_attach",
           [](std::shared_ptr<Communicator> c, int64_t id, const std::vector<std::string>& names) {
             ShmGroup* g = c->host_group();
             TORCH_CHECK(g != nullptr, "window_attach: the communicator has no other rank on this host or is closed");
             std::shared_ptr<const ShmWindow> w = g->window_attach(id, names);
             const int me = g->rank();
             // The tensor holds the mappings; its storage's end takes the window out of the registry.
             return at::from_blob(
                 w->bases[me], {static_cast<int64_t>(w->bytes)},
                 [c, w, id](void*) {
                   if (ShmGroup* group = c->host_group()) group->window_free(id);
                 },
                 at::TensorOptions().dtype(at::kByte));
           })
      .def("window_free",
           [](Communicator& c, int64_t id) {
             if (ShmGroup* g = c.host_group()) g->window_free(id);
           })
      .def("window_unlink",
           [](Communicator& c, int64_t id) {
             if (ShmGroup* g = c.host_group()) g->window_unlink(id);
           })
      .def("all_reduce_algo", [](const Communicator& c, size_t bytes) { return std::string(algo_name(c.all_reduce_algo(bytes))); })
      .def("all_reduce", &all_reduce, py::arg("tensor"), py::arg("op"), py::arg("async_op"))
      .def("reduce_scatter", &reduce_scatter, py::arg("output"), py::arg("input"), py::arg("op"), py::arg("async_op"))
      .def("all_gather", &all_gather, py::arg("output"), py::arg("input"), py::arg("async_op"),
           py::arg("tag") = 0)
      .def("all_to_all", &all_to_all, py::arg("output"), py::arg("input"), py::arg("async_op"))
      .def("all_to_all_v", &all_to_all_v, py::arg("output"), py::arg("input"), py::arg("output_split_sizes"),
           py::arg("input_split_sizes"), py::arg("async_op"))
      .def("broadcast", &broadcast, py::arg("tensor"), py::arg("src"), py::arg("async_op"))
      .def("barrier", &barrier, py::arg("async_op"))
      .def("send", &send_tensor, py::arg("tensor"), py::arg("dst"), py::arg("async_op"))
      .def("recv", &recv_tensor, py::arg("tensor"), py::arg("src"), py::arg("async_op"))
      .def("p2p_batch", &p2p_batch, py::arg("ops"))
      .def("send_recv", &send_recv, py::arg("send"), py::arg("dst"), py::arg("recv"), py::arg("src"))
      .def("close", &Communicator::close, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Communicator::abort, py::call_guard<py::gil_scoped_release>());

  // The core's names, for the Python side's checks and tables (comm/core/vocabulary.py, communicator.py).
  py::list algorithms;
  for (int i = 0; i < kNumAlgos; ++i) algorithms.append(algo_name(static_cast<Algo>(i)));
  m.attr("ALGORITHMS") = py::tuple(algorithms);
  py::dict reduce_ops;
  for (int i = 0; i < kNumReduceOps; ++i) reduce_ops[reduce_op_name(static_cast<ReduceOp>(i))] = i;
  m.attr("REDUCE_OPS") = reduce_ops;
  // Limits the Python side checks against (one statement of each, in the core).
  m.attr("MAX_TIMEOUT_S") = kMaxTimeoutSeconds;
  m.attr("MAX_QUANT_BLOCK") = kMaxQuantBlock;
  m.def("env_bytes", [](const std::string& name, size_t dflt) { return env_bytes(name.c_str(), dflt); },
        py::arg("name"), py::arg("default"),
        "The byte count in environment variable `name` (digits with an optional K, M or G suffix), "
        "`default` when it is unset or empty; ValueError naming it when malformed.");

  register_backend(m);

  bind_compression(m, communicator);
  bind_optim(m);
#ifdef BRAID_WITH_CUDA
  bind_cuda_compression(m);
  bind_cuda_comm(m, communicator);
  m.attr("has_cuda_kernels") = true;
#else
  m.attr("has_cuda_kernels") = false;
#endif
  m.def(
      "interface_address",
      [](const std::string& spec, bool ipv6) { return interface_address(spec, ipv6 ? AF_INET6 : AF_INET); },
      py::arg("spec"), py::arg("ipv6") = false,
        "The address of the first interface that is up and matches a BRAID_SOCKET_IFNAME spec.");
  m.def("route_address", &route_address, py::arg("host"),
        "The local address the kernel would use to reach `host`.");
  m.def("reduce_tensors", &reduce_tensors, py::arg("inputs"), py::arg("op"), py::arg("world_size") = 1);
}
