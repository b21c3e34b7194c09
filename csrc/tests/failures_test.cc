// Failure handling across forked ranks: a peer that dies or closes, collectives that disagree,
// a peer that never calls; every survivor must raise the right CommError kind, promptly.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "core/interrupt.h"
#include "collective_check.h"
#include "rank_group.h"

using braid::Algo;
using braid::CollKind;
using braid::DType;
using braid::ErrorKind;
using braid::ReduceOp;
using namespace braid_test;

namespace {

using Clock = std::chrono::steady_clock;

// About a second is the contract for a dead peer; 2 s leaves room for a loaded CI machine.
constexpr double kPromptly = 2.0;
// The communicator timeout where the test expects another error: well above kPromptly, so that
// a timeout cannot pass for prompt detection, and short, so that a missed detection fails fast.
constexpr double kNoTimeout = 5.0;

// Float32 buffers for the all_reduce calls that fail (the data does not matter, only that the
// pointers are valid for `count` elements).
struct Floats {
  explicit Floats(size_t count) : data(count + 1, 1.0f) {}
  braid::Request all_reduce(size_t count) {
    braid::Request r;
    r.kind = CollKind::kAllReduce;
    r.count = count;
    r.in = data.data();
    r.out = data.data();
    return r;
  }
  std::vector<float> data;
};

// The healthy calls before a failure: one-shot, pipelined and a barrier, none of them an
// all_reduce (whose algorithm some tests make differ between ranks).
void healthy_calls(RankCtx& ctx) {
  int call = 0;
  for (auto [kind, count] : {std::pair{CollKind::kReduceScatter, size_t(5)}, std::pair{CollKind::kAllGather, size_t(700)}}) {
    CallSpec s;
    s.kind = kind;
    s.count = count;
    s.call = call++;
    run_and_check(ctx.comm, s);
  }
  ctx.comm.submit(braid::Request{}, false);
}

}  // namespace

// A rank killed between collectives (no close, no chance to publish anything): the survivors'
// next call, blocking or already queued on the progress thread, fails with PeerError from the
// liveness check, well before the timeout, and every later call fails at once.
BRAID_TEST(dead_peer_raises_peer_error_promptly) {
  const struct {
    size_t count;  // one-shot or pipelined
    bool async;
  } modes[] = {{5, false}, {700, true}};
  for (int world : {2, 3}) {
    for (int victim : {0, world - 1}) {  // rank 0 also hosts the group's doorbell
      for (const auto& mode : modes) {
        GroupSpec g;
        g.world = world;
        g.tunables = tiny_tunables(Algo::kRing);
        g.timeout_s = kNoTimeout;
        g.killed = {victim};
        run_group(g, [&](RankCtx& ctx) {
          healthy_calls(ctx);
          if (ctx.rank == victim) ::raise(SIGKILL);
          Floats buf(mode.count);
          const auto t0 = Clock::now();
          const std::string msg = CHECK_THROWS_KIND(ErrorKind::kPeer, {
            auto work = ctx.comm.submit(buf.all_reduce(mode.count), mode.async);
            if (work) work->wait();
          });
          const double took = seconds_since(t0);
          CHECK_MSG(took < kPromptly, "PeerError took " + std::to_string(took) + " s: " + msg);
          // Poisoned: later calls, blocking or async, raise without waiting.
          const auto t1 = Clock::now();
          CHECK_THROWS_KIND(ErrorKind::kPeer, ctx.comm.submit(buf.all_reduce(mode.count), false));
          CHECK_THROWS_KIND(ErrorKind::kPeer, ctx.comm.submit(buf.all_reduce(mode.count), true)->wait());
          CHECK(seconds_since(t1) < 0.5);
        });
      }
    }
  }
}

// A rank that closes its communicator while the others call: they fail with PeerError naming
// the departure, not with a timeout.
BRAID_TEST(closed_peer_raises_peer_error) {
  GroupSpec g;
  g.world = 3;
  g.tunables = tiny_tunables(Algo::kTwoShot);
  g.timeout_s = kNoTimeout;
  run_group(g, [&](RankCtx& ctx) {
    healthy_calls(ctx);
    if (ctx.rank == 1) {
      ctx.comm.close();
      ctx.hold_until_others_exit();
      return;
    }
    Floats buf(700);
    const auto t0 = Clock::now();
    const std::string msg = CHECK_THROWS_KIND(ErrorKind::kPeer, ctx.comm.submit(buf.all_reduce(700), false));
    CHECK(seconds_since(t0) < kPromptly);
    CHECK_MSG(msg.find("rank 1") != std::string::npos, "message does not name rank 1: " + msg);
  });
}

