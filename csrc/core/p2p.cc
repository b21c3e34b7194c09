// Point-to-point on the communicator: a blocking send or receive on the calling thread, the
// progress thread's scheduler of async ones (issue order per peer and direction, receives from any
// source matched to the first message waiting), all-to-all with split sizes, and the routing of
// each transfer to the host's shared memory or to TCP by the peer's host.
#include <algorithm>
#include <mutex>

#include "communicator.h"
#include "cpu_relax.h"

namespace braid {

void Communicator::execute_p2p(Request& r) {
  if (r.kind == CollKind::kRecv && r.peer == kAnySource) {
    std::vector<int> peers;
    for (int p = 0; p < world_; ++p)
      if (p != rank_) peers.push_back(p);
    int from;
    while ((from = p2p_first_incoming(peers)) < 0) p2p_wait_any(peers, nullptr, 0, [] { return false; });
    r.peer = from;
    if (r.source) *r.source = from;
  }
  const size_t bytes = r.count * dtype_size(r.dtype);
  if (r.kind == CollKind::kSend)
    r.in_place = p2p_blocking(r.peer, true, const_cast<void*>(r.in), bytes, r.dtype);
  else
    r.in_place = p2p_blocking(r.peer, false, r.out, bytes, r.dtype);
}

bool Communicator::p2p_blocking(int peer, bool send, void* data, size_t bytes, DType dtype) {
  P2POp op;
  op.peer = peer;
  op.send = send;
  op.data = static_cast<char*>(data);
  op.bytes = bytes;
  op.dtype = dtype;
  P2POp* ops[] = {&op};
  while (!p2p_advance(op)) p2p_wait(ops, 1, [] { return false; });
  return op.in_place;
}

namespace {
// The transfer a send or receive request describes, from the bytes it has already moved.
P2POp op_of(const Request& r) {
  P2POp op;
  op.peer = r.peer;
  op.send = r.kind == CollKind::kSend;
  op.data = op.send ? const_cast<char*>(static_cast<const char*>(r.in)) : static_cast<char*>(r.out);
  op.bytes = r.count * dtype_size(r.dtype);
  op.dtype = r.dtype;
  op.off = r.moved;
  op.exchange = r.exchange;
  op.offer = r.offer;
  op.declined = r.declined;
  return op;
}

// The reverse of op_of: what a transfer stopped part way has done, kept in its request for the
// thread that goes on with it (a receive from any source keeps the peer it matched).
void keep_progress(Request& r, const P2POp& op) {
  r.peer = op.peer;
  r.moved = op.off;
  r.offer = op.offer;
  r.declined = op.declined;
  r.in_place = op.in_place;
}
}  // namespace

std::shared_ptr<Work> Communicator::p2p_now(Request& r) {
  // Only with a peer on this host: a shared-memory transfer stopped part way resumes from its
  // byte offset (each chunk names it); a TCP one keeps state of its own.
  if (r.peer < 0 || r.peer >= world_ || r.peer == rank_ ||
      topo_.host_of[static_cast<size_t>(r.peer)] != topo_.host)
    return nullptr;
  bool finished = false;
  ErrorKind kind = ErrorKind::kNone;
  std::string msg;
  // Under the engine's inline ownership: nothing issued before this call is pending, and the
  // progress thread cannot start a transfer on the same lane meanwhile.
  const bool ran = engine_->run_if_idle([&] {
    P2POp op = op_of(r);
    try {
      finished = p2p_advance(op);
      // A transfer whose peer is at it too (a ring's exchange, a pipeline's hand-over) is often
      // done within microseconds: poll for it here, as a waiting rank would, for at most the
      // host's spin budget, before handing it to the progress thread (waking that thread and
      // later waiting on it costs two context switches, more than a small transfer).
      if (!finished) {
        const auto until = std::chrono::steady_clock::now() + group_->spin_budget();
        while (!finished && std::chrono::steady_clock::now() < until) {
          for (int i = 0; i < 8; ++i) BRAID_CPU_RELAX();
          finished = p2p_advance(op);
        }
      }
      keep_progress(r, op);
      if (finished && r.epilogue) r.epilogue();
    } catch (const CommError& e) {
      poison(e, true);
      kind = e.kind();
      msg = e.what();
    } catch (const std::exception& e) {
      kind = ErrorKind::kGeneric;
      msg = e.what();
    }
  });
  if (!ran || (!finished && kind == ErrorKind::kNone)) return nullptr;
  auto work = std::make_shared<Work>([] {});
  work->set_engine(engine_.get());
  trace_p2p_done(r, kind != ErrorKind::kNone ? msg.c_str() : nullptr);
  if (kind != ErrorKind::kNone)
    work->fail(kind, msg);
  else
    work->complete();
  r.keepalive.reset();
  return work;
}

void Communicator::trace_p2p_done(const Request& r, const char* error) {
  if (r.trace_id == 0) return;
  if (error != nullptr) {
    trace_.fail(r.trace_id, error);
    return;
  }
  const uint64_t bytes = r.count * dtype_size(r.dtype);
  const bool here = r.peer < 0 || topo_.host_of[static_cast<size_t>(r.peer)] == topo_.host;
  trace_.complete(r.trace_id, r.in_place ? algo_name(Algo::kWindow) : nullptr, here ? bytes : 0, here ? 0 : bytes);
}

std::shared_ptr<Work> Communicator::submit_exchange(DType dtype, std::vector<Request> reqs,
                                                   std::function<void()> epilogue, std::shared_ptr<void> keepalive,
                                                   bool async) {
  check_open();
  check_not_poisoned();
  if (!async) check_may_block();
  for (Request& r : reqs) {
    r.exchange = true;  // every receive is waited for: a send may wait for its receiver at any size
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
    bool in_place = false;
    for (const auto& w : mine) {
      if (!w->succeeded()) throw CommError(w->error_kind(), w->error_message());
      in_place = in_place || static_cast<const Request*>(w->p2p().get())->in_place;
    }
    // The recorder names the window path where a transfer was read in place (run here only).
    if (in_place && header.trace_id != 0) trace_.set_algo(header.trace_id, algo_name(Algo::kWindow));
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

void Communicator::run_p2p(std::vector<std::shared_ptr<Work>>& batch, const Work* until) noexcept {
  if (until != nullptr) {
    for (const auto& w : batch) {
      const auto* r = static_cast<const Request*>(w->p2p().get());
      const bool here = r->peer == kAnySource ? !topo_.multi_host()
                                              : topo_.host_of[static_cast<size_t>(r->peer)] == topo_.host;
      if (!here) return;  // the batch goes back as it came
    }
  }
  struct Active {
    std::shared_ptr<Work> work;
    Request* req;
    P2POp op;
  };
  std::vector<Active> active;  // issue order
  size_t admitted = 0;
  // Where a waiting thread runs the batch (`until`): what is left once its work is done, the
  // progress of each kept in its request for whoever goes on with it.
  auto hand_back = [&] {
    std::vector<std::shared_ptr<Work>> left;
    for (auto& a : active) {
      keep_progress(*a.req, a.op);
      left.push_back(std::move(a.work));
    }
    for (size_t i = admitted; i < batch.size(); ++i) left.push_back(std::move(batch[i]));
    batch = std::move(left);
  };
  size_t unmatched = 0;  // receives from any source without a peer yet: none, no looking for them
  auto admit = [&] {
    for (; admitted < batch.size(); ++admitted) {
      auto* r = static_cast<Request*>(batch[admitted]->p2p().get());
      Active a{batch[admitted], r, op_of(*r)};
      if (a.op.peer == kAnySource) ++unmatched;
      active.push_back(std::move(a));
    }
  };
  // Transfers in one direction with one peer go in issue order: only the first may move. A
  // receive from any source has no peer until a message is there for it, and receives issued
  // after it wait until it has one (a message goes to the first receive that can take it).
  auto lane_head = [&](size_t i) {
    if (active[i].op.peer == kAnySource) return false;
    const bool behind_any = unmatched > 0 && !active[i].op.send;
    for (size_t j = 0; j < i; ++j) {
      if (active[j].op.peer == active[i].op.peer && active[j].op.send == active[i].op.send) return false;
      if (behind_any && active[j].op.peer == kAnySource) return false;
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
    if (unmatched == 0) return active.size();
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
      --unmatched;
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
          keep_progress(*active[i].req, active[i].op);
          if (active[i].req->epilogue) active[i].req->epilogue();
          trace_p2p_done(*active[i].req, nullptr);
          std::shared_ptr<Work> w = std::move(active[i].work);
          active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
          w->complete();
          if (w.get() == until) {
            hand_back();
            return;
          }
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
    poison(e, true);
    for (auto& a : active) trace_p2p_done(*a.req, e.what());
    for (auto& a : active) a.work->fail(e.kind(), e.what());
    for (size_t i = admitted; i < batch.size(); ++i) batch[i]->fail(e.kind(), e.what());
    if (e.kind() == ErrorKind::kTimeout || e.kind() == ErrorKind::kPeer)
      dump_failure(std::string(error_class_name(e.kind())) + ": " + e.what());
  } catch (const std::exception& e) {
    for (auto& a : active) trace_p2p_done(*a.req, e.what());
    for (auto& a : active) a.work->fail(ErrorKind::kGeneric, e.what());
    for (size_t i = admitted; i < batch.size(); ++i) batch[i]->fail(ErrorKind::kGeneric, e.what());
  }
  if (until != nullptr) batch.clear();  // every work is finished: none goes back
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

}  // namespace braid
