// The IPC schedules (core/ipc/ipc_collectives.h) on a CPU engine: the ranks are threads sharing
// host memory as "device memory", each rank's stream a worker thread that runs its queue in order
// and behind its host, every wait checked against the ordering protocol when it is queued and
// every copy against the bounds of the scratch areas. Every kind, dtype, op and boundary size,
// exact against references on every rank.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "collective_check.h"
#include "core/ipc/ipc_collectives.h"
#include "core/reduce.h"
#include "core/tunables.h"
#include "reference.h"

using braid::CollKind;
using braid::DType;
using braid::IpcEngine;
using braid::IpcEvent;
using braid::ReduceOp;
using braid::Request;
using namespace braid_test;

namespace {

// A wait or record that breaks the ordering protocol: a bug in a schedule.
struct ProtocolViolation : std::logic_error {
  using std::logic_error::logic_error;
};
// Ranks that passed different tags to one host step (what the communicator reports as a
// CollectiveMismatch).
struct StepMismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Raised in every rank once one of them failed, so that none waits for it forever.
struct Aborted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A deadlock shows up as a wait this long, and fails the test instead of hanging it.
constexpr auto kStuck = std::chrono::seconds(30);

// The rank threads check results concurrently; the test registry is not thread-safe.
std::mutex check_mu;

#define LOCKED_CHECK_MSG(cond, msg)                \
  do {                                             \
    std::lock_guard<std::mutex> check_lk(check_mu); \
    CHECK_MSG(cond, msg);                          \
  } while (0)

const char* event_name(IpcEvent e) {
  switch (e) {
    case IpcEvent::kReady: return "kReady";
    case IpcEvent::kReduced: return "kReduced";
    case IpcEvent::kReadDone: return "kReadDone";
  }
  return "?";
}

// One operation queued on a rank's stream.
struct StreamOp {
  enum Kind { kCopy, kReduce, kRecord, kWait } kind = kCopy;
  char* dst = nullptr;
  const char* src = nullptr;
  size_t bytes = 0;
  std::vector<const void*> srcs;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int divisor = 1;
  int peer = 0;  // kWait: whose record
  size_t event = 0;  // index of (rank, event, slot) in the records
  uint64_t piece = 0;
};

class CpuIpcWorld;

// One rank's view of the world: IpcEngine's calls, queued on its stream.
class CpuIpcEngine final : public IpcEngine {
 public:
  CpuIpcEngine(CpuIpcWorld& w, int rank) : w_(w), rank_(rank) {}
  int slots() const override;
  size_t area_bytes() const override;
  char* scratch(int peer, int slot, int area) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op,
              int divisor) override;
  void signal(IpcEvent event, int slot, uint64_t piece) override;
  void wait(int peer, IpcEvent event, int slot, uint64_t piece) override;

 private:
  CpuIpcWorld& w_;
  const int rank_;
};

