// Collectives on device memory between the ranks of one host, each rank reading its peers' scratch
// buffers directly (CUDA IPC on a GPU): the schedules, written once against IpcEngine; the CUDA
// engine lives in csrc/cuda/ipc, a CPU one in csrc/tests/ipc_test.cc.
//
// Ordering. Every rank owns a scratch area of `slots()` slots; a call moves its data in pieces of
// at most one slot, piece g (the communicator's g-th IPC piece, counted from 1, equal on every
// rank) in slot (g - 1) % slots. Three events per slot say how far a rank's stream got with it:
//   kReady:    its input for piece g is in its slot's area 0;
//   kReduced:  its share of piece g is reduced into its slot's area 1 (two-shot all-reduce);
//   kReadDone: it finished reading its peers' slots for piece g.
// A stream waits for a peer's event only after a host step (a collective of the host ranks over
// the communicator's shared memory, run by the caller of run_ipc) showed that the peer already
// queued the record it needs, so "the latest record at the time of the wait" (CUDA's rule for
// cudaStreamWaitEvent) is exactly that piece's record: a peer queues its records of piece
// g + slots() only after its host steps of piece g + slots() - 1 > g, which need this rank to have
// reached them, after this wait (slots() >= 2). Before a rank overwrites its slot for piece g it waits for every peer's
// kReadDone of piece g - slots(): nobody still reads what it overwrites. Every rank records
// kReadDone for every piece, whether it read anything or not, so that this wait always finds that
// piece's record, whatever kinds of call the two pieces belong to. The host never waits for
// the device: the host steps order the queueing, the events order the streams.
//
// Reductions run in rank order (rank 0's operand first) on one rank per element, so results are
// bitwise equal on every rank and from run to run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "../communicator.h"
#include "../dtype.h"

namespace braid {

enum class IpcEvent : int { kReady = 0, kReduced = 1, kReadDone = 2 };
constexpr int kIpcEvents = 3;

// What the schedules drive on one rank: its stream (every operation below is queued on it, in
// order, and may run later) and every local rank's scratch.
class IpcEngine {
 public:
  virtual ~IpcEngine() = default;
  // Slots per rank (>= 2) and the bytes of each of a slot's two areas (a multiple of 256).
  virtual int slots() const = 0;
  virtual size_t area_bytes() const = 0;
  // Area `area` (0 or 1) of slot `slot` of local rank `peer`'s scratch (this rank's own included):
  // readable and writable by this rank's stream.
  virtual char* scratch(int peer, int slot, int area) = 0;
  // dst = src, `bytes` bytes (device memory, this rank's or a peer's scratch).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // dst[i] = srcs[0][i] op srcs[1][i] op ... for i < count, in this order (half types accumulate
  // in float32 and round once); avg divides the sum by `divisor`. dst may alias srcs[0]. The
  // pointer array `srcs` is read before this returns (the caller's array is gone by the time the
  // stream runs).
  virtual void reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op,
                      int divisor) = 0;
  // Records this rank's `event` of `slot` for piece `piece` on the stream.
  virtual void signal(IpcEvent event, int slot, uint64_t piece) = 0;
  // The stream waits until local rank `peer`'s record of `event` of `slot` for piece `piece` is
  // done (the protocol guarantees it is the latest record the peer queued).
  virtual void wait(int peer, IpcEvent event, int slot, uint64_t piece) = 0;
};

// A host step: a collective over the host's ranks, run by the caller on the communicator (it
// checks the descriptor, has the deadline, raises PeerError / CommTimeout / CollectiveMismatch):
// an all_gather of int64 words. `words` holds this rank's words on entry (never empty: the first
// is the piece number, which run_ipc checks is equal on every rank) and every rank's, rank-major,
// on return. `tag` describes the IPC call the step belongs to (a hash of its kind, dtype and count,
// and of what else the ranks must agree on: the op of a reduction, the root of a broadcast, the
// all-reduce's algorithm), for the step's descriptor, so ranks that issued different calls fail
// with a mismatch at the first step.
using IpcHostStep = std::function<void(uint32_t tag, std::vector<int64_t>& words)>;

// The IPC state of one rank that run_ipc advances: the last piece number used.
struct IpcSequence {
  uint64_t piece = 0;
};

// Messages up to this many bytes (per rank) all-reduce in one shot: every rank reads every
// peer's input and reduces all of it (one host step, N reads); larger ones in two shots (reduce-
// scatter of chunks, then all-gather: two host steps, 2 reads of the message).
// BRAID_IPC_ONE_SHOT_MAX_BYTES (tunables.h), read at the first call of the process.
size_t ipc_one_shot_max_bytes();

// Runs `r` (device pointers in r.in / r.out; all_reduce, reduce_scatter, all_gather, broadcast,
// all_to_all, or barrier) among `world` ranks of one host, this one being `rank`. `r.count` as in
// Communicator::submit. Queues everything on the engine's stream and returns once queued.
void run_ipc(IpcEngine& engine, IpcSequence& seq, const Request& r, int rank, int world, const IpcHostStep& step);

// An all-to-all with split sizes: this rank sends send_counts[p] elements of `dtype` starting at
// element send_offsets[p] of `in` to rank p, and receives recv_counts[p] elements from rank p at
// element recv_offsets[p] of `out`. One host step exchanges every rank's sends, so a rank whose
// receive counts disagree with what its peers send fails (std::invalid_argument on every rank)
// before any data moves.
void run_ipc_all_to_all_v(IpcEngine& engine, IpcSequence& seq, DType dtype, const void* in, void* out,
                          const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_offsets,
                          const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                          int rank, int world, const IpcHostStep& step);

}  // namespace braid
