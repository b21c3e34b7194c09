// Communicator: turns requests into collective descriptors, picks algorithms, poisons itself on
// the first communication error and tells the peers about it.
#include "communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "algorithms/algorithms.h"
#include "interrupt.h"
#include "reduce.h"

namespace braid {

CollectiveDesc describe_request(const Request& r, uint64_t seq) {
  CollectiveDesc d;
  d.seq = seq;
  d.count = r.count;
  d.kind = static_cast<uint8_t>(r.kind);
  d.dtype = static_cast<uint8_t>(r.dtype);
  d.op = static_cast<uint8_t>(r.op);
  const bool tagged = r.kind == CollKind::kAllGather || r.kind == CollKind::kAllToAll;
  d.root = tagged ? r.tag : static_cast<uint32_t>(r.root);
  return d;
}

Communicator::Communicator(int rank, int world_size, Tunables tunables, double timeout_s, std::vector<int> host_ids)
    : rank_(rank), world_(world_size), tun_(tunables), owner_pid_(static_cast<int>(::getpid())) {
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
  }
  if (world_ > 1)
    engine_->set_p2p_runner([this](std::vector<std::shared_ptr<Work>>& batch) { run_p2p(batch); });
}

Communicator::~Communicator() {
  if (!closed_.load() && !in_forked_child() && engine_ && engine_->on_progress_thread()) {
    // The last reference went away inside a callback on the progress thread, which is running
    // here: it cannot be joined from itself, and the queued works still use the engine and the
    // group. Both are left behind (the thread ends once its queue is empty); the peers learn
    // nothing until their own deadline. Python's finalizer closes on another thread instead.
    closed_.store(true);
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
}

std::string Communicator::listen_tcp(const std::string& bind_ip, const std::vector<uint8_t>& secret) {
  if (!topo_.multi_host()) throw std::invalid_argument("listen_tcp: every rank of this communicator is on this host");
  TcpConfig cfg;
  cfg.sockets = tun_.nsocks;
  cfg.chunk_bytes = tun_.socket_chunk_bytes;
  cfg.timeout = timeout_;
  cfg.secret = secret;
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

Algo Communicator::host_all_reduce_algo(size_t bytes) const {
  const bool fits = bytes <= oneshot_max_;  // one-shot needs the message to fit its buffer
  switch (tun_.algo) {
    case Algo::kTwoShot: return tun_.algo;
    // Across hosts a ring runs between hosts; the host's own steps keep the rank order.
    case Algo::kRing: return topo_.multi_host() ? (fits ? Algo::kOneShot : Algo::kTwoShot) : Algo::kRing;
    default: return fits ? Algo::kOneShot : Algo::kTwoShot;
  }
}

Algo Communicator::all_reduce_algo(size_t bytes) const {
  if (!topo_.multi_host()) return host_all_reduce_algo(bytes);
  const bool can_slice = topo_.uniform() && topo_.local_world() > 1;
  switch (tun_.algo) {
    case Algo::kOneShot: return Algo::kOneShot;
    case Algo::kLeaders: return Algo::kLeaders;
    case Algo::kHierarchical: return can_slice ? Algo::kHierarchical : Algo::kLeaders;
    case Algo::kRing: return Algo::kRing;
    default:
      if (bytes <= tun_.cross_oneshot_max_bytes) return Algo::kOneShot;
      if (can_slice) return Algo::kHierarchical;
      // One rank per host, more than two hosts: a flat ring (one neighbour each way, as NCCL)
      // rather than every host talking to every other at once; at two hosts both are the same.
      return topo_.local_world() == 1 && topo_.uniform() && topo_.num_hosts() > 2 ? Algo::kRing : Algo::kLeaders;
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

std::shared_ptr<Work> Communicator::submit(Request req, bool async) {
  check_open();
  check_not_poisoned();
  if (!async) check_may_block();
  if ((req.kind == CollKind::kAllReduce || req.kind == CollKind::kReduceScatter) && !op_supports(req.op, req.dtype))
    throw std::invalid_argument(std::string("reduce op ") + reduce_op_name(req.op) + " needs an integer dtype, got " +
                                dtype_name(req.dtype));
  if (engine_->on_progress_thread()) return run_on_progress_thread([&] { execute(req); }, async);
  if (!async && engine_->run_if_idle([&] { execute(req); })) return nullptr;
  std::shared_ptr<Work> work;
  if (world_ > 1 && (req.kind == CollKind::kSend || req.kind == CollKind::kRecv)) {
    auto shared = std::make_shared<Request>(std::move(req));
    work = std::make_shared<Work>([this, shared] { execute(*shared); });
    work->set_p2p(shared);
  } else {
    work = std::make_shared<Work>([this, r = std::move(req)]() mutable { execute(r); });
  }
  work->set_engine(engine_.get());
  engine_->enqueue(work);  // behind the async work issued before it
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

std::shared_ptr<Work> Communicator::submit_exchange(DType dtype, std::vector<Request> reqs,
                                                   std::function<void()> epilogue, std::shared_ptr<void> keepalive,
                                                   bool async) {
  check_open();
  check_not_poisoned();
  if (!async) check_may_block();
  for (const Request& r : reqs) {
    if (r.kind != CollKind::kSend && r.kind != CollKind::kRecv)
      throw std::invalid_argument("submit_exchange takes send and recv requests only");
    if (world_ == 1) throw std::invalid_argument("point-to-point needs a peer: this communicator has one rank");
    if (r.dtype != dtype) throw std::invalid_argument("submit_exchange: every request must have the exchange's dtype");
  }
  Request header;
  header.kind = CollKind::kExchange;
  header.dtype = dtype;
  // Blocking with nothing queued: all of it on the calling thread, as a blocking collective (two
  // thread hand-offs per call would cost more than a small exchange takes). So too on the
  // progress thread.
  auto here = [&] {
    execute(header);
    if (reqs.empty()) {
      if (epilogue) epilogue();
      return;
    }
    std::vector<std::shared_ptr<Work>> batch;
    for (Request& r : reqs) {
      auto shared = std::make_shared<Request>(std::move(r));
      auto w = std::make_shared<Work>([] {});
      w->set_p2p(shared);
      batch.push_back(std::move(w));
    }
    std::vector<std::shared_ptr<Work>> mine = batch;  // run_p2p may append works queued meanwhile
    run_p2p(batch);
    for (const auto& w : mine)
      if (!w->succeeded()) throw CommError(w->error_kind(), w->error_message());
    if (epilogue) epilogue();
  };
  if (engine_->on_progress_thread()) return run_on_progress_thread(here, async);
  if (!async && engine_->run_if_idle(here)) return nullptr;
  // Completed by whichever transfer finishes last; its body never runs.
  auto all = std::make_shared<Work>([] {});
  all->set_engine(engine_.get());
  struct State {
    std::mutex mu;
    size_t left;
    ErrorKind kind = ErrorKind::kNone;
    std::string msg;
    std::function<void()> epilogue;
    std::shared_ptr<void> keepalive;
  };
  auto st = std::make_shared<State>();
  // + 1: issuing, so that nothing completes `all` before every request is in; + 1: the header.
  st->left = reqs.size() + 2;
  st->epilogue = std::move(epilogue);
  st->keepalive = std::move(keepalive);
  auto done = [st, all](ErrorKind kind, const std::string& msg) {
    std::function<void()> epilogue;
    {
      std::lock_guard<std::mutex> lk(st->mu);
      if (kind != ErrorKind::kNone && st->kind == ErrorKind::kNone) {
        st->kind = kind;
        st->msg = msg;
      }
      if (--st->left != 0) return;
      kind = st->kind;
      epilogue = std::move(st->epilogue);
    }
    if (kind != ErrorKind::kNone) {
      all->fail(kind, st->msg);
    } else {
      try {
        if (epilogue) epilogue();
        all->complete();
      } catch (const CommError& e) {
        all->fail(e.kind(), e.what());
      } catch (const std::exception& e) {
        all->fail(ErrorKind::kGeneric, e.what());
      }
    }
    st->keepalive.reset();
  };
  size_t issued = 0;
  try {
    std::shared_ptr<Work> h = submit(std::move(header), true);
    h->on_complete([done](const Work& w) { done(w.error_kind(), w.error_message()); });
    ++issued;
    for (Request& r : reqs) {
      r.keepalive = st->keepalive;
      std::shared_ptr<Work> w = submit(std::move(r), true);
      ++issued;
      w->on_complete([done](const Work& w) { done(w.error_kind(), w.error_message()); });
    }
  } catch (const CommError& e) {
    for (size_t i = issued; i < reqs.size() + 1; ++i) done(e.kind(), e.what());
  } catch (const std::exception& e) {
    for (size_t i = issued; i < reqs.size() + 1; ++i) done(ErrorKind::kGeneric, e.what());
  }
  done(ErrorKind::kNone, {});
  if (!async) {
    wait_blocking(*all);
    return nullptr;
  }
  return all;
}

void Communicator::run_p2p(std::vector<std::shared_ptr<Work>>& batch) noexcept {
  struct Active {
    std::shared_ptr<Work> work;
    Request* req;
    P2POp op;
  };
  std::vector<Active> active;  // issue order
  size_t admitted = 0;
  auto admit = [&] {
    for (; admitted < batch.size(); ++admitted) {
      auto* r = static_cast<Request*>(batch[admitted]->p2p().get());
      Active a{batch[admitted], r, P2POp{}};
      a.op.peer = r->root;
      a.op.send = r->kind == CollKind::kSend;
      a.op.data = a.op.send ? const_cast<char*>(static_cast<const char*>(r->in)) : static_cast<char*>(r->out);
      a.op.bytes = r->count * dtype_size(r->dtype);
      a.op.dtype = r->dtype;
      active.push_back(std::move(a));
    }
  };
  // Transfers in one direction with one peer go in issue order: only the first may move. A
  // receive from any source has no peer until a message is there for it, and receives issued
  // after it wait until it has one (a message goes to the first receive that can take it).
  auto lane_head = [&](size_t i) {
    if (active[i].op.peer == kAnySource) return false;
    for (size_t j = 0; j < i; ++j) {
      if (active[j].op.peer == active[i].op.peer && active[j].op.send == active[i].op.send) return false;
      if (active[j].op.peer == kAnySource && !active[i].op.send) return false;
    }
    return true;
  };
  // The peers the first unmatched receive from any source (index `i`) may take a message from:
  // those without an earlier receive of this rank still to match.
  auto any_source_peers = [&](size_t i) {
    std::vector<int> peers;
    for (int p = 0; p < world_; ++p) {
      bool free = p != rank_;
      for (size_t j = 0; j < i && free; ++j) free = active[j].op.send || active[j].op.peer != p;
      if (free) peers.push_back(p);
    }
    return peers;
  };
  auto first_unmatched = [&]() -> size_t {
    for (size_t i = 0; i < active.size(); ++i)
      if (active[i].op.peer == kAnySource) return i;
    return active.size();
  };
  // Gives receives from any source their peers, in issue order, while messages are there.
  auto match_any = [&] {
    bool matched = false;
    for (size_t i = first_unmatched(); i < active.size(); i = first_unmatched()) {
      const int p = p2p_first_incoming(any_source_peers(i));
      if (p < 0) break;
      active[i].op.peer = p;
      if (active[i].req->source) *active[i].req->source = p;
      matched = true;
    }
    return matched;
  };
  try {
    check_not_poisoned();
    uint64_t seen = engine_->enqueued();
    admit();
    while (!active.empty()) {
      bool moved = match_any();
      for (size_t i = 0; i < active.size();) {
        if (!lane_head(i)) {
          ++i;
          continue;
        }
        const size_t before = active[i].op.off;
        if (p2p_advance(active[i].op)) {
          if (active[i].req->epilogue) active[i].req->epilogue();
          std::shared_ptr<Work> w = std::move(active[i].work);
          active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
          w->complete();
          moved = true;
          continue;
        }
        moved = moved || active[i].op.off != before;
        ++i;
      }
      // Point-to-point issued since (e.g. the receive that the blocked send's peer waits for).
      const uint64_t now = engine_->enqueued();
      if (now != seen) {
        seen = now;
        const size_t had = batch.size();
        engine_->take_p2p(batch);
        admit();
        moved = moved || batch.size() != had;
      }
      if (moved || active.empty()) continue;
      std::vector<P2POp*> heads;
      for (size_t i = 0; i < active.size(); ++i)
        if (lane_head(i)) heads.push_back(&active[i].op);
      p2p_waiting_.store(true, std::memory_order_seq_cst);
      struct Clear {
        std::atomic<bool>& flag;
        ~Clear() { flag.store(false, std::memory_order_seq_cst); }
      } clear{p2p_waiting_};
      const size_t any = first_unmatched();
      const std::vector<int> candidates = any < active.size() ? any_source_peers(any) : std::vector<int>{};
      p2p_wait_any(candidates, heads.data(), static_cast<int>(heads.size()),
                   [&] { return engine_->enqueued() != seen; });
    }
  } catch (const CommError& e) {
    poison(e);
    for (auto& a : active) a.work->fail(e.kind(), e.what());
    for (size_t i = admitted; i < batch.size(); ++i) batch[i]->fail(e.kind(), e.what());
  } catch (const std::exception& e) {
    for (auto& a : active) a.work->fail(ErrorKind::kGeneric, e.what());
    for (size_t i = admitted; i < batch.size(); ++i) batch[i]->fail(ErrorKind::kGeneric, e.what());
  }
}

void Communicator::record_poison(ErrorKind kind, const std::string& msg) {
  std::lock_guard<std::mutex> lk(poison_mu_);
  if (poison_kind_ == ErrorKind::kNone) {
    poison_kind_ = kind;
    poison_msg_ = msg;
    poisoned_.store(true, std::memory_order_release);
  }
}

void Communicator::poison(const CommError& e) {
  record_poison(e.kind(), e.what());
  if (group_) group_->publish_failure(e.kind(), e.what());
  if (tcp_) tcp_->publish_failure(e.kind(), e.what());
}

std::shared_ptr<Work> Communicator::submit_task(std::function<void()> body, std::shared_ptr<void> keepalive,
                                               bool async) {
  check_open();
  check_not_poisoned();
  if (!async) check_may_block();
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
  check_not_poisoned();
  const bool p2p = r.kind == CollKind::kSend || r.kind == CollKind::kRecv;
  // Point-to-point involves two ranks: it must not advance the collective sequence, which every
  // rank keeps in step.
  CollectiveDesc d = describe_request(r, p2p ? seq_ : ++seq_);
  try {
    if (world_ == 1) {
      execute_local(r);
    } else if (r.kind == CollKind::kSend || r.kind == CollKind::kRecv) {
      if (r.kind == CollKind::kRecv && r.root == kAnySource) {
        std::vector<int> peers;
        for (int p = 0; p < world_; ++p)
          if (p != rank_) peers.push_back(p);
        int from;
        while ((from = p2p_first_incoming(peers)) < 0) p2p_wait_any(peers, nullptr, 0, [] { return false; });
        r.root = from;
        if (r.source) *r.source = from;
      }
      const size_t bytes = r.count * dtype_size(r.dtype);
      if (r.kind == CollKind::kSend)
        p2p_blocking(r.root, true, const_cast<void*>(r.in), bytes, r.dtype);
      else
        p2p_blocking(r.root, false, r.out, bytes, r.dtype);
    } else if (r.scope == Scope::kCross || (topo_.multi_host() && r.scope == Scope::kHost)) {
      execute_scoped(r, d);
    } else if (topo_.multi_host()) {
      if (r.kind == CollKind::kAllReduce) d.algo = static_cast<uint8_t>(all_reduce_algo(r.count * dtype_size(r.dtype)));
      execute_cross_host(r, d);
    } else {
      run_on_host(r, d);
    }
    if (r.epilogue) r.epilogue();
  } catch (const CommError& e) {
    poison(e);
    throw;
  }
}

void Communicator::run_on_host(Request& r, CollectiveDesc& d) {
  const size_t es = dtype_size(r.dtype);
  const size_t n = static_cast<size_t>(group_->world_size());
  switch (r.kind) {
    case CollKind::kAllReduce: {
      const Algo a = host_all_reduce_algo(r.count * es);
      d.algo = static_cast<uint32_t>(a);
      if (a == Algo::kOneShot)
        oneshot_all_reduce(*group_, d, r.in, r.out);
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
      // One-shot when what a rank publishes fits a parity buffer (reduce_scatter and
      // all_to_all publish their whole input), pipelined through the slots otherwise.
      const bool whole = r.kind == CollKind::kReduceScatter || r.kind == CollKind::kAllToAll;
      const size_t published = r.count * es * (whole ? n : 1);
      const bool small = published <= oneshot_max_;
      d.algo = static_cast<uint32_t>(small ? Algo::kOneShot : Algo::kTwoShot);
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

bool Communicator::p2p_advance(P2POp& op) {
  if (topo_.host_of[static_cast<size_t>(op.peer)] != topo_.host) return tcp_->advance(op);
  // The host's group numbers its ranks from 0: move the transfer there and back.
  const int peer = op.peer;
  op.peer = topo_.local_index[static_cast<size_t>(peer)];
  struct Restore {
    P2POp& op;
    int peer;
    ~Restore() { op.peer = peer; }
  } restore{op, peer};
  return group_->advance(op);
}

void Communicator::p2p_wait(P2POp* const* ops, int nops, const std::function<bool()>& interrupted) {
  std::vector<P2POp> local;  // copies renumbered for the host's group
  std::vector<P2POp*> remote;
  for (int i = 0; i < nops; ++i) {
    if (topo_.host_of[static_cast<size_t>(ops[i]->peer)] != topo_.host) {
      remote.push_back(ops[i]);
    } else {
      local.push_back(*ops[i]);
      local.back().peer = topo_.local_index[static_cast<size_t>(ops[i]->peer)];
    }
  }
  std::vector<P2POp*> local_ptrs;
  for (P2POp& op : local) local_ptrs.push_back(&op);
  if (remote.empty()) return group_->wait_p2p(local_ptrs.data(), static_cast<int>(local_ptrs.size()), interrupted);
  if (local.empty()) return tcp_->wait(remote.data(), static_cast<int>(remote.size()), interrupted);
  // Both: TCP's poll in short slices, looking at the host's mailboxes in between.
  auto local_ready = [&] {
    for (const P2POp& op : local)
      if (group_->ready(op)) return true;
    return false;
  };
  tcp_->wait(remote.data(), static_cast<int>(remote.size()), [&] { return local_ready() || interrupted(); },
             std::chrono::milliseconds(1));
}

bool Communicator::p2p_incoming(int peer) {
  if (topo_.host_of[static_cast<size_t>(peer)] != topo_.host) return tcp_->incoming(peer, Channel::kUser);
  P2POp op;
  op.peer = topo_.local_index[static_cast<size_t>(peer)];
  op.send = false;
  return group_->ready(op);
}

int Communicator::p2p_first_incoming(const std::vector<int>& peers) {
  for (int step = 1; step < world_; ++step) {
    const int p = (rank_ + step) % world_;
    if (std::find(peers.begin(), peers.end(), p) != peers.end() && p2p_incoming(p)) return p;
  }
  return -1;
}

void Communicator::p2p_wait_any(const std::vector<int>& peers, P2POp* const* ops, int nops,
                                const std::function<bool()>& interrupted) {
  // A receive not yet started from each peer: the transports wait for its message to begin.
  std::vector<P2POp> probes(peers.size());
  std::vector<P2POp*> all(ops, ops + nops);
  for (size_t i = 0; i < peers.size(); ++i) {
    probes[i].peer = peers[i];
    probes[i].send = false;
    all.push_back(&probes[i]);
  }
  p2p_wait(all.data(), static_cast<int>(all.size()), interrupted);
}

void Communicator::p2p_blocking(int peer, bool send, void* data, size_t bytes, DType dtype) {
  P2POp op;
  op.peer = peer;
  op.send = send;
  op.data = static_cast<char*>(data);
  op.bytes = bytes;
  op.dtype = dtype;
  P2POp* ops[] = {&op};
  while (!p2p_advance(op)) p2p_wait(ops, 1, [] { return false; });
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

void Communicator::close() {
  // Tearing down under the call that this thread is running would free what that call uses.
  if (!closed_.load() && !in_forked_child() && engine_ && engine_->inline_on_this_thread())
    throw CommError(ErrorKind::kGeneric, kReentrant);
  // The progress thread (a future's callback) would wait for itself to finish.
  if (!closed_.load() && !in_forked_child() && engine_ && engine_->on_progress_thread())
    throw CommError(ErrorKind::kGeneric, kCloseOnProgressThread);
  if (closed_.exchange(true)) return;
  if (in_forked_child()) {
    // Leaked on purpose: the progress thread exists only in the parent (joining it here would
    // block forever), its locks may have been held at the fork, and the group must neither tell
    // the peers that the parent left nor unlink a segment the parent still needs. The mappings
    // and descriptors go when the child exits.
    (void)engine_.release();
    (void)group_.release();
    (void)tcp_.release();
    return;
  }
  engine_->shutdown();
  if (group_) group_->mark_left();
  group_.reset();
  tcp_.reset();
}

}  // namespace braid