// N ranks of one host: their scratch, their event records, their streams (a thread each) and the
// rendezvous of their host steps, all under one lock.
class CpuIpcWorld {
 public:
  CpuIpcWorld(int world, int slots, size_t area_bytes, uint64_t seed, int max_delay_us = 30)
      : world_(world), slots_(slots), area_(area_bytes), max_delay_us_(max_delay_us),
        queued_(static_cast<size_t>(world * braid::kIpcEvents * slots), 0),
        done_(queued_.size(), 0), arrivals_(static_cast<size_t>(world)) {
    for (int r = 0; r < world; ++r) {
      // Not yet written scratch holds a pattern no test value has.
      scratch_.emplace_back(static_cast<size_t>(slots) * 2 * area_bytes / 8, 0xCDCDCDCDCDCDCDCDull);
      engines_.push_back(std::make_unique<CpuIpcEngine>(*this, r));
      streams_.push_back(std::make_unique<Stream>());
      streams_.back()->rng.seed(seed * 64 + static_cast<uint64_t>(r));
      sequences_.emplace_back();
      steps_.push_back(0);
    }
    for (int r = 0; r < world; ++r)
      streams_[static_cast<size_t>(r)]->thread = std::thread([this, r] { stream_loop(r); });
  }
  ~CpuIpcWorld() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      for (auto& s : streams_) s->queue.clear();
    }
    notify_everyone();
    for (auto& s : streams_) s->thread.join();
  }
  CpuIpcWorld(const CpuIpcWorld&) = delete;
  CpuIpcWorld& operator=(const CpuIpcWorld&) = delete;

  int world() const { return world_; }
  int slots() const { return slots_; }
  size_t area_bytes() const { return area_; }
  IpcEngine& engine(int rank) { return *engines_[static_cast<size_t>(rank)]; }
  braid::IpcSequence& sequence(int rank) { return sequences_[static_cast<size_t>(rank)]; }
  char* scratch(int rank, int slot, int area) {
    return reinterpret_cast<char*>(scratch_[static_cast<size_t>(rank)].data()) +
           (static_cast<size_t>(slot) * 2 + static_cast<size_t>(area)) * area_;
  }

  size_t record_index(int rank, IpcEvent e, int slot) const {
    return (static_cast<size_t>(rank) * braid::kIpcEvents + static_cast<size_t>(e)) * static_cast<size_t>(slots_) +
           static_cast<size_t>(slot);
  }

  // Queues a copy or a reduction, after checking that each of its ranges that lies in scratch
  // stays within one area (a piece is at most one area).
  void enqueue(int rank, StreamOp op) {
    const size_t bytes = op.kind == StreamOp::kCopy ? op.bytes : op.count * braid::dtype_size(op.dtype);
    check_within_area(op.dst, bytes);
    check_within_area(op.src, bytes);
    for (const void* p : op.srcs) check_within_area(static_cast<const char*>(p), bytes);
    std::lock_guard<std::mutex> lk(mu_);
    enqueue_locked(rank, std::move(op));
  }

  // Records must come in increasing piece order per (event, slot); a record is what peers wait for.
  void signal(int rank, IpcEvent e, int slot, uint64_t piece) {
    std::lock_guard<std::mutex> lk(mu_);
    const size_t i = record_index(rank, e, slot);
    if (piece <= queued_[i])
      throw ProtocolViolation("rank " + std::to_string(rank) + " records " + event_name(e) + " of slot " +
                              std::to_string(slot) + " for piece " + std::to_string(piece) + " after piece " +
                              std::to_string(queued_[i]));
    queued_[i] = piece;
    StreamOp op;
    op.kind = StreamOp::kRecord;
    op.event = i;
    op.piece = piece;
    enqueue_locked(rank, std::move(op));
  }

  // The check at queue time: the peer's latest queued record of (event, slot) must be `piece`.
  void wait(int rank, int peer, IpcEvent e, int slot, uint64_t piece) {
    std::lock_guard<std::mutex> lk(mu_);
    const size_t i = record_index(peer, e, slot);
    if (queued_[i] != piece)
      throw ProtocolViolation("rank " + std::to_string(rank) + " waits for rank " + std::to_string(peer) + "'s " +
                              event_name(e) + " of slot " + std::to_string(slot) + " for piece " +
                              std::to_string(piece) + ", but the latest record rank " + std::to_string(peer) +
                              " queued of it is for piece " + std::to_string(queued_[i]));
    StreamOp op;
    op.kind = StreamOp::kWait;
    op.peer = peer;
    op.event = i;
    op.piece = piece;
    enqueue_locked(rank, std::move(op));
  }

  // An all-gather of every rank's words, which also checks that every rank passed the same tag.
  void host_step(int rank, uint32_t tag, std::vector<int64_t>& words) {
    std::unique_lock<std::mutex> lk(mu_);
    if (aborted_) throw Aborted(reason_);
    ++steps_[static_cast<size_t>(rank)];
    const uint64_t gen = step_gen_;
    arrivals_[static_cast<size_t>(rank)] = {tag, words};
    if (++arrived_ == world_) {
      step_words_.clear();
      step_error_.clear();
      for (int p = 0; p < world_; ++p) {
        const Arrival& a = arrivals_[static_cast<size_t>(p)];
        step_words_.insert(step_words_.end(), a.words.begin(), a.words.end());
        if (a.tag != arrivals_[0].tag && step_error_.empty())
          step_error_ = "host step: rank 0 passed tag " + std::to_string(arrivals_[0].tag) + ", rank " +
                        std::to_string(p) + " tag " + std::to_string(a.tag);
        if (a.words.size() != arrivals_[0].words.size() && step_error_.empty())
          step_error_ = "host step: ranks passed different numbers of words";
      }
      arrived_ = 0;
      ++step_gen_;
      step_cv_.notify_all();
    } else if (!step_cv_.wait_for(lk, kStuck, [&] { return step_gen_ != gen || aborted_; })) {
      abort_locked("rank " + std::to_string(rank) + " waited 30 s in a host step");
    }
    // The words of step `gen` stay until step gen + 1 completes, which needs this rank.
    if (step_gen_ == gen) throw Aborted(reason_);
    if (!step_error_.empty()) throw StepMismatch(step_error_);
    words = step_words_;
  }

  // Waits until `rank`'s stream ran everything queued on it.
  void finish(int rank) {
    std::unique_lock<std::mutex> lk(mu_);
    Stream& s = *streams_[static_cast<size_t>(rank)];
    if (!idle_cv_.wait_for(lk, kStuck, [&] { return (s.queue.empty() && !s.busy) || aborted_; }))
      abort_locked("rank " + std::to_string(rank) + "'s stream did not finish in 30 s");
    if (aborted_) throw Aborted(reason_);
  }

  // Waits until `rank`'s stream runs nothing more: everything queued ran, or the world stopped
  // and dropped it. A rank's buffers may go only then.
  void quiesce(int rank) {
    std::unique_lock<std::mutex> lk(mu_);
    Stream& s = *streams_[static_cast<size_t>(rank)];
    if (!idle_cv_.wait_for(lk, kStuck, [&] { return s.queue.empty() && !s.busy; }))
      abort_locked("rank " + std::to_string(rank) + "'s stream did not finish in 30 s");
  }

  // Stops every rank: their host steps and finish() throw, their streams drop what is queued.
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lk(mu_);
    abort_locked(why);
  }
  std::string failure() {
    std::lock_guard<std::mutex> lk(mu_);
    return aborted_ ? reason_ : std::string();
  }
  // Host steps `rank` took, and operations it queued, so far.
  int steps(int rank) {
    std::lock_guard<std::mutex> lk(mu_);
    return steps_[static_cast<size_t>(rank)];
  }
  uint64_t ops_queued(int rank) {
    std::lock_guard<std::mutex> lk(mu_);
    return streams_[static_cast<size_t>(rank)]->queued;
  }

 private:
  struct Stream {
    std::deque<StreamOp> queue;
    bool busy = false;  // an operation taken off the queue is running
    uint64_t queued = 0;
    std::condition_variable cv;  // its queue grew, or the world stops
    std::mt19937_64 rng;
    std::thread thread;
  };
  struct Arrival {
    uint32_t tag = 0;
    std::vector<int64_t> words;
  };

  void check_within_area(const char* p, size_t bytes) const {
    for (size_t r = 0; r < scratch_.size(); ++r) {
      const auto* base = reinterpret_cast<const char*>(scratch_[r].data());
      if (p < base || p >= base + scratch_[r].size() * 8) continue;
      const size_t at = static_cast<size_t>(p - base), area_end = (at / area_ + 1) * area_;
      if (at + bytes > area_end)
        throw ProtocolViolation(std::to_string(bytes) + " bytes at offset " + std::to_string(at % area_) +
                                " of an area of rank " + std::to_string(r) + " run past its " +
                                std::to_string(area_) + " bytes");
    }
  }

  void enqueue_locked(int rank, StreamOp op) {
    Stream& s = *streams_[static_cast<size_t>(rank)];
    s.queue.push_back(std::move(op));
    ++s.queued;
    s.cv.notify_one();
  }

  void notify_everyone() {
    for (auto& s : streams_) s->cv.notify_all();
    records_cv_.notify_all();
    idle_cv_.notify_all();
    step_cv_.notify_all();
  }

  void abort_locked(const std::string& why) {
    if (!aborted_) {
      aborted_ = true;
      reason_ = why;
    }
    for (auto& s : streams_) s->queue.clear();
    notify_everyone();
  }

  // A small random delay before each operation: streams run behind their hosts and out of step
  // with each other, as GPU streams do.
  void delay(uint64_t draw) const {
    switch (draw % 8) {
      case 0: case 1: case 2: case 3: return;
      case 4: case 5: std::this_thread::yield(); return;
      default:
        std::this_thread::sleep_for(std::chrono::microseconds((draw >> 8) % static_cast<uint64_t>(max_delay_us_)));
    }
  }

  void stream_loop(int rank) {
    Stream& s = *streams_[static_cast<size_t>(rank)];
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      s.cv.wait(lk, [&] { return stop_ || !s.queue.empty(); });
      if (s.queue.empty()) return;
      StreamOp op = std::move(s.queue.front());
      s.queue.pop_front();
      s.busy = true;
      const uint64_t draw = s.rng();
      lk.unlock();
      delay(draw);
      if (op.kind == StreamOp::kCopy) {
        std::memcpy(op.dst, op.src, op.bytes);
      } else if (op.kind == StreamOp::kReduce) {
        std::vector<braid::Operand> operands;
        for (const void* p : op.srcs) operands.push_back(braid::Operand{p, false});
        braid::reduce_n(op.dtype, op.op, operands.data(), static_cast<int>(operands.size()),
                        braid::ReduceDst::result(op.dst, op.divisor), op.count);
      }
      lk.lock();
      if (op.kind == StreamOp::kRecord) {
        done_[op.event] = op.piece;
        records_cv_.notify_all();
      } else if (op.kind == StreamOp::kWait) {
        // As cudaStreamWaitEvent: the record captured at queue time, or any later one, releases it.
        if (!records_cv_.wait_for(lk, kStuck, [&] { return done_[op.event] >= op.piece || aborted_ || stop_; }))
          abort_locked("rank " + std::to_string(rank) + "'s stream waited 30 s for rank " + std::to_string(op.peer) +
                       "'s record of piece " + std::to_string(op.piece));
      }
      s.busy = false;
      if (s.queue.empty()) idle_cv_.notify_all();
    }
  }

  const int world_, slots_;
  const size_t area_;
  const int max_delay_us_;
  std::vector<std::vector<uint64_t>> scratch_;
  std::vector<std::unique_ptr<CpuIpcEngine>> engines_;
  std::vector<braid::IpcSequence> sequences_;

  std::mutex mu_;
  // Waits on records, on idle streams and in host steps, each woken apart from the others.
  std::condition_variable records_cv_, idle_cv_, step_cv_;
  // Per (rank, event, slot): the piece of the latest record queued, and of the latest one run.
  std::vector<uint64_t> queued_, done_;
  std::vector<std::unique_ptr<Stream>> streams_;
  bool stop_ = false, aborted_ = false;
  std::string reason_;
  // The host steps' rendezvous.
  std::vector<Arrival> arrivals_;
  int arrived_ = 0;
  uint64_t step_gen_ = 0;
  std::vector<int64_t> step_words_;
  std::string step_error_;
  std::vector<int> steps_;
};

