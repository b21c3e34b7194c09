// Single-process checks: a world of one (no shared memory, no fork), tunables and arguments.
#include <atomic>
#include <memory>
#include <stdexcept>
#include <thread>

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

// A completion callback runs on the progress thread: calls it makes run there at once (a blocking
// one returns, an async one is complete when returned) instead of queueing behind the work whose
// completion is running; close() there raises (it would join its own thread), abort() fails the
// communicator and leaves closing to the caller.
BRAID_TEST(calls_from_a_completion_callback_run_on_the_progress_thread) {
  for (bool aborting : {false, true}) {
    braid::Communicator comm(0, 1, tiny_tunables(Algo::kAuto), 1.0);
    comm.attach({braid::PeerInfo{}});
    comm.unlink_own();
    CallSpec sa, sb, sc;
    sa.count = 100;
    sb.count = 50;
    sb.call = 1;
    sc.count = 70;
    sc.call = 2;
    PreparedCall pa(sa, 0, 1), pb(sb, 0, 1), pc(sc, 0, 1);
    std::atomic<bool> go{false};
    // Holds the progress thread until the callback is attached, so that it runs there.
    comm.submit_task([&] { while (!go.load()) std::this_thread::yield(); }, nullptr, true);
    auto work = comm.submit(pa.request(), true);
    std::atomic<bool> on_thread{false}, inner_done{false}, close_threw{false}, abort_returned{false};
    work->on_complete([&](const braid::Work&) {
      on_thread = comm.on_progress_thread();
      comm.submit(pb.request(), false);
      inner_done = comm.submit(pc.request(), true)->is_completed();
      if (aborting) {
        comm.abort();
        abort_returned = true;
      } else {
        try {
          comm.close();
        } catch (const braid::CommError&) {
          close_threw = true;
        }
      }
    });
    go = true;
    CHECK(work->wait());
    if (!aborting) {
      comm.submit(braid::Request{}, false);  // a barrier queued behind the callback: it is over
      pa.check();
      pb.check();
      pc.check();
      CHECK(on_thread && inner_done && close_threw);
      CHECK(!comm.closed());
    } else {
      while (!abort_returned.load()) std::this_thread::yield();
      CHECK_THROWS_KIND(braid::ErrorKind::kClosed, comm.submit(braid::Request{}, false));
      CHECK(on_thread && inner_done);
    }
    comm.close();
    CHECK(comm.closed());
  }
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
