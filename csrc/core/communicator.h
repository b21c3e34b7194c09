// The torch-free communicator: sequence numbers, algorithm choice, error poisoning, issue-order
// execution (inline or on the progress thread) over a shared-memory rank group per host and, when
// the ranks span hosts, TCP between them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtype.h"
#include "errors.h"
#include "fork_guard.h"
#include "algorithms/direct.h"
#include "collective.h"
#include "progress_engine.h"
#include "scratch.h"
#include "topology.h"
#include "trace.h"
#include "transport/shm/group.h"
#include "transport/tcp/tcp_transport.h"
#include "tunables.h"
#include "work.h"

namespace braid {

// Which ranks a collective spans. Across hosts a compressed all-reduce reduces exactly on each
// host and compresses only what crosses hosts: it runs steps on the host's ranks and on the
// ranks with its local index on the other hosts (its counterparts), in issue order with the rest.
enum class Scope : uint8_t {
  kAll = 0,    // every rank of the communicator
  kHost = 1,   // the ranks of this rank's host (all of them when the communicator has one host)
  kCross = 2,  // this rank and its counterparts, one per host (only itself on one host)
};

// One collective call, by raw pointers. `in` and `out` may be equal (in place).
struct Request {
  CollKind kind = CollKind::kBarrier;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  size_t count = 0;  // all_reduce/broadcast: elements; reduce_scatter: output elements;
                     // all_gather: input elements; all_to_all: elements per chunk
  int root = 0;      // broadcast: the source; all_reduce: the destination of a reduce built on
                     // it (compared between ranks, else unused)
  int peer = -1;     // send/recv: the other rank (recv: kAnySource for whichever peer's message
                     // comes first)
  // all_gather / all_to_all: what the bytes mean to the caller (a compressed all-reduce's hash of
  // its compressor, settings, op and element count; a gather's destination + 1), compared between
  // ranks like the rest of the descriptor (in the root field, which these kinds do not use); 0
  // for plain calls.
  uint32_t tag = 0;
  Scope scope = Scope::kAll;
  // avg divides by this many ranks instead of the scope's (a step of an all-reduce over all
  // ranks that runs between hosts only); 0: the scope's. Scope kCross only.
  int divisor = 0;
  const void* in = nullptr;
  void* out = nullptr;
  // A recv from kAnySource writes the sender's rank here (when set) before it completes.
  std::shared_ptr<int> source;
  // Runs on the executing thread after the data moved (e.g. copies a result back from a contiguous copy).
  std::function<void()> epilogue;
  // Whatever must outlive the call (tensors of an async call); released at completion.
  std::shared_ptr<void> keepalive;
  // send/recv: bytes already moved when it was issued (Communicator::p2p_now); the progress
  // thread goes on from there.
  size_t moved = 0;
  // send: part of an all-to-all with split sizes (P2POp::exchange), and the state of a
  // data-in-place offer made when it was issued (P2POp::offer, declined).
  bool exchange = false;
  uint64_t offer = 0;
  bool declined = false;
  bool in_place = false;  // read from the sender's registered buffer where it lies (P2POp::in_place)
  // The flight recorder's entry (0: recorded when it starts), and the caller's stack for it
  // (BRAID_TRACE_STACK=1; empty otherwise). `trace_here`: run at once by the thread that issued
  // it, which records the call as it starts (Communicator::execute).
  uint64_t trace_id = 0;
  bool trace_here = false;
  std::string trace_stack;