int CpuIpcEngine::slots() const { return w_.slots(); }
size_t CpuIpcEngine::area_bytes() const { return w_.area_bytes(); }
char* CpuIpcEngine::scratch(int peer, int slot, int area) { return w_.scratch(peer, slot, area); }

void CpuIpcEngine::copy(void* dst, const void* src, size_t bytes) {
  StreamOp op;
  op.kind = StreamOp::kCopy;
  op.dst = static_cast<char*>(dst);
  op.src = static_cast<const char*>(src);
  op.bytes = bytes;
  w_.enqueue(rank_, std::move(op));
}

void CpuIpcEngine::reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op,
                          int divisor) {
  StreamOp o;
  o.kind = StreamOp::kReduce;
  o.dst = static_cast<char*>(dst);
  o.srcs.assign(srcs, srcs + nsrcs);
  o.count = count;
  o.dtype = dtype;
  o.op = op;
  o.divisor = divisor;
  w_.enqueue(rank_, std::move(o));
}

void CpuIpcEngine::signal(IpcEvent event, int slot, uint64_t piece) { w_.signal(rank_, event, slot, piece); }
void CpuIpcEngine::wait(int peer, IpcEvent event, int slot, uint64_t piece) {
  w_.wait(rank_, peer, event, slot, piece);
}

