// The quantized all-reduce (all-to-all of quantized chunks, float32 sum in rank order, one
// re-quantization, all-gather) across 2 and 3 forked ranks: every rank recomputes every rank's
// payload from the seeds and checks the gathered bytes exactly, blocking and queued async calls,
// through pipelined slots. The Python tests check the same pipeline against pure torch; these
// run under the sanitizer builds.
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "check.h"
#include "collective_check.h"
#include "core/compression/quantize.h"
#include "core/algorithms/quantized_all_reduce.h"
#include "rank_group.h"

using braid::Algo;
using braid::DType;
using braid::QuantFormat;
using namespace braid_test;

namespace {

// Rank r's input of call `call`: normal values with a scale that varies per block.
std::vector<float> input_of(int r, int call, size_t count) {
  std::mt19937_64 rng(1000003ull * static_cast<uint64_t>(call) + static_cast<uint64_t>(r));
  std::normal_distribution<float> normal;
  std::vector<float> x(count);
  for (size_t i = 0; i < count; ++i) x[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>((i / 32) % 7) - 3);
  return x;
}

// One call's buffers: the quantized input (world chunks) and the scratch the operation needs.
struct Call {
  QuantFormat fmt;
  size_t chunk;
  std::vector<uint8_t> send, recv, gathered;
  std::vector<float> acc;
  Call(QuantFormat f, size_t c, int world, int rank, int call)
      : fmt(f), chunk(c), send(f.bytes(c) * world), recv(send.size()), gathered(send.size(), 0xEE),
        acc(c) {
    const std::vector<float> x = input_of(rank, call, chunk * world);
    braid::quantize(fmt, DType::kFloat32, x.data(), nullptr, x.size(), chunk, world, true, seed_of(rank, call), 0,
                    send.data());
  }
  static uint64_t seed_of(int rank, int call) { return 77 + 131ull * call + rank; }
  braid::QuantizedAllReduceArgs args(bool average, uint64_t seed) {
    braid::QuantizedAllReduceArgs a;
    a.fmt = fmt;
    a.chunk = chunk;
    a.average = average;
    a.seed = seed;
    a.send = send.data();
    a.recv = recv.data();
    a.acc = acc.data();
    a.gathered = gathered.data();
    return a;
  }
};

// The gathered bytes every rank must hold: chunk j is the rank-order float32 sum of every
// rank's chunk j, averaged or not, re-quantized with (seed, elements from j * chunk).
std::vector<uint8_t> expected_gathered(QuantFormat fmt, size_t chunk, int world, int call, bool average,
                                       uint64_t seed) {
  const size_t cb = fmt.bytes(chunk);
  std::vector<std::vector<uint8_t>> sends;
  for (int r = 0; r < world; ++r) sends.push_back(Call(fmt, chunk, world, r, call).send);
  std::vector<uint8_t> out(cb * world);
  for (int j = 0; j < world; ++j) {
    std::vector<float> acc(chunk, 0.0f), part(chunk);
    for (int r = 0; r < world; ++r) {
      braid::dequantize(fmt, sends[r].data() + j * cb, chunk, chunk, DType::kFloat32, part.data());
      for (size_t i = 0; i < chunk; ++i) acc[i] += part[i];
    }
    if (average && world > 1)
      for (float& v : acc) v /= static_cast<float>(world);
    braid::quantize(fmt, DType::kFloat32, acc.data(), nullptr, chunk, chunk, 1, true, seed, j * chunk,
                    out.data() + j * cb);
  }
  return out;
}

}  // namespace

BRAID_TEST(quantized_all_reduce_matches_the_local_pipeline) {
  for (int world : {2, 3}) {
    GroupSpec g;
    g.world = world;
    g.tunables = tiny_tunables(Algo::kAuto);  // 1 KiB slots: the all-to-all and all-gather pipeline
    run_group(g, [&](RankCtx& ctx) {
      int call = 0;
      for (QuantFormat fmt : {QuantFormat{8, 32}, QuantFormat{4, 32}, QuantFormat{8, 256}}) {
        for (size_t blocks : {1, 3, 9}) {
          const size_t chunk = blocks * fmt.block;
          // Blocking, then three queued async calls waited in reverse order.
          for (bool async : {false, true}) {
            const int first = call;
            std::vector<std::unique_ptr<Call>> calls;
            std::vector<std::shared_ptr<braid::Work>> works;
            for (int k = 0; k < (async ? 3 : 1); ++k, ++call) {
              calls.push_back(std::make_unique<Call>(fmt, chunk, world, ctx.rank, call));
              const auto a = calls.back()->args(call % 2 == 1, 5000 + call);
              works.push_back(ctx.comm.submit_task([&c = ctx.comm, a] { braid::quantized_all_reduce(c, a); },
                                                   nullptr, async));
            }
            if (async)
              for (auto it = works.rbegin(); it != works.rend(); ++it) CHECK((*it)->wait() && (*it)->succeeded());
            for (size_t k = 0; k < calls.size(); ++k) {
              const int id = first + static_cast<int>(k);
              const auto want = expected_gathered(fmt, chunk, world, id, id % 2 == 1, 5000 + id);
              CHECK_MSG(calls[k]->gathered == want,
                        "world " + std::to_string(world) + " int" + std::to_string(fmt.bits) + " block " +
                            std::to_string(fmt.block) + " chunk " + std::to_string(chunk) + " call " +
                            std::to_string(id) + (async ? " async" : " blocking"));
            }
          }
        }
      }
    });
  }
}