  // The rank the call names: send/recv's peer, else the root.
  int rank_named() const { return kind == CollKind::kSend || kind == CollKind::kRecv ? peer : root; }
};

// A request as the core's own steps and every binding build one (the Python module's
// collectives, the c10d backend, the CUDA path): the kind, `count` elements of `dtype`, the
// buffers; the caller sets what its kind adds (op, root, tag, scope).
inline Request make_request(CollKind kind, DType dtype, size_t count, const void* in = nullptr, void* out = nullptr) {
  Request r;
  r.kind = kind;
  r.dtype = dtype;
  r.count = count;
  r.in = in;
  r.out = out;
  return r;
}

// Between hosts, reduce-scatter and all-gather steps (and all_reduce's large messages) go around a
// ring from three members (one neighbour each way) and directly at two (the same exchange, in one
// step): Communicator::choose_algo's table and cross_host.cc's steps both ask this.
inline bool ring_between_hosts(int members) { return members > 2; }

// A recv's root that matches the first message from any peer (as MPI_ANY_SOURCE): among the
// peers whose user channel has a message waiting, and whose earlier receives from this rank are
// all matched, the lowest rank after this one in ring order.
constexpr int kAnySource = -1;

// What ranks compare before moving the data of `r`, the `seq`-th collective of its sequence: the
// kind, dtype, count, op, and the root (a tag for all_gather and all_to_all).
CollectiveDesc describe_request(const Request& r, uint64_t seq);

class Communicator {
 public:
  // `host_ids[r]` is equal for ranks that share a host (empty: all on this host).
  Communicator(int rank, int world_size, Tunables tunables, double timeout_s, std::vector<int> host_ids = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  const Tunables& tunables() const { return tun_; }
  // Whether the calling thread is this communicator's progress thread (a future's callback).
  bool on_progress_thread() const { return engine_ && engine_->on_progress_thread(); }

  const Topology& topology() const { return topo_; }
  // The shared-memory group of this host's ranks (its registered buffers), or null where this
  // rank is alone on its host or the communicator is closed.
  ShmGroup* host_group() const { return group_.get(); }
  // Ranks a collective of `s` spans, and this rank's index among them.
  int scope_size(Scope s) const;
  int scope_rank(Scope s) const;

  // Bootstrap of the host's shared memory: publish segment_name(), attach everyone's (one entry
  // per communicator rank; those of other hosts are ignored), then unlink_own() once every rank
  // has attached. Not needed when this host has one rank.
  std::string segment_name() const;
  void attach(const std::vector<PeerInfo>& peers);
  void unlink_own();
  // Bootstrap across hosts: listen on `bind_ip` and return the endpoint to publish, then connect
  // to every rank on another host (`endpoints` and `labels` for every rank) proving `secret`.
  std::string listen_tcp(const std::string& bind_ip, const std::vector<uint8_t>& secret);
  void connect_tcp(const std::vector<std::string>& endpoints, const std::vector<std::string>& labels);
  // Payload bytes this rank sent and received over TCP so far.
  uint64_t tcp_bytes_sent() const { return tcp_ ? tcp_->bytes_sent() : 0; }
  // Ranks on other hosts this rank holds connections to now, and their sockets.
  int tcp_peers() const { return tcp_ ? tcp_->connected_peers() : 0; }
  int tcp_sockets() const { return tcp_ ? tcp_->open_sockets() : 0; }
  uint64_t tcp_bytes_received() const { return tcp_ ? tcp_->bytes_received() : 0; }

  // Blocking when `async` is false (returns null); otherwise returns the queued Work.
  std::shared_ptr<Work> submit(Request req, bool async);

  // A composite operation (e.g. a compressed all-reduce): `body` runs in issue order on the
  // executing thread like one collective, and issues its collectives with run_collective(), so
  // that no other work can slip between them. `keepalive` is released when the body is done.
  // `trace`: how the flight recorder names the call (the collectives it issues are recorded
  // each on their own as well).
  std::shared_ptr<Work> submit_task(std::function<void()> body, std::shared_ptr<void> keepalive, bool async,
                                    const TaskTrace& trace = {});
  // Runs one collective now, on the calling thread: only from inside a submit_task body.
  void run_collective(Request& r);
  // Runs `body` as one collective among ranks that are all on different hosts: the ranks of
  // `scope` (kCross, or kAll when every host has one rank), numbered and described like any
  // collective (`kind`, `count`, `tag`: every transfer carries the descriptor), a failure
  // poisoning the communicator. For algorithms over the TCP transport that the communicator
  // does not know (a pipelined quantized all-reduce). Only from inside a submit_task body.
  void run_between_hosts(Scope scope, CollKind kind, size_t count, uint32_t tag,
                         const std::function<void(const PeerGroup&)>& body);

  // An all-to-all with split sizes: a collective start (CollKind::kExchange of `dtype`, which
  // every rank must reach in the same place of its sequence as any collective) and then the
  // point-to-point requests (kSend/kRecv of `dtype`), which advance together as their peers
  // allow, in issue order per (direction, peer) as every transfer. The returned work completes
  // once all have, failing with the first error; on success `epilogue` (may be empty) runs first,
  // on the thread that finished the last one. `keepalive` is held until then. Blocking when
  // `async` is false (returns null).
  std::shared_ptr<Work> submit_exchange(DType dtype, std::vector<Request> reqs, std::function<void()> epilogue,
                                        std::shared_ptr<void> keepalive, bool async);

  // The algorithm of an all_reduce of `bytes` over all ranks (choose_algo's; exposed for tests and
  // the benchmarks).
  Algo all_reduce_algo(size_t bytes) const { return choose_algo(CollKind::kAllReduce, bytes, topo_.multi_host()); }
  uint64_t seq() const { return seq_; }

  // Runs queued work, leaves the group (peers still waiting get PeerError) and frees resources.
  // In a process forked from the one that built the communicator it only marks it closed: the
  // group, the peers and the progress thread belong to the parent (see fork_guard.h).
  void close();
  // close() without waiting for queued work: what is running or queued fails now (the executing
  // thread gives up at its next wait), the peers get PeerError, then the communicator closes
  // (unless called from inside one of its own collectives, e.g. by a signal handler: that
  // collective then fails, and closing is left to the caller).
  void abort();
  bool closed() const { return closed_.load(); }

  // The flight recorder (trace.h). The identity goes into every dump; once it is set, and when
  // BRAID_TRACE_DIR names a directory, a watcher thread dumps there when a peer reports a
  // failure while this rank is elsewhere, or on BRAID_TRACE_SIGNAL. This rank's own failures
  // (CommTimeout, PeerError, CollectiveMismatch) are dumped by the thread that meets them.
  void set_trace_identity(TraceIdentity who);
  // Writes this rank's dump into `dir` (BRAID_TRACE_DIR when empty); returns the file's path.
  std::string dump_trace(const std::string& dir, const std::string& reason);
  std::string trace_json(const std::string& reason) const;
  const std::string& trace_dir() const { return trace_dir_; }
  // Pauses or resumes the recorder (trace.h); whether it records now.
  void set_trace_enabled(bool on) { trace_.set_recording(on); }
  bool trace_enabled() const { return trace_.on(); }
  // What the torch binding keeps with this communicator for its calls on CUDA tensors (their
  // staging pipelines, csrc/binding/cuda_stager.h), opaque to the core, released with it.
  std::shared_ptr<void>& device_staging() { return device_staging_; }
  // Work that must run, in issue order and while the peers are still there, before a clean
  // close() leaves the group: the binding's device-to-device channels hold memory their peers
  // read, which must not be freed before every peer is done with it. Run once, as a task, at the
  // start of close() (not by abort(), nor on a poisoned communicator: its owner must then keep
  // that memory); its failure does not stop the close. Set before the last call, from any thread.
  void set_close_hook(std::function<void()> hook);

 private:
  // The algorithm of a `kind` collective of `bytes` (per rank's part: see communicator.cc), on
  // this host's group (across = false) or over all ranks across hosts: every choice is made
  // there, in one table.
  Algo choose_algo(CollKind kind, size_t bytes, bool across) const;
  // The same table's entry for a step between hosts among `members` ranks (`scoped`: a call scoped
  // to the counterparts; else the part between hosts of a collective across hosts): kRing around a
  // ring, kDoubling by recursive doubling, kOneShot one round trip, kTwoShot a direct exchange.
  Algo between_hosts_algo(CollKind kind, size_t bytes, int members, bool scoped = false) const;
  void execute(Request& r);
  void execute_local(Request& r);
  // One collective on this host's shared-memory group, described by `d` (its algo is filled in).
  void run_on_host(Request& r, CollectiveDesc& d);
  void run_algorithm_on_host(Request& r, CollectiveDesc& d, size_t es, size_t n);
  // Across hosts (cross_host.cc): the collective `r` (described to the other hosts by `d`) as
  // steps on this host's group and direct transfers between hosts.
  void execute_cross_host(Request& r, const CollectiveDesc& d);
  // A collective of Scope kHost or kCross across hosts (cross_host.cc).
  void execute_scoped(Request& r, CollectiveDesc& d);
  void cross_all_reduce(DType dt, ReduceOp op, const void* in, void* out, size_t count, const CollectiveDesc& d);
  void cross_reduce_scatter(DType dt, ReduceOp op, const void* in, void* out, size_t count, const CollectiveDesc& d);
  void cross_all_gather(const void* in, void* out, size_t bytes, const CollectiveDesc& d);
  void cross_broadcast(void* data, size_t bytes, int root, const CollectiveDesc& d);
  void cross_barrier(const CollectiveDesc& d);
  void cross_all_to_all(const void* in, void* out, size_t chunk_bytes, const CollectiveDesc& d);
  // A step on this host's group (none when it has one rank), numbered on the host.
  void host_step(CollKind kind, DType dt, ReduceOp op, size_t count, int root, const void* in, void* out);
  // Point-to-point (p2p.cc). A send or receive on the calling thread, blocking.
  void execute_p2p(Request& r);
  // Point-to-point routed by the peer's host: shared memory on this host, TCP to others.
  bool p2p_advance(P2POp& op);
  void p2p_wait(P2POp* const* ops, int nops, const std::function<bool()>& interrupted);
  // Returns whether the data was read in place (from the sender's registered buffer).
  bool p2p_blocking(int peer, bool send, void* data, size_t bytes, DType dtype);
  // An async send or receive with a peer on this host, issued while nothing else is queued or
  // running: moves what it can at once on the calling thread (a send into the peer's mailbox, a
  // receive whose message is already there). Returns the finished (or failed) work, or null when
  // it has to be queued (r.moved says how far it got) or the engine is busy.
  std::shared_ptr<Work> p2p_now(Request& r);
  // Whether a message from `peer` waits on the user channel (a receive from any source).
  bool p2p_incoming(int peer);
  // Waits until a message from one of `peers` waits, or one of `ops` can move, or `interrupted`.
  void p2p_wait_any(const std::vector<int>& peers, P2POp* const* ops, int nops, const std::function<bool()>& interrupted);
  // The first of `peers` (in ring order after this rank) with a message waiting, else -1.
  int p2p_first_incoming(const std::vector<int>& peers);
  // Runs the point-to-point works the engine hands over together (ProgressEngine::P2PRunner).
  // `until` (a waiting thread runs them: ProgressEngine::run_p2p_here): stops once that work is
  // done, its progress kept in the requests, and leaves the unfinished works in `batch`; runs
  // nothing where a transfer crosses hosts (TCP keeps state of its own per transfer).
  void run_p2p(std::vector<std::shared_ptr<Work>>& batch, const Work* until = nullptr) noexcept;
  // Records the first communication error and tells the peers. `in_p2p`: it came from a
  // point-to-point transfer, which runs after every collective issued before it had finished.
  void poison(const CommError& e, bool in_p2p = false);
  // The failure a rank on this host published, to raise instead of `met` when `met` only says a
  // peer is gone; nullopt when `met` stands.
  std::optional<CommError> cause_of(const CommError& met) const;
  // Records the first error without telling the peers (the thread running collectives does,
  // once it fails on it).
  void record_poison(ErrorKind kind, const std::string& msg);
  void check_open() const;
  // Refuses a blocking call re-entering an inline collective on the same thread.
  void check_may_block() const;
  // A call made on the progress thread itself, from a completion callback (a future's `then`, a
  // DDP hook's continuation): `body` runs now, on this thread, right after the work whose
  // completion is running and before anything queued behind it, so that every rank runs it at
  // the same point. Queued instead, it would wait behind the work the callback belongs to, and a
  // wait on it inside the callback would never end. Async calls get a finished work (failed on
  // error); blocking ones throw as inline calls do.
  std::shared_ptr<Work> run_on_progress_thread(const std::function<void()>& body, bool async);
  // A blocking call's wait for its queued work. Interrupted: the executing thread is asked to
  // abort (the request points into the caller's tensors, so it must be over before the caller
  // returns), the communicator is poisoned, and Interrupted propagates once the work ended.
  void wait_blocking(Work& work);
  bool in_forked_child() const { return fork_generation() != fork_generation_; }
  void check_not_poisoned();

  int rank_;
  int world_;
  Tunables tun_;
  Tunables given_;  // as passed in, before resolve(): attach() resolves again with the host's CPUs
  size_t oneshot_max_ = 0;  // tun_.oneshot_max_bytes once resolved
  std::chrono::nanoseconds timeout_{};  // every wait's deadline
  Topology topo_;
  std::unique_ptr<ShmGroup> group_;    // this host's ranks (null when it has one)
  std::unique_ptr<TcpTransport> tcp_;  // the other hosts' ranks (null on one host)
  uint64_t host_seq_ = 0;              // steps run on group_ across hosts (their shm sequence)
  ScratchBuffers scratch_;             // staging of the cross-host collectives (cross_host.cc)
  // Behind a pointer so that a forked child can abandon it without touching its thread or locks.
  std::unique_ptr<ProgressEngine> engine_ = std::make_unique<ProgressEngine>();
  const uint64_t fork_generation_ = fork_generation();
  const int owner_pid_;
  uint64_t seq_ = 0;  // only touched by the executing thread (the engine serializes)
  std::atomic<bool> closed_{false};
  std::atomic<bool> p2p_waiting_{false};  // run_p2p sleeps: new work must wake it
  // The flight recorder.
  Recorder trace_;
  std::shared_ptr<void> device_staging_;
  std::mutex close_hook_mu_;             // guards close_hook_
  std::function<void()> close_hook_;     // set_close_hook's
  std::string trace_dir_;  // BRAID_TRACE_DIR at construction
  TraceIdentity trace_who_;
  std::atomic<bool> trace_dumped_{false};  // the failure dump is written once
  std::atomic<int> executing_{0};          // collectives running now (their failure dumps first)
  std::thread watcher_;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;
  void watch_loop();
  void stop_watcher();
  // The dump of a failure (once per communicator; errors writing it go to stderr).
  void dump_failure(const std::string& reason) noexcept;
  // A point-to-point request's entry: completed (bytes by the peer's transport) or failed.
  void trace_p2p_done(const Request& r, const char* error);
  std::mutex poison_mu_;
  std::atomic<bool> poisoned_{false};  // set once poison_kind_ is; read without the lock
  ErrorKind poison_kind_ = ErrorKind::kNone;
  std::string poison_msg_;
};

}  // namespace braid