// What a rank's body gets.
struct Rank {
  int rank;
  int world;
  IpcEngine& engine;
  braid::IpcSequence& seq;
  braid::IpcHostStep step;
};

// Declared after a rank's buffers, so destroyed before them, also when the rank throws: its
// stream no longer touches them.
class QuietOnExit {
 public:
  QuietOnExit(CpuIpcWorld& w, int rank) : w_(w), rank_(rank) {}
  ~QuietOnExit() { w_.quiesce(rank_); }
  QuietOnExit(const QuietOnExit&) = delete;
  QuietOnExit& operator=(const QuietOnExit&) = delete;

 private:
  CpuIpcWorld& w_;
  const int rank_;
};

// Runs `body` for every rank of `w`, each on a thread of its own, then waits for its stream. A
// rank that throws stops the others; the first failure is recorded.
void run_ranks(CpuIpcWorld& w, const std::function<void(Rank&)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < w.world(); ++r) {
    threads.emplace_back([&w, &body, r] {
      Rank k{r, w.world(), w.engine(r), w.sequence(r),
             [&w, r](uint32_t tag, std::vector<int64_t>& words) { w.host_step(r, tag, words); }};
      try {
        body(k);
        w.finish(r);
      } catch (const std::exception& e) {
        w.abort("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  const std::string failure = w.failure();
  CHECK_MSG(failure.empty(), failure);
}

// Elements of one piece: of a whole area, or (reduce_scatter, all_to_all) of one of N windows,
// rounded down to whole 16 bytes, as the schedules cut them.
size_t piece_elems(CollKind kind, DType dt, int world, size_t area) {
  const size_t es = braid::dtype_size(dt);
  if (kind != CollKind::kReduceScatter && kind != CollKind::kAllToAll) return area / es;
  const size_t w = area / (static_cast<size_t>(world) * es), a = std::max<size_t>(1, 16 / es);
  return w >= a ? w / a * a : w;
}

// 0, 1, primes, and one element around 1, `slots` (every slot in use) and slots + 1 (a slot
// reused within the call) pieces.
std::vector<size_t> boundary_counts(CollKind kind, DType dt, int world, int slots, size_t area) {
  const size_t piece = piece_elems(kind, dt, world, area);
  std::set<size_t> counts = {0, 1, 2, 3, 5, 13, 61, 127};
  for (size_t k : {size_t(1), static_cast<size_t>(slots), static_cast<size_t>(slots) + 1})
    for (size_t c : {k * piece - 1, k * piece, k * piece + 1}) counts.insert(c);
  return {counts.begin(), counts.end()};
}

// Runs `calls` on every rank of `w` in order, `batch` calls queued before the streams are awaited
// and the results checked, so that hosts run ahead of their streams across calls as well.
void run_calls(CpuIpcWorld& w, const std::vector<CallSpec>& calls, size_t batch = 4) {
  run_ranks(w, [&](Rank& k) {
    std::vector<std::unique_ptr<PreparedCall>> pending;
    const QuietOnExit quiet(w, k.rank);
    auto settle = [&] {
      w.finish(k.rank);
      std::lock_guard<std::mutex> lk(check_mu);
      for (const auto& c : pending) c->check();
      pending.clear();
    };
    for (const CallSpec& s : calls) {
      pending.push_back(std::make_unique<PreparedCall>(s, k.rank, k.world));
      try {
        braid::run_ipc(k.engine, k.seq, pending.back()->request(), k.rank, k.world, k.step);
      } catch (const std::exception& e) {
        throw std::runtime_error(describe(s) + ": " + e.what());
      }
      if (pending.size() == batch) settle();
    }
    settle();
  });
}

constexpr CollKind kKinds[] = {CollKind::kAllReduce, CollKind::kReduceScatter, CollKind::kAllGather,
                               CollKind::kBroadcast, CollKind::kAllToAll};
constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

bool reduces(CollKind k) { return k == CollKind::kAllReduce || k == CollKind::kReduceScatter; }

// Every kind, dtype and op (reductions) at every boundary count, in place and out of place, the
// broadcast root rotating, a barrier after each kind and dtype: with 256-byte areas every call
// of more than a few elements takes several pieces, and slots are reused within calls and across
// calls of different kinds.
void sweep(int world, int slots) {
  constexpr size_t kArea = 256;
  CpuIpcWorld w(world, slots, kArea, 100 + static_cast<uint64_t>(world));
  std::vector<CallSpec> calls;
  int call = 0;
  for (CollKind kind : kKinds) {
    for (DType dt : kDTypes) {
      for (ReduceOp op : kOps) {
        if (!reduces(kind) && op != ReduceOp::kSum) continue;
        for (size_t count : boundary_counts(kind, dt, world, slots, kArea)) {
          CallSpec s;
          s.kind = kind;
          s.dtype = dt;
          s.op = op;
          s.count = count;
          s.root = call % world;
          s.in_place = call % 2 == 1 && kind != CollKind::kAllToAll;
          s.call = call++;
          calls.push_back(s);
        }
      }
      CallSpec barrier;
      barrier.kind = CollKind::kBarrier;
      calls.push_back(barrier);
    }
  }
  run_calls(w, calls);
}

}  // namespace

BRAID_TEST(every_kind_one_rank) { sweep(1, 3); }
BRAID_TEST(every_kind_two_ranks) { sweep(2, 2); }
BRAID_TEST(every_kind_three_ranks) { sweep(3, 3); }
BRAID_TEST(every_kind_four_ranks) { sweep(4, 2); }
BRAID_TEST(every_kind_five_ranks) { sweep(5, 3); }

namespace {

// Values with full mantissas (in [-100, 100)): sums of them round differently in another order.
double ragged_value(int rank, int call, size_t i) {
  uint64_t h = (static_cast<uint64_t>(rank) * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(call) << 40) ^
               (static_cast<uint64_t>(i) * 0xD6E8FEB86659FD93ull);
  h ^= h >> 32;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  return (static_cast<double>(h >> 11) * 0x1p-53 * 2 - 1) * 100;
}

struct Reduction {
  CollKind kind = CollKind::kAllReduce;  // or kReduceScatter
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  size_t count = 0;  // as in Request
  bool in_place = false;
  int call = 0;  // seeds the inputs
};

// Runs `s` on every rank of `w` with ragged inputs and checks the result bit for bit against the
// reduction in rank order rounded once (float32 accumulation for half types), computed once
// here for every rank; in place, the rest of the input must stay as it was, and a guard element
// past the result must stay untouched.
void check_reduction(CpuIpcWorld& w, const Reduction& s) {
  const int n = w.world();
  const size_t parts = s.kind == CollKind::kReduceScatter ? static_cast<size_t>(n) : 1, total = parts * s.count;
  constexpr double kGuard = 777;
  Buffer want(s.dtype, total);
  visit_dtype(s.dtype, [&](auto ref) {
    using R = decltype(ref);
    using Acc = typename R::Acc;
    for (size_t i = 0; i < total; ++i) {
      Acc a{};
      for (int p = 0; p < n; ++p) {
        const Acc x = R::load(R::store(static_cast<Acc>(ragged_value(p, s.call, i))));
        a = p == 0 ? x : ref_apply(s.op, a, x);
      }
      if (s.op == ReduceOp::kAvg) a = a / static_cast<Acc>(n);
      const typename R::T t = R::store(a);
      std::memcpy(want.at(i), &t, sizeof(t));
    }
  });
  run_ranks(w, [&](Rank& k) {
    const size_t mine = s.kind == CollKind::kReduceScatter ? static_cast<size_t>(k.rank) * s.count : 0;
    Buffer in(s.dtype, total + 1), out(s.dtype, s.count + 1);
    const QuietOnExit quiet(w, k.rank);
    for (size_t i = 0; i < total; ++i) in.set(i, ragged_value(k.rank, s.call, i));
    // The buffer the result lands in, and what all of it must hold afterwards.
    Buffer& result = s.in_place ? in : out;
    Buffer expected = result;
    std::memcpy(expected.at(s.in_place ? mine : 0), want.at(mine), s.count * braid::dtype_size(s.dtype));
    result.set(result.count() - 1, kGuard);
    expected.set(expected.count() - 1, kGuard);
    Request r = braid::make_request(s.kind, s.dtype, s.count, in.data(), s.in_place ? in.at(mine) : out.data());
    r.op = s.op;
    braid::run_ipc(k.engine, k.seq, r, k.rank, k.world, k.step);
    w.finish(k.rank);
    const std::string diff = compare(s.dtype, result.data(), expected.data(), expected.count());
    LOCKED_CHECK_MSG(diff.empty(), std::string(braid::coll_kind_name(s.kind)) + " " + braid::dtype_name(s.dtype) + " " +
                                       braid::reduce_op_name(s.op) + " count " + std::to_string(s.count) +
                                       (s.in_place ? " in place" : "") + " on rank " + std::to_string(k.rank) +
                                       ": " + diff);
  });
}

}  // namespace

// all_reduce one element below, at and above the one-shot threshold (the last in two shots),
// and with a last two-shot piece of 13 elements (uneven chunks, the last ones empty), for every
// world size: 4 or 5 pieces of 64 KiB areas through 2 slots (the 256-byte areas of the sweeps
// would take thousands of pieces here).
BRAID_TEST(all_reduce_around_the_one_shot_threshold) {
  const size_t threshold = braid::ipc_one_shot_max_bytes();
  const std::pair<DType, ReduceOp> cases[] = {
      {DType::kFloat32, ReduceOp::kSum}, {DType::kBFloat16, ReduceOp::kMin}, {DType::kInt64, ReduceOp::kMax}};
  for (int world = 1; world <= 5; ++world) {
    CpuIpcWorld w(world, 2, 64 * 1024, 200 + static_cast<uint64_t>(world));
    int call = 0;
    for (const auto& [dt, op] : cases) {
      const size_t at = threshold / braid::dtype_size(dt);
      std::set<size_t> counts = {at, at + 1, at + 13};
      if (at > 0) counts.insert(at - 1);
      for (size_t count : counts) {
        Reduction s;
        s.dtype = dt;
        s.op = op;
        s.count = count;
        s.in_place = call % 2 == 1;
        s.call = call++;
        check_reduction(w, s);
      }
    }
  }
}

// Sums of values with full mantissas come out of one-shot, two-shot and reduce_scatter bit for
// bit as the sum in rank order rounded once: no partial sum is rounded to a half type on the way,
// and no rank starts from another operand than rank 0's.
BRAID_TEST(sums_in_rank_order_rounded_once) {
  const size_t threshold = braid::ipc_one_shot_max_bytes();
  for (int world : {3, 5}) {
    CpuIpcWorld w(world, 2, 64 * 1024, 300 + static_cast<uint64_t>(world));
    int call = 0;
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        for (const auto& [kind, count] : {std::pair<CollKind, size_t>{CollKind::kAllReduce, 1000},
                                          {CollKind::kAllReduce, threshold / braid::dtype_size(dt) + 100},
                                          {CollKind::kReduceScatter, 7000}}) {
          Reduction s;
          s.kind = kind;
          s.dtype = dt;
          s.op = op;
          s.count = count;
          s.in_place = call % 2 == 1;
          s.call = call++;
          check_reduction(w, s);
        }
      }
    }
  }
}

namespace {

constexpr double kA2avJunk = 4000;  // exact in every dtype used, never a sent value

// Sent values: integers below 2000, exact in float16.
double split_value(int src, int dst, int call, size_t j) {
  return static_cast<double>((static_cast<uint64_t>(src) * 7919 + static_cast<uint64_t>(dst) * 104729 +
                              static_cast<uint64_t>(call) * 1299709 + j * 31) %
                             2000);
}

// counts[p][q]: elements rank p sends to rank q.
using SplitMatrix = std::vector<std::vector<int64_t>>;

// One all_to_all_v on every rank: messages laid out with a one-element gap before each (offsets
// are honoured, and the gaps of the output must stay untouched), checked exactly.
void run_split(CpuIpcWorld& w, DType dt, const SplitMatrix& counts, int call) {
  const int n = w.world();
  run_ranks(w, [&](Rank& k) {
    const int me = k.rank;
    std::vector<int64_t> send_counts(n), send_offsets(n), recv_counts(n), recv_offsets(n);
    int64_t in_len = 0, out_len = 0;
    for (int q = 0; q < n; ++q) {
      send_counts[q] = counts[me][q];
      send_offsets[q] = in_len + 1;
      in_len += 1 + send_counts[q];
      recv_counts[q] = counts[q][me];
      recv_offsets[q] = out_len + 1;
      out_len += 1 + recv_counts[q];
    }
    Buffer in(dt, static_cast<size_t>(in_len)), out(dt, static_cast<size_t>(out_len)),
        want(dt, static_cast<size_t>(out_len));
    const QuietOnExit quiet(w, me);
    for (int64_t i = 0; i < in_len; ++i) in.set(static_cast<size_t>(i), kA2avJunk);
    for (int64_t i = 0; i < out_len; ++i) {
      out.set(static_cast<size_t>(i), kA2avJunk);
      want.set(static_cast<size_t>(i), kA2avJunk);
    }
    for (int q = 0; q < n; ++q) {
      for (int64_t j = 0; j < send_counts[q]; ++j)
        in.set(static_cast<size_t>(send_offsets[q] + j), split_value(me, q, call, static_cast<size_t>(j)));
      for (int64_t j = 0; j < recv_counts[q]; ++j)
        want.set(static_cast<size_t>(recv_offsets[q] + j), split_value(q, me, call, static_cast<size_t>(j)));
    }
    braid::run_ipc_all_to_all_v(k.engine, k.seq, dt, in.data(), out.data(), send_counts, send_offsets, recv_counts,
                                recv_offsets, me, n, k.step);
    w.finish(me);
    const std::string diff = compare(dt, out.data(), want.data(), static_cast<size_t>(out_len));
    LOCKED_CHECK_MSG(diff.empty(), "all_to_all_v call " + std::to_string(call) + " " + braid::dtype_name(dt) +
                                       " on rank " + std::to_string(me) + ": " + diff);
  });
}

}  // namespace

// Uneven split sizes, zeros among them (whole calls of zeros too), messages of up to five
// windows of 256-byte areas: rounds in which some pairs are done and others are not.
BRAID_TEST(all_to_all_v_uneven) {
  for (int world = 1; world <= 5; ++world) {
    CpuIpcWorld w(world, 2, 256, 400 + static_cast<uint64_t>(world));
    std::mt19937_64 rng(static_cast<uint64_t>(world));
    int call = 0;
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kInt64}) {
      const auto window = static_cast<int64_t>(piece_elems(CollKind::kAllToAll, dt, world, 256));
      for (int shape = 0; shape < 4; ++shape) {
        SplitMatrix counts(static_cast<size_t>(world), std::vector<int64_t>(static_cast<size_t>(world), 0));
        for (auto& row : counts) {
          for (auto& c : row) {
            // Shape 0: nothing at all; 1: a few elements; 2 and 3: up to five windows and one more.
            const auto most = static_cast<uint64_t>(shape == 0 ? 0 : shape == 1 ? 3 : 5 * window + 1);
            c = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % (most + 1));
          }
        }
        run_split(w, dt, counts, call++);
      }
    }
  }
}

