// The flight recorder: each communicator's last calls in a ring buffer (what was called, the
// algorithm chosen, bytes per transport, state and times, the issuing thread, optionally the
// Python stack), written as one JSON file per rank when something goes wrong so that
// `python -m braid.trace analyze DIR` can name the rank and the call where ranks diverged.
//
// Cost: per call, one atomic increment, two reads of a tick counter and a few stores into the
// call's slot at each state change (issued and started, written together when the issuing thread
// runs the call at once; completed), no lock; strings are copied only for errors and stacks.
// BRAID_TRACE_BUFFER=0 turns it off, Communicator::set_trace_enabled pauses it. The dump format is docs/trace.md's ("braid-trace", version 1).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collective.h"
#include "dtype.h"

namespace braid {

enum class TraceState : uint8_t { kIssued = 0, kStarted = 1, kCompleted = 2, kFailed = 3 };

// One call as the dump shows it (times in microseconds since the epoch; 0: not yet).
struct TraceEntry {
  uint64_t id = 0;   // 1-based count of calls recorded (0: an empty slot)
  uint64_t seq = 0;  // the collective's sequence number once started (0: none, or point-to-point)
  CollKind kind = CollKind::kBarrier;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;  // broadcast: the source; send / recv: the peer
  uint64_t count = 0;
  const char* label = nullptr;  // a name other than the kind's (static storage), or null
  const char* algo = nullptr;   // static storage, or null
  uint64_t shm_bytes = 0, tcp_bytes = 0;
  double wire_ratio = -1.0;  // < 0: not a compressed call
  TraceState state = TraceState::kIssued;
  int64_t issued_us = 0, started_us = 0, completed_us = 0;
  long thread = 0;
  std::string error;
  std::string stack;
};

// A composite call as the recorder names it (Communicator::submit_task): e.g. a compressed
// all_reduce of `count` elements of `dtype`, `wire_ratio` its bytes on the wire over the exact
// call's (< 0: not known).
struct TaskTrace {
  const char* label = nullptr;  // static storage; null: not recorded as a call of its own
  DType dtype = DType::kFloat32;
  uint64_t count = 0;
  double wire_ratio = -1.0;
};

// What a dump says of the communicator beside its entries.
struct TraceIdentity {
  std::string comm_id;          // the same on every rank of the communicator
  std::vector<int> hosts;       // host index of every rank
  std::string hostname;
  std::string version;          // braid's
};

// The ring. Writers take no lock: a call's slot is written by the thread that issues it, then by
// the one that runs it (ordered by the hand-over between them), each write inside a sequence
// count that a reader (a dump) checks, retrying a slot caught mid-write. Times are ticks of a
// cheap counter (the TSC on x86-64, else the steady clock) converted to wall-clock microseconds
// when a dump is written. Errors and stacks, rare, live beside the ring under a lock.
class Recorder {
 public:
  explicit Recorder(size_t capacity);
  // Whether calls are being recorded: a ring was made (capacity > 0) and recording is not paused.
  bool on() const { return capacity_ != 0 && recording_.load(std::memory_order_relaxed); }
  size_t capacity() const { return capacity_; }
  // Pauses (false) or resumes recording; calls issued while paused leave no entry (calls already
  // recorded still complete theirs). A recorder without a ring stays off.
  void set_recording(bool on) { recording_.store(on, std::memory_order_relaxed); }

  // A new call; returns its id (0 when the recorder is off). `stack`: the caller's Python stack,
  // moved from when not empty. `started`: the call starts now, on this thread, as sequence number
  // `seq` (a blocking call run by the thread that issued it: one entry written once, with one
  // clock read, for the issue and the start).
  uint64_t issue(CollKind kind, DType dtype, ReduceOp op, uint64_t count, int root, const char* label,
                 std::string* stack = nullptr, uint64_t seq = 0, bool started = false);
  void start(uint64_t id, uint64_t seq);
  void set_algo(uint64_t id, const char* algo);
  void set_wire_ratio(uint64_t id, double ratio);
  void complete(uint64_t id, const char* algo, uint64_t shm_bytes, uint64_t tcp_bytes);
  void fail(uint64_t id, const std::string& error);

  // The dump (docs/trace.md) of the entries recorded so far, oldest first.
  std::string to_json(const TraceIdentity& who, int rank, int world, const std::string& reason) const;

 private:
  // Two cache lines, aligned: a call touches no line of another's.
  struct alignas(64) Slot {
    std::atomic<uint32_t> version{0};  // odd while a writer is in it
    uint64_t id = 0, seq = 0, count = 0, shm_bytes = 0, tcp_bytes = 0;
    uint64_t issued = 0, started = 0, completed = 0;  // ticks
    const char* label = nullptr;
    const char* algo = nullptr;
    double wire_ratio = -1.0;
    long thread = 0;
    int root = -1;
    CollKind kind = CollKind::kBarrier;
    DType dtype = DType::kFloat32;
    ReduceOp op = ReduceOp::kSum;
    TraceState state = TraceState::kIssued;
    bool has_text = false;  // an error or a stack in texts_
  };
  // Runs `write` on id's slot inside its sequence count, unless the ring moved past the call.
  template <class F>
  void update(uint64_t id, F&& write);
  bool snapshot(size_t slot, TraceEntry& out) const;  // false: being rewritten

  Slot& slot_of(uint64_t id) const { return slots_[(id - 1) & mask_]; }

  size_t capacity_;  // the calls a dump shows at most
  // The ring holds the next power of two of slots at or above capacity_: a call finds its slot
  // with a mask (a division, at each of the three writes, cost as much as all the rest together).
  size_t mask_;
  std::atomic<bool> recording_{true};
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> recorded_{0};
  mutable std::mutex text_mu_;
  std::vector<std::string> errors_, stacks_;  // per slot, under text_mu_
  uint64_t tick0_ = 0;    // the tick counter and the wall clock (ns) read together at creation
  int64_t wall0_ns_ = 0;
};

// Microseconds since the epoch (system clock: comparable between the ranks of a host, and
// between hosts as far as their clocks agree).
int64_t wall_us();
// The calling thread's OS id.
long os_thread_id();
// Writes `text` to `dir`/`name` through a temporary file renamed into place (a reader never sees
// half a dump); creates `dir` if needed. Returns the path; throws std::runtime_error naming it.
std::string write_dump(const std::string& dir, const std::string& name, const std::string& text);

// BRAID_TRACE_SIGNAL: the signal (a number, or a name such as USR1 or SIGUSR1) on which every
// communicator with a dump directory dumps. Installs the handler once; returns the count of
// signals seen so far (a watcher dumps when it changes). 0 when none is configured.
uint64_t trace_signals_seen();
void install_trace_signal();
bool trace_signals_configured();  // whether install_trace_signal() installed a handler

}  // namespace braid
