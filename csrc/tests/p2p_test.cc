// Point-to-point through the shared-memory mailboxes: ring exchanges of every size class, flow
// control past the mailbox depth, interleaving with collectives, and size mismatches.
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <memory>
#include <vector>

#include "check.h"
#include "collective_check.h"
#include "rank_group.h"

using braid::CollKind;
using braid::DType;
using namespace braid_test;

namespace {

// The value rank `src` sends as element i of message `msg`: every receiver can check it.
float value(int src, int msg, size_t i) { return static_cast<float>(src * 1000003 + msg * 7919 + static_cast<int>(i % 65521)); }

braid::Request p2p(CollKind kind, int peer, std::vector<float>& buf) {
  braid::Request r;
  r.kind = kind;
  r.dtype = DType::kFloat32;
  r.count = buf.size();
  r.peer = peer;
  r.in = buf.data();
  r.out = buf.data();
  return r;
}

std::vector<float> message(int src, int msg, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = value(src, msg, i);
  return v;
}

void check_message(const std::vector<float>& got, int src, int msg) {
  size_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) wrong += got[i] != value(src, msg, i);
  CHECK_EQ(wrong, size_t{0});
}

constexpr size_t kChunkFloats = braid::kMailboxChunkBytes / sizeof(float);

}  // namespace

// Each rank sends to the next and receives from the previous one, sizes from empty to several
// chunks (all within the eager limit, so an exchange cannot wait on itself).
BRAID_TEST(ring_exchange_every_size) {
  const std::vector<size_t> sizes = {0, 1, 1000, kChunkFloats - 1, kChunkFloats, kChunkFloats + 1, 3 * kChunkFloats + 5};
  for (int world : {2, 3, 4}) {
    GroupSpec g;
    g.world = world;
    g.tunables = tiny_tunables(braid::Algo::kAuto);
    run_group(g, [&](RankCtx& ctx) {
      const int next = (ctx.rank + 1) % world, prev = (ctx.rank + world - 1) % world;
      for (size_t m = 0; m < sizes.size(); ++m) {
        std::vector<float> out = message(ctx.rank, static_cast<int>(m), sizes[m]);
        std::vector<float> in(sizes[m], -1.0f);
        auto sent = ctx.comm.submit(p2p(CollKind::kSend, next, out), true);
        ctx.comm.submit(p2p(CollKind::kRecv, prev, in), false);
        CHECK(sent->wait());
        check_message(in, prev, static_cast<int>(m));
      }
    });
  }
}

// A message of many chunks (past the mailbox depth) makes the sender wait for the receiver;
// collectives in between still match (point-to-point takes no collective sequence number).
BRAID_TEST(flow_control_and_collectives_in_between) {
  GroupSpec g;
  g.world = 3;
  g.tunables = tiny_tunables(braid::Algo::kAuto);
  run_group(g, [&](RankCtx& ctx) {
    const size_t n = (braid::kMailboxDepth + 3) * kChunkFloats + 17;
    CallSpec barrier;
    barrier.kind = CollKind::kBarrier;
    if (ctx.rank == 0) {
      std::vector<float> out = message(0, 1, n);
      ctx.comm.submit(p2p(CollKind::kSend, 2, out), false);
    } else if (ctx.rank == 2) {
      std::vector<float> in(n, -1.0f);
      ctx.comm.submit(p2p(CollKind::kRecv, 0, in), false);
      check_message(in, 0, 1);
    }
    CallSpec sum;
    sum.count = 1001;
    run_and_check(ctx.comm, sum);
    if (ctx.rank == 1) {
      std::vector<float> out = message(1, 2, 5);
      ctx.comm.submit(p2p(CollKind::kSend, 0, out), false);
    } else if (ctx.rank == 0) {
      std::vector<float> in(5);
      ctx.comm.submit(p2p(CollKind::kRecv, 1, in), false);
      check_message(in, 1, 2);
    }
    run_and_check(ctx.comm, barrier);
  });
}