// Split sizes that disagree (rank 1 expects one element more from rank 0 than rank 0 sends) fail
// on every rank with std::invalid_argument naming both ranks and both counts, before anything
// moves; the ranks then go on in step.
BRAID_TEST(all_to_all_v_disagreement_raises_on_every_rank) {
  constexpr int kWorld = 3;
  CpuIpcWorld w(kWorld, 2, 256, 500);
  std::vector<std::string> messages(kWorld);
  run_ranks(w, [&](Rank& k) {
    std::vector<int64_t> send(kWorld, 5), offsets{0, 5, 10}, recv(kWorld, 5);
    if (k.rank == 1) recv[0] = 6;
    std::vector<uint64_t> in(16), out(16);
    const QuietOnExit quiet(w, k.rank);
    try {
      braid::run_ipc_all_to_all_v(k.engine, k.seq, DType::kInt64, in.data(), out.data(), send, offsets, recv, offsets,
                                  k.rank, kWorld, k.step);
    } catch (const std::invalid_argument& e) {
      messages[static_cast<size_t>(k.rank)] = e.what();
    }
    std::lock_guard<std::mutex> lk(check_mu);
    CHECK_EQ(w.ops_queued(k.rank), uint64_t{0});
  });
  for (const std::string& m : messages)
    CHECK_MSG(m.find("rank 0 sends 5 elements to rank 1, which expects 6") != std::string::npos,
              "message: '" + m + "'");
  run_split(w, DType::kInt64, SplitMatrix(kWorld, std::vector<int64_t>(kWorld, 70)), 0);
}

