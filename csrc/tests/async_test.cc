// Async submissions: many calls in flight on the progress thread, waited out of order, mixed
// with blocking calls, and completed by close().
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "check.h"
#include "collective_check.h"
#include "rank_group.h"
#include "core/progress_engine.h"

using braid::Algo;
using braid::CollKind;
using braid::DType;
using braid::ReduceOp;
using namespace braid_test;

namespace {

// Every kind, on both sides of the one-shot threshold (64 float32 elements with tiny tunables).
std::vector<CallSpec> mixed_batch(int first_call) {
  const struct {
    CollKind kind;
    DType dtype;
    ReduceOp op;
    size_t count;
  } rows[] = {
      {CollKind::kAllReduce, DType::kFloat32, ReduceOp::kSum, 1000},
      {CollKind::kAllReduce, DType::kBFloat16, ReduceOp::kAvg, 7},
      {CollKind::kReduceScatter, DType::kInt64, ReduceOp::kMax, 300},
      {CollKind::kAllGather, DType::kFloat16, ReduceOp::kSum, 513},
      {CollKind::kBarrier, DType::kFloat32, ReduceOp::kSum, 0},
      {CollKind::kBroadcast, DType::kFloat64, ReduceOp::kSum, 129},
      {CollKind::kAllReduce, DType::kInt32, ReduceOp::kProd, 2049},
      {CollKind::kReduceScatter, DType::kFloat32, ReduceOp::kMin, 3},
  };
  std::vector<CallSpec> out;
  int call = first_call;
  for (const auto& row : rows) {
    CallSpec s;
    s.kind = row.kind;
    s.dtype = row.dtype;
    s.op = row.op;
    s.count = row.count;
    s.root = call % 2;
    s.in_place = call % 3 == 0;
    s.call = call++;
    out.push_back(s);
  }
  return out;
}

}  // namespace

BRAID_TEST(async_calls_waited_out_of_order) {
  for (int world : {2, 3, 4}) {
    for (Algo algo : {Algo::kTwoShot, Algo::kRing}) {
      GroupSpec g;
      g.world = world;
      g.tunables = tiny_tunables(algo);
      run_group(g, [&](RankCtx& ctx) {
        std::vector<std::unique_ptr<PreparedCall>> calls;
        std::vector<std::shared_ptr<braid::Work>> works;
        const auto batch = mixed_batch(0);
        for (const auto& s : batch) {
          calls.push_back(std::make_unique<PreparedCall>(s, ctx.rank, world));
          works.push_back(ctx.comm.submit(calls.back()->request(), true));
        }
        // A blocking call runs after everything issued before it: it returns only once the
        // whole batch has completed.
        CallSpec blocking;
        blocking.count = 77;
        blocking.call = static_cast<int>(batch.size());
        run_and_check(ctx.comm, blocking);
        for (const auto& w : works) CHECK(w->is_completed());
        for (size_t i = works.size(); i-- > 0;) {
          CHECK(works[i]->wait());
          calls[i]->check();
        }
        int callbacks = 0;
        works.front()->on_complete([&](const braid::Work& w) { callbacks += w.succeeded() ? 1 : 100; });
        CHECK_EQ(callbacks, 1);  // already complete: runs at once, exactly once
      });
    }
  }
}

// close() runs what is still queued before leaving the group: nothing issued is dropped.
BRAID_TEST(close_completes_queued_work) {
  GroupSpec g;
  g.world = 3;
  g.tunables = tiny_tunables(Algo::kRing);
  run_group(g, [&](RankCtx& ctx) {
    std::vector<std::unique_ptr<PreparedCall>> calls;
    std::vector<std::shared_ptr<braid::Work>> works;
    for (const auto& s : mixed_batch(100)) {
      calls.push_back(std::make_unique<PreparedCall>(s, ctx.rank, g.world));
      works.push_back(ctx.comm.submit(calls.back()->request(), true));
    }
    ctx.comm.close();
    for (size_t i = 0; i < works.size(); ++i) {
      CHECK(works[i]->is_completed());
      CHECK(works[i]->succeeded());
      calls[i]->check();
    }
    CHECK_THROWS_KIND(braid::ErrorKind::kClosed, ctx.comm.submit(braid::Request{}, false));
  });
}

// A lazily queued work (enqueue_lazy) waits its delay for a waiter, then the progress thread
// starts it anyway: no progress is lost when nobody waits. An enqueue() behind it makes it due at
// once, so issue order never holds back an ordinary work.
BRAID_TEST(lazy_work_runs_after_its_delay_or_behind_an_eager_one) {
  using Clock = std::chrono::steady_clock;
  {
    braid::ProgressEngine engine;
    Clock::time_point ran{};
    auto w = std::make_shared<braid::Work>([&] { ran = Clock::now(); });
    const auto posted = Clock::now();
    engine.enqueue_lazy(w, std::chrono::milliseconds(30));
    const auto deadline = posted + std::chrono::seconds(5);
    while (!w->is_completed() && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(w->is_completed());
    CHECK(ran - posted >= std::chrono::milliseconds(30));
    // Again, the thread now looking at the queue on its own (no wake): the same delay, then it runs.
    auto again = std::make_shared<braid::Work>([] {});
    engine.enqueue_lazy(again, std::chrono::milliseconds(30));
    const auto deadline2 = Clock::now() + std::chrono::seconds(5);
    while (!again->is_completed() && Clock::now() < deadline2)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(again->is_completed());
  }
  {
    braid::ProgressEngine engine;
    std::vector<int> order;
    auto lazy = std::make_shared<braid::Work>([&] { order.push_back(1); });
    auto eager = std::make_shared<braid::Work>([&] { order.push_back(2); });
    const auto posted = Clock::now();
    engine.enqueue_lazy(lazy, std::chrono::seconds(60));
    engine.enqueue(eager);
    CHECK(eager->wait(std::chrono::seconds(5)));
    CHECK(lazy->is_completed());
    CHECK(Clock::now() - posted < std::chrono::seconds(5));
    CHECK_EQ(order.size(), size_t{2});
    CHECK_EQ(order[0], 1);  // issue order
  }
}

// Lazy works queued while another thread keeps running calls inline (run_if_idle), with nobody
// waiting for them: each still completes, whether the progress thread was asleep, waiting for an
// inline call to end, or looking at the queue on its own when it was queued. (A stress test: the
// narrowest of those races, a lazy enqueue just after an inline call ended with nothing queued
// while the thread still waits for it, is not forced here.)
BRAID_TEST(lazy_work_completes_amid_inline_calls) {
  using Clock = std::chrono::steady_clock;
  braid::ProgressEngine engine;
  std::atomic<bool> stop{false};
  std::thread inliner([&] {
    while (!stop.load()) {
      if (!engine.run_if_idle([] { std::this_thread::sleep_for(std::chrono::microseconds(50)); }))
        std::this_thread::yield();
    }
  });
  std::vector<std::shared_ptr<braid::Work>> works;
  for (int i = 0; i < 200; ++i) {
    works.push_back(std::make_shared<braid::Work>([] {}));
    engine.enqueue_lazy(works.back(), std::chrono::microseconds(200));
    std::this_thread::sleep_for(std::chrono::microseconds((i % 7) * 30));
  }
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  size_t done = 0;
  for (const auto& w : works) {
    while (!w->is_completed() && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    done += w->is_completed() ? 1 : 0;
  }
  stop.store(true);
  inliner.join();
  CHECK_EQ(done, works.size());
}