// A receive of another size than the send fails on the receiver, which tells the group.
BRAID_TEST(size_mismatch_raises_on_the_receiver) {
  GroupSpec g;
  g.world = 2;
  g.tunables = tiny_tunables(braid::Algo::kAuto);
  run_group(g, [&](RankCtx& ctx) {
    if (ctx.rank == 0) {
      std::vector<float> out = message(0, 0, 10);
      ctx.comm.submit(p2p(CollKind::kSend, 1, out), false);  // eager: completes without the receiver
      braid::Request barrier;
      barrier.kind = CollKind::kBarrier;
      CHECK_THROWS_KIND(braid::ErrorKind::kMismatch, ctx.comm.submit(barrier, false));
    } else {
      std::vector<float> in(12);
      const std::string msg = CHECK_THROWS_KIND(braid::ErrorKind::kMismatch,
                                                ctx.comm.submit(p2p(CollKind::kRecv, 0, in), false));
      CHECK_MSG(msg.find("expected 48 bytes of float32 from rank 0, which sent 40 bytes") != std::string::npos, msg);
    }
  });
}

// Exchanges larger than the mailboxes, both ways at once: every rank issues its send before its
// receive (async, as batch_isend_irecv does). The progress thread advances queued transfers
// together, so the sends cannot block the receives queued behind them. Several exchanges in
// flight, to the next and (at 3 ranks) the previous rank, with a receive issued before its send
// on one side, and a collective queued behind them.
BRAID_TEST(large_exchanges_both_ways_advance_together) {
  const size_t big = (braid::kMailboxDepth + 2) * kChunkFloats + 3;
  for (int world : {2, 3}) {
    GroupSpec g;
    g.world = world;
    g.tunables = tiny_tunables(braid::Algo::kAuto);
    run_group(g, [&](RankCtx& ctx) {
      const int next = (ctx.rank + 1) % world, prev = (ctx.rank + world - 1) % world;
      std::vector<std::vector<float>> outs, ins;
      for (int m = 0; m < 3; ++m) {
        outs.push_back(message(ctx.rank, m, big + static_cast<size_t>(m)));
        ins.emplace_back(big + static_cast<size_t>(m), -1.0f);
      }
      std::vector<float> back_out = message(ctx.rank, 9, big), back_in(big, -1.0f);
      std::vector<std::shared_ptr<braid::Work>> works;
      for (int m = 0; m < 3; ++m) works.push_back(ctx.comm.submit(p2p(CollKind::kSend, next, outs[m]), true));
      // The reverse direction (another pair of ranks when world > 2), receive first on one side.
      const bool reverse = world > 2;
      if (reverse && ctx.rank == 0) {
        works.push_back(ctx.comm.submit(p2p(CollKind::kRecv, next, back_in), true));
        works.push_back(ctx.comm.submit(p2p(CollKind::kSend, prev, back_out), true));
      } else if (reverse) {
        works.push_back(ctx.comm.submit(p2p(CollKind::kSend, prev, back_out), true));
        works.push_back(ctx.comm.submit(p2p(CollKind::kRecv, next, back_in), true));
      }
      for (int m = 0; m < 3; ++m) works.push_back(ctx.comm.submit(p2p(CollKind::kRecv, prev, ins[m]), true));
      CallSpec sum;
      sum.count = 777;
      run_and_check(ctx.comm, sum);  // queued behind the transfers, in issue order
      for (auto& w : works) CHECK(w->wait());
      for (int m = 0; m < 3; ++m) check_message(ins[m], prev, m);
      if (reverse) check_message(back_in, next, 9);
    });
  }
}

// A blocking receive issued while a large async send waits for its receiver joins the transfers
// the progress thread advances.
BRAID_TEST(blocking_receive_behind_a_waiting_send) {
  const size_t big = (braid::kMailboxDepth + 3) * kChunkFloats;
  GroupSpec g;
  g.world = 2;
  g.tunables = tiny_tunables(braid::Algo::kAuto);
  run_group(g, [&](RankCtx& ctx) {
    const int other = 1 - ctx.rank;
    std::vector<float> out = message(ctx.rank, 4, big), in(big, -1.0f);
    auto sent = ctx.comm.submit(p2p(CollKind::kSend, other, out), true);
    ctx.comm.submit(p2p(CollKind::kRecv, other, in), false);
    CHECK(sent->wait());
    check_message(in, other, 4);
  });
}