// Calls of no elements (null buffers, as torch passes for empty tensors) and barriers take
// exactly one host step each, queue nothing and use no piece, on every rank.
BRAID_TEST(empty_calls_take_one_host_step) {
  constexpr int kWorld = 3;
  CpuIpcWorld w(kWorld, 2, 256, 600);
  run_ranks(w, [&](Rank& k) {
    int steps = 0;
    for (CollKind kind : {CollKind::kAllReduce, CollKind::kReduceScatter, CollKind::kAllGather, CollKind::kBroadcast,
                          CollKind::kAllToAll, CollKind::kBarrier}) {
      braid::run_ipc(k.engine, k.seq, braid::make_request(kind, DType::kFloat32, 0), k.rank, k.world, k.step);
      ++steps;
    }
    const std::vector<int64_t> zeros(kWorld, 0);
    braid::run_ipc_all_to_all_v(k.engine, k.seq, DType::kFloat32, nullptr, nullptr, zeros, zeros, zeros, zeros, k.rank,
                                k.world, k.step);
    ++steps;
    std::lock_guard<std::mutex> lk(check_mu);
    CHECK_EQ(w.steps(k.rank), steps);
    CHECK_EQ(w.ops_queued(k.rank), uint64_t{0});
    CHECK_EQ(k.seq.piece, uint64_t{0});
  });
}

