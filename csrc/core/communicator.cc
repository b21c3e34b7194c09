// Communicator: turns requests into collective descriptors, picks algorithms, poisons itself on
// the first communication error and tells the peers about it.
// Point-to-point is in p2p.cc, collectives across hosts in cross_host.cc.
#include "communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "algorithms/algorithms.h"
#include "interrupt.h"
#include "reduce.h"
#include "thread_name.h"

namespace braid {

CollectiveDesc describe_request(const Request& r, uint64_t seq) {
  CollectiveDesc d;
  d.seq = seq;
  d.count = r.count;
  d.kind = static_cast<uint8_t>(r.kind);
  d.dtype = static_cast<uint8_t>(r.dtype);
  d.op = static_cast<uint8_t>(r.op);
  const bool tagged = r.kind == CollKind::kAllGather || r.kind == CollKind::kAllToAll;
  d.root = tagged ? r.tag : static_cast<uint32_t>(r.rank_named());
  return d;
}

Communicator::Communicator(int rank, int world_size, Tunables tunables, double timeout_s, std::vector<int> host_ids)
    : rank_(rank),
      world_(world_size),
      tun_(tunables),
      given_(tunables),
      owner_pid_(static_cast<int>(::getpid())),
      // Past the bound nothing is allocated: validate() below raises for it.
      trace_(tunables.trace_buffer <= Tunables::kMaxTraceBuffer ? tunables.trace_buffer : 0) {
  if (world_size < 1) throw std::invalid_argument("world_size must be >= 1");
  if (rank < 0 || rank >= world_size) throw std::invalid_argument("rank must be in [0, world_size)");
  if (!host_ids.empty() && static_cast<int>(host_ids.size()) != world_size)
    throw std::invalid_argument("host_ids needs one entry per rank");
  topo_ = host_ids.empty() ? Topology::single_host(rank, world_size) : Topology::from_host_ids(rank, host_ids);
  const int local_world = topo_.local_world();
  if (local_world > kMaxLocalRanks)
    throw std::invalid_argument("at most " + std::to_string(kMaxLocalRanks) + " ranks may share one host, got " +
                                std::to_string(local_world));
  if (!(timeout_s > 0)) throw std::invalid_argument("timeout must be positive");
  tun_.resolve(local_world);
  tun_.validate();
  oneshot_max_ = static_cast<size_t>(tun_.oneshot_max_bytes);
  const double capped_s = std::min(timeout_s, kMaxTimeoutSeconds);
  timeout_ = std::chrono::nanoseconds(static_cast<int64_t>(capped_s * 1e9));
  if (local_world > 1) {
    ShmLayout layout{oneshot_max_, tun_.slot_bytes, tun_.nslots, local_world};
    WaitPolicy policy;
    policy.spin = std::chrono::nanoseconds(static_cast<int64_t>(tun_.spin_us * 1e3));
    policy.yield = std::chrono::nanoseconds(static_cast<int64_t>(tun_.yield_us * 1e3));
    policy.timeout = timeout_;
    group_ = std::make_unique<ShmGroup>(topo_.local_rank(), local_world, layout, policy, tun_.stream_min_bytes,
                                        tun_.skew_rounds != 0);
    if (topo_.multi_host()) group_->set_global_ranks(topo_.hosts[static_cast<size_t>(topo_.host)]);
    group_->set_p2p_window_min_bytes(tun_.p2p_window_min_bytes);
  }
  if (world_ > 1) {
    engine_->set_p2p_runner([this](std::vector<std::shared_ptr<Work>>& batch) { run_p2p(batch); });
    engine_->set_p2p_here_runner(
        [this](std::vector<std::shared_ptr<Work>>& batch, const Work* until) { run_p2p(batch, until); });
  }
  if (const char* dir = std::getenv("BRAID_TRACE_DIR")) trace_dir_ = dir;
  install_trace_signal();
}

Communicator::~Communicator() {
  if (!closed_.load() && !in_forked_child() && engine_ && engine_->on_progress_thread()) {
    // The last reference went away inside a callback on the progress thread, which is running
    // here: it cannot be joined from itself, and the queued works still use the engine and the
    // group. Both are left behind (the thread ends once its queue is empty); the peers learn
    // nothing until their own deadline. Python's finalizer closes on another thread instead.
    closed_.store(true);
    stop_watcher();
    engine_.release()->stop_detached();
    (void)group_.release();
    (void)tcp_.release();
    return;
  }
  try {
    close();
  } catch (...) {  // only a re-entrant close() throws, and nothing can destroy a communicator in use
  }
}

std::string Communicator::segment_name() const { return group_ ? group_->segment_name() : std::string(); }

void Communicator::attach(const std::vector<PeerInfo>& peers) {
  if (!group_) return;
  if (static_cast<int>(peers.size()) != world_)
    throw std::invalid_argument("attach needs one PeerInfo per rank");
  std::vector<PeerInfo> local;
  for (int r : topo_.hosts[static_cast<size_t>(topo_.host)]) local.push_back(peers[static_cast<size_t>(r)]);
  group_->attach(local);
  // The constructor guessed from this process's CPUs alone; ranks pinned one per core see one
  // each. Decide again from the union of the host's ranks' CPUs (the knobs set in the
  // environment stay as set), before the first collective.
  Tunables t = given_;
  t.resolve(topo_.local_world(), group_->host_cores());
  tun_.spin_us = t.spin_us;
  tun_.skew_rounds = t.skew_rounds;
  group_->set_spin(std::chrono::nanoseconds(static_cast<int64_t>(tun_.spin_us * 1e3)));
  group_->set_skewed_rounds(tun_.skew_rounds != 0);
}

std::string Communicator::listen_tcp(const std::string& bind_ip, const std::vector<uint8_t>& secret) {
  if (!topo_.multi_host()) throw std::invalid_argument("listen_tcp: every rank of this communicator is on this host");
  TcpConfig cfg;
  cfg.sockets = tun_.nsocks;
  cfg.chunk_bytes = tun_.socket_chunk_bytes;
  cfg.timeout = timeout_;
  cfg.secret = secret;
  cfg.lazy = tun_.tcp_lazy;
  tcp_ = std::make_unique<TcpTransport>(rank_, world_, bind_ip, std::move(cfg));
  return tcp_->address();
}

void Communicator::connect_tcp(const std::vector<std::string>& endpoints, const std::vector<std::string>& labels) {
  if (!tcp_) throw std::invalid_argument("connect_tcp before listen_tcp");
  std::vector<bool> remote(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) remote[static_cast<size_t>(r)] = topo_.host_of[static_cast<size_t>(r)] != topo_.host;
  tcp_->connect(endpoints, remote, labels);
}

void Communicator::unlink_own() {
  if (group_) group_->unlink_own();
}

// Every algorithm choice, in one table. `bytes`: what one rank publishes (all_reduce,
// broadcast: the message; all_gather: its part; reduce_scatter, all_to_all: its whole input).
//
//   kind            on one host (shared memory)              across hosts (TCP between them)
//   all_reduce      oneshot when the message fits the        oneshot (<= cross_oneshot_max_bytes,
//                   one-shot buffer, else twoshot; ring      fewer than cross_doubling_min_hosts
//                   only by BRAID_ALGO=ring                  hosts) or doubling (from that many);
//                                                            larger: ring from 3 hosts, at 2
//                                                            hierarchical (every host the same
//                                                            number > 1 of ranks) or leaders
//   reduce_scatter, oneshot when it fits the one-shot        the steps of cross_host.cc: on the
//   all_gather,     buffer, else twoshot (pipelined through  host by this table, between hosts
//   all_to_all,     the slots)                               directly at 2, around a ring from 3
//   broadcast                                                (ring_between_hosts)
//
// Steps between hosts (between_hosts_algo: a call scoped to a rank's counterparts, the part
// between hosts of a collective across hosts), among M members:
//   all_reduce      oneshot (one round trip) up to cross_oneshot_max_bytes, else twoshot (a direct
//                   exchange in pieces); BRAID_ALGO=oneshot, ring or doubling forces that one
//   reduce_scatter, ring from 3 members, else twoshot (direct: at two the same exchange, in one
//   all_gather      step); a reduce_scatter scoped to the counterparts always direct (its sums in
//                   member order, which its callers, HostGroups' users, reproduce)
//   others          twoshot: a direct exchange (all_to_all), a tree (broadcast), dissemination
//                   (barrier)
//
// BRAID_ALGO (Tunables::algo) forces an all_reduce algorithm where it applies: on one host
// oneshot/twoshot/ring (oneshot still needs the buffer); across hosts oneshot, leaders,
// hierarchical (leaders when the hosts are uneven), ring, doubling; a host's own steps of a
// ring across hosts keep the rank order (oneshot or twoshot).
Algo Communicator::choose_algo(CollKind kind, size_t bytes, bool across) const {
  const bool fits = bytes <= oneshot_max_;  // one-shot needs what a rank publishes to fit its buffer
  if (kind != CollKind::kAllReduce) return fits ? Algo::kOneShot : Algo::kTwoShot;
  if (!across) {
    switch (tun_.algo) {
      case Algo::kTwoShot: return Algo::kTwoShot;
      case Algo::kRing: return topo_.multi_host() ? (fits ? Algo::kOneShot : Algo::kTwoShot) : Algo::kRing;
      default: return fits ? Algo::kOneShot : Algo::kTwoShot;
    }
  }
  const bool can_slice = topo_.uniform() && topo_.local_world() > 1;
  switch (tun_.algo) {
    case Algo::kOneShot: return Algo::kOneShot;
    case Algo::kLeaders: return Algo::kLeaders;
    case Algo::kHierarchical: return can_slice ? Algo::kHierarchical : Algo::kLeaders;
    case Algo::kRing: return Algo::kRing;
    case Algo::kDoubling: return Algo::kDoubling;
    default: {
      const int hosts = topo_.num_hosts();
      // Small messages: one round trip among the host leaders, or at many hosts recursive
      // doubling (log2 H rounds, log2 H peers each, where the one-shot sends H - 1 messages
      // from every leader and connects every pair).
      if (bytes <= tun_.cross_oneshot_max_bytes) return hosts >= tun_.cross_doubling_min_hosts ? Algo::kDoubling : Algo::kOneShot;
      // More than two hosts: around a ring between hosts (one neighbour each way, as NCCL; the
      // slices of the hierarchical algorithm when every host holds the same number > 1 of ranks,
      // else between the host leaders) rather than every host sending to every other at once,
      // which lost to the ring at 8 hosts x 2 ranks (8 MiB on 100 Mbit links: 1.49-1.67 s against
      // 1.30 s) and at 8-16 hosts x 1. At two hosts both are the same exchange.
      if (ring_between_hosts(hosts)) return Algo::kRing;
      return can_slice ? Algo::kHierarchical : Algo::kLeaders;
    }
  }
}

Algo Communicator::between_hosts_algo(CollKind kind, size_t bytes, int members, bool scoped) const {
  switch (kind) {
    case CollKind::kAllReduce:
      switch (tun_.algo) {
        case Algo::kOneShot:
        case Algo::kRing:
        case Algo::kDoubling:
          return tun_.algo;
        default:
          return bytes <= tun_.cross_oneshot_max_bytes ? Algo::kOneShot : Algo::kTwoShot;
      }
    case CollKind::kReduceScatter:
      return !scoped && ring_between_hosts(members) ? Algo::kRing : Algo::kTwoShot;
    case CollKind::kAllGather:
      return ring_between_hosts(members) ? Algo::kRing : Algo::kTwoShot;
    default:
      return Algo::kTwoShot;
  }
}

void Communicator::check_open() const {
  if (in_forked_child())
    throw CommError(ErrorKind::kClosed,
                    "this communicator belongs to process " + std::to_string(owner_pid_) +
                        " and cannot be used in process " + std::to_string(::getpid()) +
                        ", which was forked from it (a child has none of its parent's threads, and "
                        "its calls would act as the parent's rank): create a new communicator in the child");
  if (closed_.load()) throw CommError(ErrorKind::kClosed, "communicator used after close()");
}

void Communicator::check_not_poisoned() {
  if (!poisoned_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lk(poison_mu_);
  if (poison_kind_ != ErrorKind::kNone)
    throw CommError(poison_kind_, "communicator is unusable after an earlier error (rebuild it): " + poison_msg_);
}

namespace {
constexpr const char* kCloseOnProgressThread =
    "close() on braid's progress thread (inside a future's callback, say): it would wait for that "
    "thread itself to finish; close the communicator after the callback returned";
constexpr const char* kReentrant =
    "re-entrant call: this thread is inside a collective of this communicator (a signal handler that "
    "ran while it waited?); a blocking call or close() here would wait for that collective, which "
    "waits for it: issue it with async_op=True, or after the collective returned";
}  // namespace

void Communicator::check_may_block() const {
  if (engine_->inline_on_this_thread()) throw CommError(ErrorKind::kGeneric, kReentrant);
}

std::shared_ptr<Work> Communicator::run_on_progress_thread(const std::function<void()>& body, bool async) {
  if (!async) {
    body();
    return nullptr;
  }
  auto work = std::make_shared<Work>(body);
  work->run();
  return work;
}

namespace {
// How long a lazily queued receive waits for its waiter before the progress thread starts it.
constexpr std::chrono::milliseconds kLazyReceive{1};
}  // namespace

std::shared_ptr<Work> Communicator::submit(Request req, bool async) {
  check_open();
  check_not_poisoned();
  if (!async) check_may_block();
  if ((req.kind == CollKind::kAllReduce || req.kind == CollKind::kReduceScatter) && !op_supports(req.op, req.dtype))
    throw std::invalid_argument(std::string("reduce op ") + reduce_op_name(req.op) + " needs an integer dtype, got " +
                                dtype_name(req.dtype));
  // A call run at once by this thread is recorded as it starts (execute), one entry written once;
  // a call handed to the progress thread is recorded now, and again when it starts.
  req.trace_here = true;
  if (engine_->on_progress_thread()) return run_on_progress_thread([&] { execute(req); }, async);
  if (!async && engine_->run_if_idle([&] { execute(req); })) return nullptr;
  req.trace_here = false;
  // The transfers of an all-to-all with split sizes are part of its entry: none of their own,
  // whichever thread runs them.
  if (trace_.on() && !req.exchange)
    req.trace_id = trace_.issue(req.kind, req.dtype, req.op, req.count, req.rank_named(), nullptr, &req.trace_stack);
  std::shared_ptr<Work> work;
  bool lazy = false;
  if (world_ > 1 && (req.kind == CollKind::kSend || req.kind == CollKind::kRecv)) {
    if (async)
      if (auto now = p2p_now(req)) return now;
    lazy = async && req.kind == CollKind::kRecv && req.peer >= 0 && req.peer < world_ && group_ &&
           topo_.host_of[static_cast<size_t>(req.peer)] == topo_.host && group_->spin_budget().count() == 0;
    auto shared = std::make_shared<Request>(std::move(req));
    work = std::make_shared<Work>([this, shared] { execute(*shared); });
    work->set_p2p(shared);
  } else {
    work = std::make_shared<Work>([this, r = std::move(req)]() mutable { execute(r); });
  }
  work->set_engine(engine_.get());
  // Behind the async work issued before it. A receive from a peer on this host where the host's
  // ranks outnumber its cores (no spin budget) is queued lazily: its waiter usually comes first
  // and runs it, sparing the progress thread a wake and a core it would take from a rank
  // (enqueue_lazy). Sends keep the progress thread: past the mailbox they push as room frees.
  if (lazy)
    engine_->enqueue_lazy(work, kLazyReceive);
  else
    engine_->enqueue(work);
  if (p2p_waiting_.load(std::memory_order_seq_cst)) {
    if (group_) group_->wake();
    if (tcp_) tcp_->wake();
  }
  if (!async) {
    wait_blocking(*work);
    return nullptr;
  }
  return work;
}

void Communicator::record_poison(ErrorKind kind, const std::string& msg) {
  std::lock_guard<std::mutex> lk(poison_mu_);
  if (poison_kind_ == ErrorKind::kNone) {
    poison_kind_ = kind;
    poison_msg_ = msg;
    poisoned_.store(true, std::memory_order_release);
  }
}

std::optional<CommError> Communicator::cause_of(const CommError& met) const {
  // A peer found gone (its listener closed, its socket reset) is often the echo of a failure a
  // rank on this host already published, say a mismatch it was told of by the peer that found it;
  // the peer that left told this rank nothing itself, as it was told. Raise the cause.
  if (met.kind() != ErrorKind::kPeer || !group_ || group_->peer_failure().empty()) return std::nullopt;
  return group_->peer_error();
}

void Communicator::poison(const CommError& e, bool in_p2p) {
  record_poison(e.kind(), e.what());
  if (group_) group_->publish_failure(e.kind(), e.what(), in_p2p);
  if (tcp_) tcp_->publish_failure(e.kind(), e.what());
}

std::shared_ptr<Work> Communicator::submit_task(std::function<void()> body, std::shared_ptr<void> keepalive,
                                               bool async, const TaskTrace& trace) {
  check_open();
  check_not_poisoned();
  if (!async) check_may_block();
  if (trace.label != nullptr && trace_.on()) {
    const uint64_t id = trace_.issue(CollKind::kAllReduce, trace.dtype, ReduceOp::kSum, trace.count, -1, trace.label);
    if (trace.wire_ratio >= 0) trace_.set_wire_ratio(id, trace.wire_ratio);
    body = [this, id, b = std::move(body)] {
      trace_.start(id, 0);
      try {
        b();
      } catch (const std::exception& e) {
        trace_.fail(id, e.what());
        throw;
      }
      trace_.complete(id, nullptr, 0, 0);
    };
  }
  if (engine_->on_progress_thread()) return run_on_progress_thread(body, async);
  if (!async && engine_->run_if_idle(body)) return nullptr;
  auto work = std::make_shared<Work>([b = std::move(body), k = std::move(keepalive)] { b(); });
  work->set_engine(engine_.get());
  engine_->enqueue(work);
  if (!async) {
    wait_blocking(*work);
    return nullptr;
  }
  return work;
}

void Communicator::wait_blocking(Work& work) {
  try {
    work.wait(std::chrono::nanoseconds(0), /*interruptible=*/true);
  } catch (const Interrupted& e) {
    const std::string msg = "rank " + std::to_string(rank_) + " was " + e.what();
    if (group_) group_->request_abort(msg);
    if (tcp_) tcp_->request_abort(msg, ErrorKind::kGeneric);
    work.wait_done();
    record_poison(ErrorKind::kGeneric, msg);
    throw;
  }
}

void Communicator::run_collective(Request& r) { execute(r); }

void Communicator::execute_local(Request& r) {
  if (r.kind == CollKind::kSend || r.kind == CollKind::kRecv)
    throw std::invalid_argument("point-to-point needs a peer: this communicator has one rank");
  if (r.kind == CollKind::kAllToAll) r.count *= static_cast<size_t>(world_);  // one chunk, moved whole
  const size_t bytes = r.count * dtype_size(r.dtype);
  if (r.kind == CollKind::kBarrier || r.kind == CollKind::kBroadcast || r.kind == CollKind::kExchange) return;
  if (r.out != r.in && bytes > 0) std::memmove(r.out, r.in, bytes);
}

void Communicator::execute(Request& r) {
  const bool p2p = r.kind == CollKind::kSend || r.kind == CollKind::kRecv;
  // Recorded here, issued and started at once: a call submit() runs on the thread that issued it,
  // and the collectives that did not come through submit() (the steps of a composite call; the
  // transfers of an all-to-all with split sizes are part of its entry).
  const bool record_here = r.trace_id == 0 && (r.trace_here || !p2p) && trace_.on();
  try {
    check_not_poisoned();
  } catch (const CommError& e) {
    if (record_here)
      r.trace_id = trace_.issue(r.kind, r.dtype, r.op, r.count, r.rank_named(), nullptr, &r.trace_stack);
    trace_.fail(r.trace_id, e.what());
    throw;
  }
  // Point-to-point involves two ranks: it must not advance the collective sequence, which every
  // rank keeps in step.
  CollectiveDesc d = describe_request(r, p2p ? seq_ : ++seq_);
  if (record_here)
    r.trace_id = trace_.issue(r.kind, r.dtype, r.op, r.count, r.rank_named(), nullptr, &r.trace_stack,
                              p2p ? 0 : d.seq, /*started=*/true);
  else
    trace_.start(r.trace_id, p2p ? 0 : d.seq);
  const uint64_t tcp_before = tcp_ ? tcp_->bytes_sent() : 0;
  // One thread runs collectives at a time (the engine serializes them; a composite call's steps
  // nest on it): plain stores, read by the recorder's watcher.
  struct Executing {
    std::atomic<int>& n;
    explicit Executing(std::atomic<int>& c) : n(c) { n.store(n.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed); }
    ~Executing() { n.store(n.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed); }
  } executing{executing_};
  auto algo = [&] { return d.algo != 0 ? algo_name(static_cast<Algo>(d.algo)) : nullptr; };
  try {
    if (world_ == 1) {
      execute_local(r);
    } else if (p2p) {
      execute_p2p(r);
      if (r.in_place) d.algo = static_cast<decltype(d.algo)>(Algo::kWindow);
    } else if (r.scope == Scope::kCross || (topo_.multi_host() && r.scope == Scope::kHost)) {
      execute_scoped(r, d);
    } else if (topo_.multi_host()) {
      if (r.kind == CollKind::kAllReduce) d.algo = static_cast<uint8_t>(choose_algo(r.kind, r.count * dtype_size(r.dtype), true));
      execute_cross_host(r, d);
    } else {
      run_on_host(r, d);
    }
    if (r.epilogue) r.epilogue();
  } catch (const CommError& met) {
    const std::optional<CommError> cause = cause_of(met);
    const CommError& e = cause ? *cause : met;
    trace_.set_algo(r.trace_id, algo());
    trace_.fail(r.trace_id, e.what());
    poison(e, p2p);
    if (e.kind() == ErrorKind::kTimeout || e.kind() == ErrorKind::kPeer || e.kind() == ErrorKind::kMismatch)
      dump_failure(std::string(error_class_name(e.kind())) + ": " + e.what());
    if (cause) throw *cause;
    throw;
  } catch (const std::exception& e) {
    trace_.fail(r.trace_id, e.what());
    throw;
  }
  if (r.trace_id != 0) {
    const uint64_t payload = (r.kind == CollKind::kAllToAll ? r.count * static_cast<size_t>(world_) : r.count) *
                             dtype_size(r.dtype);
    trace_.complete(r.trace_id, algo(), topo_.local_world() > 1 ? payload : 0,
                    (tcp_ ? tcp_->bytes_sent() : 0) - tcp_before);
  }
}

void Communicator::run_on_host(Request& r, CollectiveDesc& d) {
  const size_t es = dtype_size(r.dtype);
  const size_t n = static_cast<size_t>(group_->world_size());
  group_->forget_windows();
  run_algorithm_on_host(r, d, es, n);
  if (group_->read_windows()) d.algo = static_cast<uint32_t>(Algo::kWindow);  // named so in the recorder
}

void Communicator::run_algorithm_on_host(Request& r, CollectiveDesc& d, size_t es, size_t n) {
  switch (r.kind) {
    case CollKind::kAllReduce: {
      const Algo a = choose_algo(r.kind, r.count * es, false);
      d.algo = static_cast<uint32_t>(a);
      if (a == Algo::kOneShot)
        oneshot_all_reduce(*group_, d, r.in, r.out);
      else if (window_all_reduce(*group_, d, r.in, r.out))
        break;  // registered buffers: read in place
      else if (a == Algo::kRing)
        ring_all_reduce(*group_, d, r.in, r.out);
      else
        twoshot_all_reduce(*group_, d, r.in, r.out);
      break;
    }
    case CollKind::kReduceScatter:
    case CollKind::kAllGather:
    case CollKind::kAllToAll:
    case CollKind::kBroadcast: {
      // reduce_scatter and all_to_all publish their whole input.
      const bool whole = r.kind == CollKind::kReduceScatter || r.kind == CollKind::kAllToAll;
      const bool small = choose_algo(r.kind, r.count * es * (whole ? n : 1), false) == Algo::kOneShot;
      d.algo = static_cast<uint32_t>(small ? Algo::kOneShot : Algo::kTwoShot);
      if (!small) {  // registered buffers: read in place (else arrived, and on to the slots)
        bool done = false;
        if (r.kind == CollKind::kReduceScatter)
          done = window_reduce_scatter(*group_, d, r.in, r.out);
        else if (r.kind == CollKind::kAllGather)
          done = window_all_gather(*group_, d, r.in, r.out);
        else if (r.kind == CollKind::kAllToAll)
          done = window_all_to_all(*group_, d, r.in, r.out);
        else
          done = window_broadcast(*group_, d, r.out);
        if (done) break;
      }
      if (r.kind == CollKind::kReduceScatter)
        (small ? oneshot_reduce_scatter : pipelined_reduce_scatter)(*group_, d, r.in, r.out);
      else if (r.kind == CollKind::kAllGather)
        (small ? oneshot_all_gather : pipelined_all_gather)(*group_, d, r.in, r.out);
      else if (r.kind == CollKind::kAllToAll)
        (small ? oneshot_all_to_all : pipelined_all_to_all)(*group_, d, r.in, r.out);
      else
        (small ? oneshot_broadcast : pipelined_broadcast)(*group_, d, r.out);
      break;
    }
    case CollKind::kBarrier:
    case CollKind::kExchange:
      barrier(*group_, d);
      break;
    case CollKind::kSend:
    case CollKind::kRecv:
      break;  // never a collective
  }
}

void Communicator::set_trace_identity(TraceIdentity who) {
  trace_who_ = std::move(who);
  if (trace_dir_.empty() || watcher_.joinable() || closed_.load()) return;
  if (tcp_) tcp_->set_notify_everyone(true);
  if (world_ > 1 || trace_signals_configured()) watcher_ = std::thread([this] { watch_loop(); });
}

std::string Communicator::trace_json(const std::string& reason) const {
  return trace_.to_json(trace_who_, rank_, world_, reason);
}

std::string Communicator::dump_trace(const std::string& dir, const std::string& reason) {
  const std::string& where = dir.empty() ? trace_dir_ : dir;
  if (where.empty())
    throw std::invalid_argument("dump_trace needs a directory: pass one, or set BRAID_TRACE_DIR");
  return write_dump(where, "braid-trace-" + trace_who_.comm_id + "-rank" + std::to_string(rank_) + ".json",
                    trace_json(reason));
}

void Communicator::dump_failure(const std::string& reason) noexcept {
  if (trace_dir_.empty() || trace_dumped_.exchange(true)) return;
  try {
    const std::string path = dump_trace(trace_dir_, reason);
    std::fprintf(stderr, "braid: rank %d wrote its flight recorder to %s\n", rank_, path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "braid: rank %d could not write its flight recorder: %s\n", rank_, e.what());
  }
}

// Every 100 ms: a dump signal (each one dumps), or a failure a peer published while this rank
// was not waiting on it (its own failures are dumped by the thread that meets them: while a
// collective runs, that thread gets 2 s to meet the failure and dump with its call failed).
void Communicator::watch_loop() {
  name_this_thread("braid-watch");
  uint64_t signals = trace_signals_seen();
  std::chrono::steady_clock::time_point seen_failure{};
  std::unique_lock<std::mutex> lk(watch_mu_);
  while (!watch_stop_) {
    watch_cv_.wait_for(lk, std::chrono::milliseconds(100));
    if (watch_stop_) break;
    lk.unlock();
    const uint64_t seen = trace_signals_seen();
    if (seen != signals) {
      signals = seen;
      try {
        dump_trace(trace_dir_, "signal");
      } catch (const std::exception& e) {
        std::fprintf(stderr, "braid: rank %d could not write its flight recorder: %s\n", rank_, e.what());
      }
    }
    if (!trace_dumped_.load()) {
      std::string why = group_ ? group_->peer_failure() : std::string();
      if (why.empty() && tcp_) why = tcp_->reported_failure();
      const auto now = std::chrono::steady_clock::now();
      if (!why.empty() && seen_failure == std::chrono::steady_clock::time_point{}) seen_failure = now;
      if (!why.empty() && (executing_.load() == 0 || now - seen_failure > std::chrono::seconds(2)))
        dump_failure("PeerError: " + why);
    }
    lk.lock();
  }
}

void Communicator::stop_watcher() {
  {
    std::lock_guard<std::mutex> lk(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

void Communicator::abort() {
  if (closed_.load() || in_forked_child()) return close();
  const std::string msg = "rank " + std::to_string(rank_) + " aborted the communicator";
  record_poison(ErrorKind::kClosed, msg);
  if (group_) group_->request_abort(msg, ErrorKind::kClosed);
  if (tcp_) tcp_->request_abort(msg, ErrorKind::kClosed);
  // From a signal handler run inside this communicator's collective: that collective fails as soon
  // as the handler returns; closing is left to whoever handles its error. So too from a callback
  // on the progress thread, which cannot wait for itself.
  if (engine_->inline_on_this_thread() || engine_->on_progress_thread()) return;
  close();
}

void Communicator::set_close_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(close_hook_mu_);
  close_hook_ = std::move(hook);
}

void Communicator::close() {
  // Tearing down under the call that this thread is running would free what that call uses.
  if (!closed_.load() && !in_forked_child() && engine_ && engine_->inline_on_this_thread())
    throw CommError(ErrorKind::kGeneric, kReentrant);
  // The progress thread (a future's callback) would wait for itself to finish.
  if (!closed_.load() && !in_forked_child() && engine_ && engine_->on_progress_thread())
    throw CommError(ErrorKind::kGeneric, kCloseOnProgressThread);
  if (!closed_.load() && !in_forked_child()) {
    std::function<void()> hook;
    {
      std::lock_guard<std::mutex> lock(close_hook_mu_);
      hook = std::move(close_hook_);
      close_hook_ = nullptr;
    }
    if (hook) {
      try {
        submit_task(std::move(hook), nullptr, false);
      } catch (const std::exception&) {
        // A poisoned communicator refuses the task, a peer gone fails it: the hook's owner keeps
        // what it could not release safely, and the close goes on.
      }
    }
  }
  if (closed_.exchange(true)) return;
  if (in_forked_child()) {
    // Leaked on purpose: the progress thread exists only in the parent (joining it here would
    // block forever), its locks may have been held at the fork, and the group must neither tell
    // the peers that the parent left nor unlink a segment the parent still needs. The mappings
    // and descriptors go when the child exits.
    (void)engine_.release();
    (void)group_.release();
    (void)tcp_.release();
    if (watcher_.joinable()) (void)new std::thread(std::move(watcher_));  // the parent's: leaked
    return;
  }
  stop_watcher();
  engine_->shutdown();
  if (group_) group_->mark_left();
  group_.reset();
  tcp_.reset();
}

}  // namespace braid