// An all-to-all with split sizes (Communicator::submit_exchange): rank i sends (i + 2j + 1) * u
// floats to rank j, with pieces past the mailbox depth at the largest unit; blocking (run
// inline), async (completed by the progress thread's callbacks) and several async exchanges in
// flight with a collective between them. Every piece arrives where the plan puts it, and the
// epilogue runs once, after the last transfer.
BRAID_TEST(exchange_with_split_sizes) {
  for (int world : {2, 3}) {
    GroupSpec g;
    g.world = world;
    g.tunables = tiny_tunables(braid::Algo::kAuto);
    run_group(g, [&](RankCtx& ctx) {
      const int n = world, me = ctx.rank;
      auto count = [&](int from, int to, size_t unit) { return static_cast<size_t>(from + 2 * to + 1) * unit; };
      int call = 0;
      for (size_t unit : {size_t(0), size_t(1), size_t(333), kChunkFloats + 7}) {
        for (bool async : {false, true}) {
          ++call;
          std::vector<std::vector<float>> out(n), in(n);
          std::vector<braid::Request> reqs;
          for (int j = 0; j < n; ++j) {
            out[j] = message(me, call * 16 + j, count(me, j, unit));
            in[j].assign(count(j, me, unit), -1.0f);
            if (j == me) continue;
            reqs.push_back(p2p(CollKind::kSend, j, out[j]));
            reqs.push_back(p2p(CollKind::kRecv, j, in[j]));
          }
          auto epilogues = std::make_shared<int>(0);
          auto w = ctx.comm.submit_exchange(
              DType::kFloat32, std::move(reqs),
              [&, epilogues] {
                ++*epilogues;
                in[me] = out[me];  // the local piece, as the binding's plan copies it
              },
              nullptr, async);
          if (async) CHECK(w && w->wait());
          CHECK_EQ(*epilogues, 1);
          for (int j = 0; j < n; ++j) check_message(in[j], j, call * 16 + me);
        }
      }
      // Three async exchanges and an all_reduce between them, waited in reverse order.
      std::vector<std::vector<float>> bufs;
      bufs.reserve(3 * 2 * static_cast<size_t>(n));
      std::vector<std::shared_ptr<braid::Work>> works;
      for (int k = 0; k < 3; ++k) {
        std::vector<braid::Request> reqs;
        for (int j = 0; j < n; ++j) {
          if (j == me) continue;
          bufs.push_back(message(me, 900 + k * 16 + j, count(me, j, 50)));
          reqs.push_back(p2p(CollKind::kSend, j, bufs.back()));
          bufs.emplace_back(count(j, me, 50), -1.0f);
          reqs.push_back(p2p(CollKind::kRecv, j, bufs.back()));
        }
        works.push_back(ctx.comm.submit_exchange(DType::kFloat32, std::move(reqs), {}, nullptr, true));
        if (k == 1) {
          CallSpec s;
          s.kind = CollKind::kAllReduce;
          s.count = 1000;
          run_and_check(ctx.comm, s);
        }
      }
      for (auto it = works.rbegin(); it != works.rend(); ++it) CHECK((*it)->wait());
      size_t b = 0;
      for (int k = 0; k < 3; ++k)
        for (int j = 0; j < n; ++j) {
          if (j == me) continue;
          b += 1;  // the sent buffer
          check_message(bufs[b++], j, 900 + k * 16 + me);
        }
    });
  }
}

// A message already in the mailbox is received although its sender failed since (the failure is
// published after the message, so the receiver sees both): the receive completes, and the wait
// for one that never came raises the sender's failure. The ranks order the steps through a pipe.
BRAID_TEST(delivered_message_is_received_after_its_sender_failed) {
  int order[2];
  CHECK(::pipe(order) == 0);
  GroupSpec g;
  g.world = 2;
  g.tunables = tiny_tunables(braid::Algo::kAuto);
  run_group(g, [&](RankCtx& ctx) {
    if (ctx.rank == 0) {
      std::vector<float> out = message(0, 0, 10);
      ctx.comm.submit(p2p(CollKind::kSend, 1, out), false);  // eager: in rank 1's mailbox on return
      ctx.comm.abort();
      const char done = 1;
      CHECK(::write(order[1], &done, 1) == 1);
      ctx.hold_until_others_exit();
      return;
    }
    char done = 0;
    CHECK(::read(order[0], &done, 1) == 1);
    std::vector<float> in(10);
    ctx.comm.submit(p2p(CollKind::kRecv, 0, in), false);
    check_message(in, 0, 0);
    const std::string msg = CHECK_THROWS_KIND(braid::ErrorKind::kPeer, ctx.comm.submit(p2p(CollKind::kRecv, 0, in), false));
    CHECK_MSG(msg.find("rank 0") != std::string::npos, msg);
  });
  ::close(order[0]);
  ::close(order[1]);
}