// Ranks that issue different calls (here all_reduce counts 5 and 6) fail at their first host
// step, on every rank: the step's tag tells the calls apart.
BRAID_TEST(different_calls_fail_at_the_first_step) {
  constexpr int kWorld = 2;
  CpuIpcWorld w(kWorld, 2, 256, 700);
  int mismatches = 0;
  run_ranks(w, [&](Rank& k) {
    std::vector<float> in(6, 1.0f), out(6);
    const QuietOnExit quiet(w, k.rank);
    try {
      const size_t count = 5 + static_cast<size_t>(k.rank);
      const Request r = braid::make_request(CollKind::kAllReduce, DType::kFloat32, count, in.data(), out.data());
      braid::run_ipc(k.engine, k.seq, r, k.rank, k.world, k.step);
    } catch (const StepMismatch&) {
      std::lock_guard<std::mutex> lk(check_mu);
      ++mismatches;
    }
  });
  CHECK_EQ(mismatches, kWorld);
}

// The engine's check at queue time catches waits that break the protocol: for a piece the peer
// has not recorded last (an older one, a later one, another slot, an event never recorded),
// records out of piece order, and copies that run past the end of a scratch area.
BRAID_TEST(protocol_check_catches_wrong_waits) {
  CpuIpcWorld w(2, 2, 256, 800);
  IpcEngine& a = w.engine(0);
  IpcEngine& b = w.engine(1);
  auto violates = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const ProtocolViolation&) {
      return true;
    }
    return false;
  };
  a.signal(IpcEvent::kReady, 0, 1);
  a.signal(IpcEvent::kReady, 0, 3);
  CHECK(violates([&] { b.wait(0, IpcEvent::kReady, 0, 1); }));  // superseded by piece 3
  CHECK(violates([&] { b.wait(0, IpcEvent::kReady, 0, 5); }));  // not recorded yet
  CHECK(violates([&] { b.wait(0, IpcEvent::kReady, 1, 3); }));  // another slot
  CHECK(violates([&] { b.wait(0, IpcEvent::kReadDone, 0, 3); }));  // never recorded
  CHECK(violates([&] { a.signal(IpcEvent::kReady, 0, 3); }));  // not after piece 3
  CHECK(violates([&] { b.copy(b.scratch(0, 1, 0) + 8, b.scratch(1, 0, 0), w.area_bytes()); }));
  CHECK(!violates([&] { b.wait(0, IpcEvent::kReady, 0, 3); }));
  w.finish(0);
  w.finish(1);
}

// BRAID_IPC_ONE_SHOT_MAX_BYTES is read with the other knobs, with a size suffix, and a
// malformed value is refused naming it.
BRAID_TEST(one_shot_knob_from_env) {
  const char* kName = "BRAID_IPC_ONE_SHOT_MAX_BYTES";
  const char* before = std::getenv(kName);
  const std::string saved = before != nullptr ? before : "";
  ::setenv(kName, "1M", 1);
  CHECK_EQ(braid::Tunables::from_env().ipc_one_shot_max_bytes, size_t{1} << 20);
  ::setenv(kName, "12Q", 1);
  std::string error;
  try {
    braid::Tunables::from_env();
  } catch (const std::invalid_argument& e) {
    error = e.what();
  }
  CHECK_MSG(error.find(kName) != std::string::npos, "error: '" + error + "'");
  if (before != nullptr) {
    ::setenv(kName, saved.c_str(), 1);
  } else {
    ::unsetenv(kName);
  }
}
