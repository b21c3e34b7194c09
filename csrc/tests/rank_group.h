// Forks the ranks of a shared-memory communicator, bootstraps them through the parent over
// socketpairs, runs a body in each and gathers their verdicts under a parent-side deadline.
#pragma once

#include <chrono>
#include <functional>
#include <vector>

#include "core/communicator.h"

namespace braid_test {

// What a rank's body sees.
class RankCtx {
 public:
  RankCtx(int rank, int world, braid::Communicator& comm, int parent_fd)
      : rank(rank), world(world), comm(comm), parent_fd_(parent_fd) {}
  // Blocks until every rank that is not holding has exited: keeps this rank alive (a peer that
  // merely does not call) without any timing assumption.
  void hold_until_others_exit();

  const int rank;
  const int world;
  braid::Communicator& comm;

 private:
  int parent_fd_;
};

struct GroupSpec {
  int world = 2;
  braid::Tunables tunables;
  double timeout_s = 10;  // the communicator's deadline for every wait
  std::chrono::seconds deadline{90};  // the parent kills every rank still running after this
  std::function<void(int rank, braid::Tunables&)> tune_rank;  // per-rank changes, may be empty
  std::vector<int> killed;  // ranks that are expected to end by SIGKILL (all others exit 0)
};

// Runs `body` in `spec.world` forked ranks. Records a failure in the calling test for every
// CHECK that failed in a rank, every unexpected exit status or uncaught exception, the deadline
// passing, and any rank's shared-memory segment still present in /dev/shm afterwards.
// Call it before the process starts any thread (fork copies only the calling thread).
void run_group(const GroupSpec& spec, const std::function<void(RankCtx&)>& body);

// Seconds elapsed since `t0`.
double seconds_since(std::chrono::steady_clock::time_point t0);

}  // namespace braid_test