// Ranks that call different collectives all raise CollectiveMismatch, and stay poisoned.
BRAID_TEST(mismatch_raises_on_every_rank) {
  struct Case {
    const char* what;
    size_t count;                                 // what every rank calls, but rank 1 ...
    std::function<void(braid::Request&)> change;  // ... calls this instead
    Algo rank1_algo;
  };
  const Case cases[] = {
      {"count (one-shot)", 3, [](braid::Request& r) { r.count = 4; }, Algo::kTwoShot},
      {"count (pipelined)", 700, [](braid::Request& r) { r.count = 701; }, Algo::kTwoShot},
      {"count (one-shot vs pipelined)", 3, [](braid::Request& r) { r.count = 700; }, Algo::kTwoShot},
      {"kind", 3, [](braid::Request& r) { r.kind = CollKind::kBroadcast; }, Algo::kTwoShot},
      {"op", 3, [](braid::Request& r) { r.op = ReduceOp::kMax; }, Algo::kTwoShot},
      {"dtype", 3, [](braid::Request& r) { r.dtype = DType::kInt32; }, Algo::kTwoShot},
      {"algorithm", 700, [](braid::Request&) {}, Algo::kRing},
  };
  for (const auto& c : cases) {
    GroupSpec g;
    g.world = 3;
    g.tunables = tiny_tunables(Algo::kTwoShot);
    g.timeout_s = kNoTimeout;
    g.tune_rank = [&](int rank, braid::Tunables& t) {
      if (rank == 1) t.algo = c.rank1_algo;
    };
    run_group(g, [&](RankCtx& ctx) {
      healthy_calls(ctx);
      Floats buf(1000);
      braid::Request r = buf.all_reduce(c.count);
      if (ctx.rank == 1) c.change(r);
      const auto t0 = Clock::now();
      const std::string msg = CHECK_THROWS_KIND(ErrorKind::kMismatch, ctx.comm.submit(r, false));
      CHECK_MSG(seconds_since(t0) < kPromptly, std::string(c.what) + ": mismatch detected late: " + msg);
      CHECK_THROWS_KIND(ErrorKind::kMismatch, ctx.comm.submit(buf.all_reduce(3), false));
    });
  }
}

// Broadcasts with different roots are different collectives.
BRAID_TEST(broadcast_root_mismatch) {
  GroupSpec g;
  g.world = 2;
  g.tunables = tiny_tunables(Algo::kAuto);
  run_group(g, [&](RankCtx& ctx) {
    Floats buf(10);
    braid::Request r = buf.all_reduce(10);
    r.kind = CollKind::kBroadcast;
    r.root = ctx.rank;
    CHECK_THROWS_KIND(ErrorKind::kMismatch, ctx.comm.submit(r, false));
  });
}

// A rank that stays alive but never calls: the others time out after the 1 s deadline with a
// message naming it.
BRAID_TEST(absent_peer_raises_timeout) {
  for (size_t count : {size_t(5), size_t(700)}) {
    GroupSpec g;
    g.world = 3;
    g.tunables = tiny_tunables(Algo::kRing);
    g.timeout_s = 1;
    run_group(g, [&](RankCtx& ctx) {
      if (ctx.rank == 2) {
        ctx.hold_until_others_exit();
        return;
      }
      Floats buf(count);
      const auto t0 = Clock::now();
      const std::string msg = CHECK_THROWS_KIND(ErrorKind::kTimeout, ctx.comm.submit(buf.all_reduce(count), false));
      const double took = seconds_since(t0);
      CHECK_MSG(took >= 0.9 && took < 1.0 + kPromptly, "timed out after " + std::to_string(took) + " s");
      CHECK_MSG(msg.find("rank 2") != std::string::npos, "message does not name rank 2: " + msg);
      CHECK_THROWS_KIND(ErrorKind::kTimeout, ctx.comm.submit(buf.all_reduce(count), false));
    });
  }
}

// The late rank of the previous test, once it does call: its peers gave up on this collective
// and published their failure, so it must not complete it on its own.
BRAID_TEST(late_rank_fails_after_peers_timed_out) {
  for (Algo algo : {Algo::kAuto, Algo::kTwoShot, Algo::kRing}) {  // auto: one-shot at this size
    GroupSpec g;
    g.world = 2;
    g.tunables = tiny_tunables(algo);
    g.timeout_s = 1;
    run_group(g, [&](RankCtx& ctx) {
      Floats buf(5);
      if (ctx.rank == 1) {
        ctx.hold_until_others_exit();
        bool threw = false;
        try {
          ctx.comm.submit(buf.all_reduce(5), false);
        } catch (const braid::CommError&) {
          threw = true;
        }
        CHECK_MSG(threw, std::string(braid::algo_name(algo)) +
                             ": all_reduce succeeded on the late rank after its peer timed out in it");
        return;
      }
      CHECK_THROWS_KIND(ErrorKind::kTimeout, ctx.comm.submit(buf.all_reduce(5), false));
    });
  }
}

