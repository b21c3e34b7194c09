// Single-process checks: a world of one (no shared memory, no fork), tunables and arguments.
#include <memory>
#include <stdexcept>

#include "check.h"
#include "collective_check.h"

using braid::Algo;
using braid::CollKind;
using braid::DType;
using braid::ReduceOp;
using namespace braid_test;

BRAID_TEST(world_of_one_copies_or_keeps) {
  braid::Communicator comm(0, 1, tiny_tunables(Algo::kAuto), 1.0);
  CHECK(comm.segment_name().empty());
  comm.attach({braid::PeerInfo{}});
  comm.unlink_own();
  int call = 0;
  for (CollKind kind : {CollKind::kAllReduce, CollKind::kReduceScatter, CollKind::kAllGather, CollKind::kAllToAll,
                        CollKind::kBroadcast})
    for (DType dt : kAllDTypes)
      for (ReduceOp op : kAllOps)
        for (size_t count : {size_t(0), size_t(1), size_t(513)}) {
          CallSpec s;
          s.kind = kind;
          s.dtype = dt;
          s.op = op;
          s.count = count;
          s.in_place = call % 2 == 1 && kind != CollKind::kAllToAll;
          s.call = call++;
          run_and_check(comm, s);
        }
  braid::Request empty;
  empty.kind = CollKind::kAllReduce;
  comm.submit(empty, false);  // count 0, null pointers
  // Async on the progress thread; close() joins it, which keeps later forks single-threaded.
  CallSpec s;
  s.count = 100;
  s.call = call;
  PreparedCall prepared(s, 0, 1);
  auto work = comm.submit(prepared.request(), true);
  CHECK(work->wait());
  prepared.check();
  comm.close();
  CHECK(comm.closed());
  CHECK_THROWS_KIND(braid::ErrorKind::kClosed, comm.submit(braid::Request{}, false));
}

BRAID_TEST(tunables_parse_and_validate) {
  for (Algo a : {Algo::kAuto, Algo::kOneShot, Algo::kTwoShot, Algo::kRing})
    CHECK(braid::parse_algo(braid::algo_name(a)) == a);
  bool threw = false;
  try {
    braid::parse_algo("tree");
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  auto rejects = [](void (*change)(braid::Tunables&)) {
    braid::Tunables t;
    t.resolve(2);
    change(t);
    try {
      t.validate();
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  CHECK(rejects([](braid::Tunables& t) { t.slot_bytes = 1023; }));
  CHECK(rejects([](braid::Tunables& t) { t.nslots = 0; }));
  CHECK(rejects([](braid::Tunables& t) { t.nslots = 1; }));
  CHECK(rejects([](braid::Tunables& t) { t.nslots = 65; }));
  CHECK(rejects([](braid::Tunables& t) { t.yield_us = -1; }));
  CHECK(rejects([](braid::Tunables& t) { t.oneshot_max_bytes = -1; }));
  CHECK(!rejects([](braid::Tunables&) {}));
  // The one-shot limit follows the world size (measured crossovers, tunables.h).
  braid::Tunables two, three;
  two.resolve(2);
  three.resolve(3);
  CHECK(two.oneshot_max_bytes == (1 << 20));
  CHECK(three.oneshot_max_bytes == (32 << 10));
}

BRAID_TEST(constructor_rejects_bad_arguments) {
  auto rejects = [](int rank, int world, double timeout) {
    try {
      braid::Communicator c(rank, world, braid::Tunables{}, timeout);
    } catch (const std::invalid_argument&) {
      return true;
    }
    return false;
  };
  CHECK(rejects(1, 1, 1.0));
  CHECK(rejects(-1, 2, 1.0));
  CHECK(rejects(0, 0, 1.0));
  CHECK(rejects(0, braid::kMaxLocalRanks + 1, 1.0));
  CHECK(rejects(0, 1, 0.0));
}
