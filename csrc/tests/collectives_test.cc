// Collectives across 2, 3 and 4 forked ranks: every algorithm, dtype, op and boundary size,
// exact against the locally computed reference on every rank.
#include "check.h"
#include "collective_check.h"
#include "rank_group.h"

using braid::Algo;
using braid::CollKind;
using braid::DType;
using braid::ReduceOp;
using namespace braid_test;

namespace {

constexpr int kWorlds[] = {2, 3, 4};

// One group per world size runs every (dtype, op, count) of `kind` back to back, alternating
// in-place and out-of-place calls and rotating the broadcast root, with a barrier after each
// size sweep: consecutive calls reuse the one-shot buffers and slots of their predecessors.
void sweep(CollKind kind, Algo algo) {
  const bool reduces = kind == CollKind::kAllReduce || kind == CollKind::kReduceScatter;
  for (int world : kWorlds) {
    GroupSpec g;
    g.world = world;
    g.tunables = tiny_tunables(algo);
    run_group(g, [&](RankCtx& ctx) {
      int call = 0;
      for (DType dt : kAllDTypes) {
        const auto counts = interesting_counts(kind, algo, dt, world);
        for (ReduceOp op : kAllOps) {
          if (!reduces && op != ReduceOp::kSum) continue;
          for (size_t count : counts) {
            CallSpec s;
            s.kind = kind;
            s.dtype = dt;
            s.op = op;
            s.count = count;
            s.root = call % world;
            s.in_place = call % 2 == 1 && kind != CollKind::kAllToAll;
            s.call = call++;
            run_and_check(ctx.comm, s);
          }
          ctx.comm.submit(braid::Request{}, false);  // a default Request is a barrier
        }
      }
    });
  }
}

}  // namespace

BRAID_TEST(all_reduce_oneshot) { sweep(CollKind::kAllReduce, Algo::kOneShot); }
BRAID_TEST(all_reduce_twoshot) { sweep(CollKind::kAllReduce, Algo::kTwoShot); }
BRAID_TEST(all_reduce_ring) { sweep(CollKind::kAllReduce, Algo::kRing); }
BRAID_TEST(reduce_scatter) { sweep(CollKind::kReduceScatter, Algo::kAuto); }
BRAID_TEST(all_gather) { sweep(CollKind::kAllGather, Algo::kAuto); }
BRAID_TEST(all_to_all) { sweep(CollKind::kAllToAll, Algo::kAuto); }
BRAID_TEST(broadcast_from_every_root) { sweep(CollKind::kBroadcast, Algo::kAuto); }

// The shallowest pipeline Tunables::validate accepts (2 slots: the ring writes one while its
// neighbour reads the other) must work for every pipelined algorithm. A short timeout turns a
// deadlock into a quick CommTimeout.
BRAID_TEST(shallowest_pipelines) {
  for (int world : {2, 3}) {
    for (Algo algo : {Algo::kTwoShot, Algo::kRing}) {
      GroupSpec g;
      g.world = world;
      g.tunables = tiny_tunables(algo);
      g.tunables.nslots = 2;
      g.timeout_s = 3;
      run_group(g, [&](RankCtx& ctx) {
        int call = 0;
        for (CollKind kind : {CollKind::kReduceScatter, CollKind::kAllGather, CollKind::kAllToAll, CollKind::kBroadcast,
                              CollKind::kAllReduce}) {
          CallSpec s;
          s.kind = kind;
          s.count = 700;  // several pipeline rounds of 1 KiB slots for every kind
          s.call = call++;
          run_and_check(ctx.comm, s);
        }
      });
    }
  }
}

// Empty tensors reach the core with null data pointers (torch's data_ptr() of a 0-element
// tensor); a count of 0 must not touch them.
BRAID_TEST(zero_count_with_null_pointers) {
  for (Algo algo : {Algo::kOneShot, Algo::kTwoShot, Algo::kRing}) {
    GroupSpec g;
    g.world = 3;
    g.tunables = tiny_tunables(algo);
    run_group(g, [&](RankCtx& ctx) {
      for (CollKind kind : {CollKind::kAllReduce, CollKind::kReduceScatter, CollKind::kAllGather, CollKind::kAllToAll,
                            CollKind::kBroadcast}) {
        braid::Request r;
        r.kind = kind;
        r.count = 0;
        ctx.comm.submit(r, false);
      }
    });
  }
}