// Segment names disappear right after the bootstrap barrier (run_group also checks that none
// is left once the ranks are gone), so a crash later cannot leak them.
BRAID_TEST(segments_unlinked_after_bootstrap) {
  GroupSpec g;
  g.world = 2;
  g.tunables = tiny_tunables(Algo::kAuto);
  run_group(g, [&](RankCtx& ctx) {
    const std::string path = "/dev/shm" + ctx.comm.segment_name();
    CHECK_MSG(::access(path.c_str(), F_OK) != 0, path + " still exists after unlink_own()");
    healthy_calls(ctx);
  });
}

// The binding's Ctrl-C hook, simulated: a wait that sleeps asks the hook regularly and ends with
// Interrupted soon after it says so; the communicator is poisoned and the peers are told. Both for
// a blocking call run inline and for one queued behind async work (the progress thread, which
// waits for the absent peer, is made to abandon it: the blocking call returns only after that).
namespace {
std::atomic<bool> g_interrupt{false};
bool interrupt_hook() { return g_interrupt.load(); }
}  // namespace

BRAID_TEST(interrupt_ends_the_wait_and_tells_the_peers) {
  for (bool queued : {false, true}) {
    for (size_t count : {size_t(5), size_t(700)}) {
      GroupSpec g;
      g.world = 2;
      g.tunables = tiny_tunables(Algo::kAuto);
      g.timeout_s = kNoTimeout;
      run_group(g, [&](RankCtx& ctx) {
        Floats buf(count);
        if (ctx.rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // rank 0 is interrupted at 0.2 s
          const auto t0 = Clock::now();
          const std::string msg = CHECK_THROWS_KIND(ErrorKind::kPeer, ctx.comm.submit(buf.all_reduce(count), false));
          CHECK(seconds_since(t0) < kPromptly);
          CHECK_MSG(msg.find("rank 0 was interrupted") != std::string::npos, "peer not told why: " + msg);
          return;
        }
        braid::set_interrupt_hook(&interrupt_hook);
        std::shared_ptr<braid::Work> ahead;
        Floats other(count);
        if (queued) ahead = ctx.comm.submit(other.all_reduce(count), true);
        std::thread ctrl_c([] {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          g_interrupt.store(true);
        });
        const auto t0 = Clock::now();
        const std::string msg = CHECK_THROWS_KIND(ErrorKind::kGeneric, ctx.comm.submit(buf.all_reduce(count), false));
        const double took = seconds_since(t0);
        ctrl_c.join();
        // The hook says stop at 0.2 s; it is asked from 0.1 s into a wait every 50-100 ms, so 1 s
        // more is scheduling slack, far below the 5 s deadline a missed interrupt would run into.
        CHECK_MSG(took < 0.2 + 1.0, "interrupt noticed after " + std::to_string(took) + " s");
        CHECK_MSG(msg.find("interrupted") != std::string::npos, msg);
        if (ahead) CHECK_MSG(ahead->is_completed() && !ahead->succeeded(), "the work ahead was not abandoned");
        g_interrupt.store(false);
        braid::set_interrupt_hook(nullptr);
        CHECK_THROWS_KIND(ErrorKind::kGeneric, ctx.comm.submit(buf.all_reduce(count), false));  // poisoned
      });
    }
  }
}

// abort() while the progress thread waits for an absent peer and more work is queued: it returns
// at once, the running and the queued work fail, and the peer is told when it arrives.
BRAID_TEST(abort_fails_running_and_queued_work) {
  GroupSpec g;
  g.world = 2;
  g.tunables = tiny_tunables(Algo::kAuto);
  g.timeout_s = kNoTimeout;
  run_group(g, [&](RankCtx& ctx) {
    Floats buf(700), other(5);
    if (ctx.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      const auto t0 = Clock::now();
      const std::string msg = CHECK_THROWS_KIND(ErrorKind::kPeer, ctx.comm.submit(buf.all_reduce(700), false));
      CHECK(seconds_since(t0) < kPromptly);
      CHECK_MSG(msg.find("rank 0 aborted") != std::string::npos, msg);
      return;
    }
    auto running = ctx.comm.submit(buf.all_reduce(700), true);
    auto queued = ctx.comm.submit(other.all_reduce(5), true);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto t0 = Clock::now();
    ctx.comm.abort();
    CHECK_MSG(seconds_since(t0) < kPromptly, "abort took " + std::to_string(seconds_since(t0)) + " s");
    CHECK(running->is_completed() && !running->succeeded());
    CHECK(queued->is_completed() && !queued->succeeded());
    CHECK(ctx.comm.closed());
  });
}