// A point-to-point failure after a collective does not fail that collective on a peer still
// finishing it. Rank 2 arrives at an all_reduce and is stopped (SIGSTOP) while it sleeps there;
// ranks 0 and 1 complete it, and rank 1 then fails a receive of the wrong size. Continued, rank 2
// completes the all_reduce with the right sums (everything it needs was posted before the
// failure), and its next collective raises rank 1's failure. Rank 2 once raised the failure in
// the all_reduce itself: the failure was dated to the last collective rank 1 had joined.
BRAID_TEST(point_to_point_failure_after_a_collective_spares_a_late_peer) {
  int pid_pipe[2], failed_pipe[2];
  CHECK(::pipe(pid_pipe) == 0);
  CHECK(::pipe(failed_pipe) == 0);
  GroupSpec g;
  g.world = 3;
  g.tunables = tiny_tunables(braid::Algo::kOneShot);
  run_group(g, [&](RankCtx& ctx) {
    std::vector<float> t(3, static_cast<float>(ctx.rank + 1));
    braid::Request all_reduce;
    all_reduce.kind = CollKind::kAllReduce;
    all_reduce.dtype = DType::kFloat32;
    all_reduce.count = t.size();
    all_reduce.in = t.data();
    all_reduce.out = t.data();
    if (ctx.rank == 2) {
      const pid_t me = ::getpid();
      CHECK(::write(pid_pipe[1], &me, sizeof me) == static_cast<ssize_t>(sizeof me));
      ctx.comm.submit(all_reduce, false);  // stopped and continued by rank 0 in here
      for (float x : t) CHECK_EQ(x, 6.0f);
      CHECK_THROWS_KIND(braid::ErrorKind::kMismatch, ctx.comm.submit(all_reduce, false));
      return;
    }
    if (ctx.rank == 0) {
      pid_t late = 0;
      CHECK(::read(pid_pipe[0], &late, sizeof late) == static_cast<ssize_t>(sizeof late));
      // Asleep ('S') means inside the all_reduce, its arrival posted: nothing else blocks there.
      auto state = [&] {
        std::ifstream f("/proc/" + std::to_string(late) + "/stat");
        std::string pid, comm, st;
        f >> pid >> comm >> st;
        return st;
      };
      for (int i = 0; i < 10000 && state() != "S"; ++i) ::usleep(1000);
      CHECK(::kill(late, SIGSTOP) == 0);
      ctx.comm.submit(all_reduce, false);
      for (float x : t) CHECK_EQ(x, 6.0f);
      std::vector<float> out = message(0, 0, 10);
      ctx.comm.submit(p2p(CollKind::kSend, 1, out), false);  // eager: 10 floats where 12 are expected
      char done = 0;
      CHECK(::read(failed_pipe[0], &done, 1) == 1);
      CHECK(::kill(late, SIGCONT) == 0);
      ctx.hold_until_others_exit();
      return;
    }
    ctx.comm.submit(all_reduce, false);
    for (float x : t) CHECK_EQ(x, 6.0f);
    std::vector<float> in(12);
    CHECK_THROWS_KIND(braid::ErrorKind::kMismatch, ctx.comm.submit(p2p(CollKind::kRecv, 0, in), false));
    const char done = 1;
    CHECK(::write(failed_pipe[1], &done, 1) == 1);
    ctx.hold_until_others_exit();
  });
  for (int fd : {pid_pipe[0], pid_pipe[1], failed_pipe[0], failed_pipe[1]}) ::close(fd);
}
