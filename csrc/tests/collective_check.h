// One collective call with inputs that every rank regenerates, and its exact expected result.
#pragma once

#include <cstddef>
#include <vector>

#include "core/communicator.h"
#include "reference.h"

namespace braid_test {

// Tiny slots and thresholds so that a few hundred elements already take the multi-round,
// slot-reusing paths: 1 KiB slots, one-shot up to 256 bytes, two slots in flight.
braid::Tunables tiny_tunables(braid::Algo algo);

struct CallSpec {
  braid::CollKind kind = braid::CollKind::kAllReduce;
  braid::DType dtype = braid::DType::kFloat32;
  braid::ReduceOp op = braid::ReduceOp::kSum;
  size_t count = 0;  // as in braid::Request
  int root = 0;
  bool in_place = false;
  int call = 0;  // seeds the inputs: the same on every rank for the same call
};
std::string describe(const CallSpec& s);

// Buffers for one call on one rank, filled before it is submitted and checked after it ends.
// The whole destination is compared, with one guard element past its end, so that writes out of
// bounds and to the parts an in-place collective must keep are caught too.
class PreparedCall {
 public:
  PreparedCall(const CallSpec& spec, int rank, int world);
  // Fixed in place: submitted requests point into the buffers.
  PreparedCall(const PreparedCall&) = delete;
  PreparedCall& operator=(const PreparedCall&) = delete;
  braid::Request request();
  // Records a failure (naming the call and rank) unless the destination holds the expected values.
  void check() const;

 private:
  CallSpec spec_;
  int rank_;
  Buffer in_, out_, expected_;
  const Buffer* result_;  // in_ for in-place calls, out_ otherwise
};

// Prepares, submits (blocking) and checks one call.
void run_and_check(braid::Communicator& comm, const CallSpec& spec);

// Message sizes for `kind` on `world` ranks with tiny tunables: 0, 1, primes, and +-1 around
// the one-shot threshold and around 1, 2 (all slots in use) and 3 (a slot reused) pipeline blocks
// of the algorithm that carries the call.
std::vector<size_t> interesting_counts(braid::CollKind kind, braid::Algo algo, braid::DType dtype, int world);

}  // namespace braid_test
