// Collectives among a group of ranks over any Transport, each rank talking to every other
// directly: what crosses between hosts (one rank per host in a group, TCP between them).
#pragma once

#include <cstddef>
#include <vector>

#include "../collective.h"
#include "../dtype.h"
#include "../scratch.h"
#include "../transport/transport.h"

namespace braid {

// The ranks of one collective over a transport, in the group's order, and this rank's place.
struct PeerGroup {
  Transport* transport = nullptr;
  std::vector<int> members;  // transport ranks
  int me = 0;                // index of this rank in members
  const CollectiveDesc* desc = nullptr;  // travels with every transfer; receivers compare it
  ScratchBuffers* scratch = nullptr;     // reduction staging (slot 0), reused across calls
  int size() const { return static_cast<int>(members.size()); }
};

// out = in[0] (op) in[1] (op) ... over the members, in member order, on every member (bitwise
// identical). Each member owns a contiguous part of the elements: the others send it that part
// of their input, it reduces the part in pieces of `piece_bytes` as they arrive (member order,
// float32 accumulation for half types, the division of avg by `divisor`) and sends each reduced
// piece back to all. With `oneshot` every member sends its whole input to every other and
// reduces everything itself: one message latency instead of two, for small messages.
void direct_all_reduce(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count,
                       int divisor, size_t piece_bytes, bool oneshot);

// Member m receives in `out` the reduction (member order, avg divided by `divisor`) of block m
// (`count` elements at in + m * count) of every member's input; pieces as direct_all_reduce.
void direct_reduce_scatter(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count,
                           int divisor, size_t piece_bytes);
// The same with blocks of their own sizes: member m's block is the counts[m] elements after the
// blocks of the members before it.
void direct_reduce_scatter(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out,
                           const std::vector<size_t>& counts, int divisor, size_t piece_bytes);

// out = the members' blocks in member order, member m's of bytes[m] bytes; `in` is this
// member's block (may alias its place in `out`).
void direct_all_gather(const PeerGroup& g, const void* in, void* out, const std::vector<size_t>& bytes);

// One transfer of an exchange: `bytes` at `data` to or from member `member`.
struct DirectBlock {
  int member;
  void* data;
  size_t bytes;
};
// Runs every send and receive together (all-to-all: each pair's in both directions at once).
void direct_exchange(const PeerGroup& g, const std::vector<DirectBlock>& sends, const std::vector<DirectBlock>& recvs);

}  // namespace braid

namespace braid {

// out = the reduction of every member's `in`, around the ring of members (member i sends to
// i + 1): n - 1 reduce-scatter steps, then n - 1 all-gather steps, each chunk cut into pieces of
// `piece_bytes` so that a piece travels on while the next is reduced. Chunk c is reduced in the
// member order c, c + 1, ..., c - 1 (cyclic) and copied everywhere else: results are identical
// on every member. Partial sums of float16/bfloat16 travel as float32 (rounded once). Each
// member sends and receives 2 (n - 1) / n of the message, one peer at a time.
void ring_all_reduce(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count, int divisor,
                     size_t piece_bytes);

// out = member me's block of the reduction of every member's `in` (blocks of counts[m] elements
// in member order), around the ring in n - 1 steps of one block each, pieces of `piece_bytes`
// pipelined: one flow per member each way instead of every member sending to every other at
// once. Block b is reduced in the member order b + 1, b + 2, ..., b (cyclic), partials in the
// accumulator type, rounded once by its owner (ring_p2p.cc).
void ring_reduce_scatter(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out,
                         const std::vector<size_t>& counts, int divisor, size_t piece_bytes);

// out = the members' blocks in member order (member m's of bytes[m] bytes; `in` is this member's,
// which may alias its place in `out`), passed around the ring in pieces of `piece_bytes`: n - 1
// steps, one neighbour each way (ring_p2p.cc).
void ring_all_gather(const PeerGroup& g, const void* in, void* out, const std::vector<size_t>& bytes,
                     size_t piece_bytes);

// out = the reduction of every member's `in` by recursive doubling (log_rounds.cc): ceil(log2 n)
// pairwise exchanges of the whole message (two more when n is not a power of two), a fixed
// reduction tree, identical bits on every member. For small messages among many members.
void doubling_all_reduce(const PeerGroup& g, DType dt, ReduceOp op, const void* in, void* out, size_t count,
                         int divisor);
// Member `root`'s `bytes` at `data` to every member down a binomial tree (ceil(log2 n) rounds).
void tree_broadcast(const PeerGroup& g, void* data, size_t bytes, int root);
// Returns once every member has arrived: a dissemination barrier (ceil(log2 n) rounds, each
// member signalling one member and hearing from one per round).
void dissemination_barrier(const PeerGroup& g);

}  // namespace braid
