// The staging pipeline (core/staging.h) on a CPU copy engine whose lanes are threads: chunk
// boundaries, the order of copies and host steps, overlap, failures midway, and collectives of a
// real communicator staged through it, checked against exact references.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "collective_check.h"
#include "core/staging.h"
#include "rank_group.h"

using braid::CollKind;
using braid::CopyEngine;
using braid::DType;
using braid::Lane;
using braid::StagedChunk;
using braid::StagingLayout;
using braid::StagingOptions;
using namespace braid_test;

namespace {

// One memory range an operation read or wrote.
struct Range {
  const char* lo;
  const char* hi;
  bool write;
};

// An operation that touched memory, between two ticks of the engine's logical clock. Ticks are
// taken under the engine's lock just before and just after the access, so an operation whose
// end tick precedes another's start tick really finished before the other began.
struct Access {
  uint64_t start = 0, end = 0;
  std::vector<Range> ranges;
  std::string what;
};

// The CPU implementation of CopyEngine: each lane is a thread running its queue in order (copies
// are memcpy; "device" memory is ordinary memory), events are generation counters. Failures can
// be injected: a copy() call that throws at once (a refused launch) or a copy that fails when it
// runs (reported, as on a GPU, by synchronizing an event recorded after it). An optional random
// delay before each operation shakes the interleavings of the two lanes and the host.
class ThreadCopyEngine final : public CopyEngine {
 public:
  explicit ThreadCopyEngine(uint64_t seed = 1, int jitter_us = 0) : jitter_us_(jitter_us) {
    for (int l = 0; l < 2; ++l) {
      lanes_[l].rng.seed(seed * 2 + static_cast<uint64_t>(l));
      lanes_[l].thread = std::thread([this, l] { lane_loop(l); });
    }
  }
  ~ThreadCopyEngine() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& l : lanes_) l.thread.join();
  }

  char* prepare(size_t bytes, int events) override {
    std::unique_lock<std::mutex> lk(mu_);
    if (bytes > host_.size()) {
      cv_.wait(lk, [&] { return idle_locked(); });
      host_.assign(bytes, 0);
      ++grown_;
    }
    if (static_cast<int>(events_.size()) < events) events_.resize(static_cast<size_t>(events));
    return host_.data();
  }

  void copy(Lane lane, void* dst, const void* src, size_t bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    LaneState& l = lanes_[static_cast<int>(lane)];
    const int k = l.copies_issued++;
    if (k == l.throw_at) throw std::runtime_error("injected: copy " + std::to_string(k) + " refused");
    l.queue.push_back(Op{Op::kCopy, static_cast<char*>(dst), static_cast<const char*>(src), bytes, -1, 0, k == l.fail_at});
    cv_.notify_all();
  }

  void record(int event, Lane lane) override {
    std::lock_guard<std::mutex> lk(mu_);
    Event& e = events_.at(static_cast<size_t>(event));
    LaneState& l = lanes_[static_cast<int>(lane)];
    l.queue.push_back(Op{Op::kRecord, nullptr, nullptr, 0, event, ++e.recorded, false});
    ++l.records_issued;
    cv_.notify_all();
  }

  void wait(Lane lane, int event) override {
    std::lock_guard<std::mutex> lk(mu_);
    const uint64_t gen = events_.at(static_cast<size_t>(event)).recorded;
    if (gen == 0) return;
    lanes_[static_cast<int>(lane)].queue.push_back(Op{Op::kWait, nullptr, nullptr, 0, event, gen, false});
    cv_.notify_all();
  }

  void synchronize(int event) override {
    std::unique_lock<std::mutex> lk(mu_);
    const Event& e = events_.at(static_cast<size_t>(event));
    const uint64_t gen = e.recorded;
    cv_.wait(lk, [&] { return e.completed >= gen; });
    if (!e.error.empty()) throw std::runtime_error(e.error);
  }

  void drain() noexcept override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return idle_locked(); });
    ++drains_;
    for (auto& l : lanes_) l.error.clear();
    for (auto& e : events_) e.error.clear();
  }

  // Test controls and observations.
  void throw_on_copy(Lane lane, int k) {
    std::lock_guard<std::mutex> lk(mu_);
    lanes_[static_cast<int>(lane)].throw_at = lanes_[static_cast<int>(lane)].copies_issued + k;
  }
  void fail_copy(Lane lane, int k) {
    std::lock_guard<std::mutex> lk(mu_);
    lanes_[static_cast<int>(lane)].fail_at = lanes_[static_cast<int>(lane)].copies_issued + k;
  }
  // Waits until both lanes are idle; throws the error of a lane that failed.
  void finish() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return idle_locked(); });
    for (auto& l : lanes_)
      if (!l.error.empty()) throw std::runtime_error(l.error);
  }
  bool idle() {
    std::lock_guard<std::mutex> lk(mu_);
    return idle_locked();
  }
  // Waits (up to 20 s) until `lane` completed at least `n` records; false if it did not.
  bool await_records(Lane lane, int n) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::seconds(20), [&] { return lanes_[static_cast<int>(lane)].records_done >= n; });
  }
  int records_issued(Lane lane) {
    std::lock_guard<std::mutex> lk(mu_);
    return lanes_[static_cast<int>(lane)].records_issued;
  }
  int records_done(Lane lane) {
    std::lock_guard<std::mutex> lk(mu_);
    return lanes_[static_cast<int>(lane)].records_done;
  }
  int copies_done(Lane lane) {
    std::lock_guard<std::mutex> lk(mu_);
    return lanes_[static_cast<int>(lane)].copies_done;
  }
  int drains() {
    std::lock_guard<std::mutex> lk(mu_);
    return drains_;
  }
  uint64_t tick() {
    std::lock_guard<std::mutex> lk(mu_);
    return ++clock_;
  }
  void log(Access a) {
    std::lock_guard<std::mutex> lk(mu_);
    log_.push_back(std::move(a));
  }
  std::vector<Access> take_log() {
    std::lock_guard<std::mutex> lk(mu_);
    return std::move(log_);
  }

 private:
  struct Op {
    enum Kind { kCopy, kRecord, kWait } kind;
    char* dst;
    const char* src;
    size_t bytes;
    int event;
    uint64_t gen;
    bool fail;
  };
  struct Event {
    uint64_t recorded = 0, completed = 0;
    std::string error;  // the error of its lane when it completed
  };
  struct LaneState {
    std::deque<Op> queue;
    bool busy = false;
    std::string error;  // sticky until drain(), as a failed stream
    int copies_issued = 0, copies_done = 0, records_issued = 0, records_done = 0;
    int throw_at = -1, fail_at = -1;
    std::mt19937_64 rng;  // only the lane's thread draws from it
    std::thread thread;
  };

  bool idle_locked() const {
    for (const auto& l : lanes_)
      if (l.busy || !l.queue.empty()) return false;
    return true;
  }

  void lane_loop(int lane) {
    LaneState& l = lanes_[lane];
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !l.queue.empty(); });
      if (l.queue.empty()) return;
      const Op op = l.queue.front();
      l.busy = true;
      if (jitter_us_ > 0) {
        const auto us = static_cast<int>(l.rng() % static_cast<uint64_t>(jitter_us_ + 1));
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(us));
        lk.lock();
      }
      switch (op.kind) {
        case Op::kCopy:
          if (l.error.empty()) {
            Access a;
            a.start = ++clock_;
            a.what = lane == 0 ? "to host" : "to device";
            a.ranges = {{op.src, op.src + op.bytes, false}, {op.dst, op.dst + op.bytes, true}};
            lk.unlock();
            if (!op.fail) std::memcpy(op.dst, op.src, op.bytes);
            lk.lock();
            a.end = ++clock_;
            log_.push_back(std::move(a));
            if (op.fail) l.error = "injected: copy failed on the " + std::string(lane == 0 ? "to-host" : "to-device") + " lane";
            ++l.copies_done;
          }
          break;
        case Op::kRecord: {
          Event& e = events_[static_cast<size_t>(op.event)];
          e.completed = std::max(e.completed, op.gen);
          e.error = l.error;
          ++l.records_done;
          break;
        }
        case Op::kWait: {
          const Event& e = events_[static_cast<size_t>(op.event)];
          cv_.wait(lk, [&] { return stop_ || e.completed >= op.gen; });
          break;
        }
      }
      l.queue.pop_front();
      l.busy = false;
      cv_.notify_all();
    }
  }

  const int jitter_us_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t clock_ = 0;
  int grown_ = 0, drains_ = 0;
  std::vector<char> host_;
  std::vector<Event> events_;
  LaneState lanes_[2];
  std::vector<Access> log_;
};

// A host step that every layout can run: output part q, byte k = sum_p (p + 1) * input part p,
// byte k, plus q + 1 (mod 256). Logged as an access of the chunk's host input and output.
struct ByteStep {
  StagingLayout layout;
  ThreadCopyEngine* engine;
  std::function<void(const StagedChunk&)> before;  // runs first (tests look at the lanes here)

  void operator()(const StagedChunk& c) const {
    if (before) before(c);
    const size_t n = c.len * layout.elem_size;
    Access a;
    a.start = engine->tick();
    a.what = "step " + std::to_string(c.index);
    a.ranges.push_back({c.in, c.in + n * static_cast<size_t>(layout.in_parts), false});
    a.ranges.push_back({c.out, c.out + n * static_cast<size_t>(layout.out_parts), true});
    std::vector<unsigned char> sums(n, 0);
    for (int p = 0; p < layout.in_parts; ++p)
      for (size_t k = 0; k < n; ++k) sums[k] = static_cast<unsigned char>(sums[k] + (p + 1) * static_cast<unsigned char>(c.in[p * n + k]));
    for (int q = 0; q < layout.out_parts; ++q)
      for (size_t k = 0; k < n; ++k) c.out[q * n + k] = static_cast<char>(sums[k] + q + 1);
    a.end = engine->tick();
    engine->log(std::move(a));
  }
};

// The device buffers of a layout, filled with a seeded pattern, and what ByteStep must leave in
// the output (bytes outside the parts keep their fill; one guard byte after each buffer).
struct DeviceBuffers {
  std::vector<char> in, out, expected;

  DeviceBuffers(const StagingLayout& l, uint32_t seed) {
    const size_t es = l.elem_size, part = l.count * es;
    in.resize(std::max<size_t>(1, l.in_parts) * part + 1);
    out.resize(std::max<size_t>(1, l.out_parts) * part + 1);
    std::mt19937 rng(seed);
    for (auto& b : in) b = static_cast<char>(rng());
    for (auto& b : out) b = static_cast<char>(rng());
    expected = out;
    for (int q = 0; q < l.out_parts; ++q)
      for (size_t k = 0; k < part; ++k) {
        unsigned char s = 0;
        for (int p = 0; p < l.in_parts; ++p) s = static_cast<unsigned char>(s + (p + 1) * static_cast<unsigned char>(in[p * part + k]));
        expected[q * part + k] = static_cast<char>(s + q + 1);
      }
  }
};

// No two accesses that overlap in time touch overlapping memory when one of them writes.
void check_no_races(const std::vector<Access>& log, const std::string& where) {
  for (size_t i = 0; i < log.size(); ++i)
    for (size_t j = i + 1; j < log.size(); ++j) {
      const Access &a = log[i], &b = log[j];
      if (a.end < b.start || b.end < a.start) continue;
      for (const Range& x : a.ranges)
        for (const Range& y : b.ranges)
          if ((x.write || y.write) && x.lo < y.hi && y.lo < x.hi && x.lo != x.hi && y.lo != y.hi)
            CHECK_MSG(false, where + ": '" + a.what + "' and '" + b.what + "' touch the same memory at the same time");
    }
}

StagingLayout layout_of(size_t elem_size, size_t count, int in_parts, int out_parts, bool in_place) {
  StagingLayout l;
  l.elem_size = elem_size;
  l.count = count;
  l.in_parts = in_parts;
  l.out_parts = out_parts;
  l.in_stride = count;
  l.out_stride = count;
  l.in_place = in_place;
  return l;
}

struct Shape {
  int in_parts, out_parts;
  bool in_place;
};
// all_reduce, broadcast on a root and elsewhere, all_gather, reduce_scatter and all_to_all at 3 ranks.
const Shape kShapes[] = {{1, 1, true}, {0, 1, true}, {1, 3, false}, {3, 1, false}, {3, 3, false}};

std::string where_of(const StagingLayout& l, const StagingOptions& o) {
  return "es " + std::to_string(l.elem_size) + " count " + std::to_string(l.count) + " parts " +
         std::to_string(l.in_parts) + "/" + std::to_string(l.out_parts) + " chunk " + std::to_string(o.chunk_bytes) +
         " slots " + std::to_string(o.slots);
}

}  // namespace

// Every chunk boundary (0, 1, a chunk -1/+1, many chunks, a last chunk of one element) for every
// layout and pipeline depth: the output is exact, the guard bytes and the bytes outside the parts
// are untouched, each chunk's step sees its data, and no copy or step overlaps a conflicting one.
BRAID_TEST(chunk_boundaries_every_layout) {
  ThreadCopyEngine engine(7, 20);
  for (size_t es : {size_t(1), size_t(4), size_t(8)}) {
    const size_t chunk_elems = 5;
    for (size_t count : {size_t(0), size_t(1), chunk_elems - 1, chunk_elems, chunk_elems + 1, 2 * chunk_elems,
                         3 * chunk_elems + 1, 11 * chunk_elems + 3}) {
      for (const Shape& sh : kShapes) {
        for (int slots : {1, 2, 3, 5}) {
          StagingOptions o;
          o.chunk_bytes = chunk_elems * es + (es > 1 ? es - 1 : 0);  // a chunk holds whole elements
          o.slots = slots;
          const StagingLayout l = layout_of(es, count, sh.in_parts, sh.out_parts, sh.in_place);
          DeviceBuffers d(l, static_cast<uint32_t>(count * 131 + es));
          std::vector<size_t> seen;
          const int to_host0 = engine.records_issued(Lane::kToHost);
          ByteStep step{l, &engine, [&](const StagedChunk& c) {
                          seen.push_back(c.index);
                          CHECK_EQ(c.offset, c.index * chunk_elems);
                          const size_t len = std::min(chunk_elems, count - std::min(count, c.offset));
                          CHECK_EQ(c.len, len);
                          // At most `slots` chunks are copied ahead of the one reduced.
                          CHECK(engine.records_issued(Lane::kToHost) - to_host0 <= static_cast<int>(c.index) + slots);
                        }};
          braid::run_staged(engine, l, d.in.data(), d.out.data(), o, step, true);
          engine.finish();
          const std::string where = where_of(l, o);
          const size_t nchunks = std::max<size_t>(1, (count + chunk_elems - 1) / chunk_elems);
          CHECK_MSG(seen.size() == nchunks, where + ": " + std::to_string(seen.size()) + " steps");
          for (size_t i = 0; i < seen.size(); ++i) CHECK_EQ(seen[i], i);
          CHECK_MSG(d.out == d.expected, where + ": wrong output");
          check_no_races(engine.take_log(), where);
        }
      }
    }
  }
}

// Ordering, directly: no chunk's step starts before the copies of its input ended, and no copy
// back of a chunk starts before its step ended.
BRAID_TEST(steps_wait_for_their_copies_and_copies_back_for_their_steps) {
  ThreadCopyEngine engine(3, 30);
  const size_t es = 4, chunk = 8, count = 9 * chunk + 5;
  for (const Shape& sh : kShapes) {
    StagingOptions o;
    o.chunk_bytes = chunk * es;
    o.slots = 3;
    const StagingLayout l = layout_of(es, count, sh.in_parts, sh.out_parts, sh.in_place);
    DeviceBuffers d(l, 11);
    braid::run_staged(engine, l, d.in.data(), d.out.data(), o, ByteStep{l, &engine, {}}, true);
    const auto log = engine.take_log();
    const std::string where = where_of(l, o);
    CHECK_MSG(d.out == d.expected, where + ": wrong output");
    // The chunk a device address belongs to.
    auto chunk_of = [&](const char* p, const std::vector<char>& buf) {
      return static_cast<size_t>(p - buf.data()) / es % count / chunk;
    };
    std::vector<uint64_t> step_start(11, 0), step_end(11, 0);
    for (const auto& a : log)
      if (a.what.rfind("step ", 0) == 0) {
        const size_t c = std::stoul(a.what.substr(5));
        step_start[c] = a.start;
        step_end[c] = a.end;
      }
    int to_host = 0, to_device = 0;
    for (const auto& a : log) {
      if (a.what == "to host") {
        const size_t c = chunk_of(a.ranges[0].lo, d.in);
        CHECK_MSG(a.end < step_start[c], where + ": chunk " + std::to_string(c) + "'s step began before its copy ended");
        ++to_host;
      } else if (a.what == "to device") {
        const size_t c = chunk_of(a.ranges[1].lo, d.out);
        CHECK_MSG(a.start > step_end[c], where + ": chunk " + std::to_string(c) + "'s copy back began before its step ended");
        ++to_device;
      }
    }
    CHECK_EQ(to_host, 10 * sh.in_parts);
    CHECK_EQ(to_device, 10 * sh.out_parts);
  }
}

// The pipeline overlaps: while chunk c is reduced, the copy to the host of chunk c + 1 and the copy
// back of chunk c - 1 run. Each step waits (bounded) for the lanes to get there on their own: a
// pipeline that queued them only after the step would never let them finish, and the step
// would give up.
BRAID_TEST(copies_overlap_the_step) {
  ThreadCopyEngine engine;
  const size_t es = 4, chunk = 16, nchunks = 12;
  for (const Shape& sh : {kShapes[0], kShapes[2]}) {
    for (int slots : {2, 3}) {
      StagingOptions o;
      o.chunk_bytes = chunk * es;
      o.slots = slots;
      const StagingLayout l = layout_of(es, nchunks * chunk, sh.in_parts, sh.out_parts, sh.in_place);
      DeviceBuffers d(l, 5);
      const int to_host0 = engine.records_done(Lane::kToHost), to_device0 = engine.records_done(Lane::kToDevice);
      ByteStep step{l, &engine, [&](const StagedChunk& c) {
                      const int i = static_cast<int>(c.index);
                      if (c.index + 1 < nchunks)
                        CHECK_MSG(engine.await_records(Lane::kToHost, to_host0 + i + 2),
                                  "the copy to the host of chunk " + std::to_string(i + 1) + " did not run during step " +
                                      std::to_string(i));
                      if (i > 0)
                        CHECK_MSG(engine.await_records(Lane::kToDevice, to_device0 + i),
                                  "the copy back of chunk " + std::to_string(i - 1) + " did not run during step " +
                                      std::to_string(i));
                    }};
      braid::run_staged(engine, l, d.in.data(), d.out.data(), o, step, true);
      CHECK(d.out == d.expected);
      check_no_races(engine.take_log(), where_of(l, o));
    }
  }
}

// One slot: nothing is copied ahead, and the results are still exact.
BRAID_TEST(one_slot_copies_nothing_ahead) {
  ThreadCopyEngine engine(9, 10);
  StagingOptions o;
  o.chunk_bytes = 12;
  o.slots = 1;
  const StagingLayout l = layout_of(4, 40, 1, 1, true);
  DeviceBuffers d(l, 2);
  ByteStep step{l, &engine, [&](const StagedChunk& c) {
                  CHECK_EQ(engine.records_issued(Lane::kToHost), static_cast<int>(c.index) + 1);
                }};
  braid::run_staged(engine, l, d.in.data(), d.out.data(), o, step, true);
  CHECK(d.out == d.expected);
  check_no_races(engine.take_log(), "one slot");
}

// Back-to-back calls with different layouts reuse the same pinned memory: the copies back of one
// call still running must not meet the next call's copies (checked as races over both calls).
BRAID_TEST(consecutive_calls_with_different_layouts) {
  ThreadCopyEngine engine(13, 40);
  StagingOptions o;
  o.chunk_bytes = 24;
  o.slots = 3;
  std::vector<std::unique_ptr<DeviceBuffers>> bufs;
  std::vector<StagingLayout> layouts;
  for (int call = 0; call < 12; ++call) {
    const Shape& sh = kShapes[call % 5];
    layouts.push_back(layout_of(call % 2 ? 4 : 2, 7 + 13 * static_cast<size_t>(call % 4), sh.in_parts, sh.out_parts,
                                sh.in_place));
    bufs.push_back(std::make_unique<DeviceBuffers>(layouts.back(), static_cast<uint32_t>(call)));
    braid::run_staged(engine, layouts.back(), bufs.back()->in.data(), bufs.back()->out.data(), o,
                      ByteStep{layouts.back(), &engine, {}}, false);
  }
  engine.finish();
  for (size_t i = 0; i < bufs.size(); ++i) CHECK_MSG(bufs[i]->out == bufs[i]->expected, "call " + std::to_string(i));
  check_no_races(engine.take_log(), "consecutive calls");
}

// A copy refused when queued, a copy that fails when it runs (either lane), a step that throws:
// the call throws that error, no step runs after the failure is seen, the engine was drained
// (nothing of the call still running), and the engine serves the next call exactly.
BRAID_TEST(failures_midway_fail_the_call) {
  ThreadCopyEngine engine(17, 20);
  const size_t es = 4, chunk = 4, nchunks = 8;
  StagingOptions o;
  o.chunk_bytes = chunk * es;
  o.slots = 2;
  enum Fault { kRefuseToHost, kRefuseToDevice, kFailToHost, kFailToDevice, kStepThrows };
  for (Fault f : {kRefuseToHost, kRefuseToDevice, kFailToHost, kFailToDevice, kStepThrows}) {
    for (const Shape& sh : {kShapes[0], kShapes[3]}) {
      const StagingLayout l = layout_of(es, nchunks * chunk, sh.in_parts, sh.out_parts, sh.in_place);
      DeviceBuffers d(l, 3);
      const int k = 5;  // the fault hits the 6th copy of its lane, or the 6th step
      const int parts = f == kRefuseToDevice || f == kFailToDevice ? l.out_parts : l.in_parts;
      const size_t bad_chunk = static_cast<size_t>(k / parts);
      if (f == kRefuseToHost) engine.throw_on_copy(Lane::kToHost, k);
      if (f == kRefuseToDevice) engine.throw_on_copy(Lane::kToDevice, k);
      if (f == kFailToHost) engine.fail_copy(Lane::kToHost, k);
      if (f == kFailToDevice) engine.fail_copy(Lane::kToDevice, k);
      std::vector<size_t> steps;
      ByteStep step{l, &engine, [&](const StagedChunk& c) {
                      steps.push_back(c.index);
                      if (f == kStepThrows && c.index == static_cast<size_t>(k))
                        throw braid::CommError(braid::ErrorKind::kPeer, "injected: step failed");
                    }};
      const int drains = engine.drains();
      std::string error;
      try {
        braid::run_staged(engine, l, d.in.data(), d.out.data(), o, step, true);
      } catch (const std::exception& e) {
        error = e.what();
      }
      const std::string where = "fault " + std::to_string(f) + " parts " + std::to_string(l.in_parts);
      CHECK_MSG(error.find("injected") != std::string::npos, where + ": the call did not fail (" + error + ")");
      CHECK_EQ(engine.drains(), drains + 1);
      CHECK(engine.idle());
      if (f == kFailToHost || f == kRefuseToHost) {
        // The chunk whose input did not arrive is never reduced, nor any after it.
        CHECK_MSG(steps.size() <= bad_chunk, where + ": " + std::to_string(steps.size()) + " steps ran");
      }
      if (f == kStepThrows) CHECK_EQ(steps.size(), static_cast<size_t>(k) + 1);
      engine.take_log();
      // The same engine then runs a call exactly.
      DeviceBuffers again(l, 4);
      braid::run_staged(engine, l, again.in.data(), again.out.data(), o, ByteStep{l, &engine, {}}, true);
      CHECK_MSG(again.out == again.expected, where + ": the call after the failure is wrong");
      engine.take_log();
    }
  }
}

// Without wait_copies_back the call returns once the last copy back is queued; a failure in one of
// those copies is reported by the lane afterwards, not lost.
BRAID_TEST(failed_copy_back_is_reported_by_the_lane) {
  ThreadCopyEngine engine;
  StagingOptions o;
  o.chunk_bytes = 16;
  o.slots = 2;
  const StagingLayout l = layout_of(4, 20, 1, 1, true);
  DeviceBuffers d(l, 8);
  engine.fail_copy(Lane::kToDevice, 4);  // the last chunk's copy back
  braid::run_staged(engine, l, d.in.data(), d.out.data(), o, ByteStep{l, &engine, {}}, false);
  bool failed = false;
  try {
    engine.synchronize(braid::staging_event(Lane::kToDevice, 0));
  } catch (const std::runtime_error&) {
    failed = true;
  }
  CHECK(failed);
  engine.drain();
}

BRAID_TEST(options_and_layouts) {
  StagingOptions o;
  o.validate();
  o.slots = 0;
  bool threw = false;
  try {
    o.validate();
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("BRAID_STAGING_SLOTS") != std::string::npos;
  }
  CHECK(threw);
  ::setenv("BRAID_STAGING_CHUNK_BYTES", "64K", 1);
  ::setenv("BRAID_STAGING_SLOTS", "5", 1);
  const StagingOptions e = StagingOptions::from_env();
  CHECK_EQ(e.chunk_bytes, size_t(64 * 1024));
  CHECK_EQ(e.slots, 5);
  ::setenv("BRAID_STAGING_SLOTS", "99999999999", 1);
  threw = false;
  try {
    StagingOptions::from_env().validate();
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  ::unsetenv("BRAID_STAGING_CHUNK_BYTES");
  ::unsetenv("BRAID_STAGING_SLOTS");

  braid::Request r;
  r.dtype = DType::kFloat64;
  r.count = 10;
  r.kind = CollKind::kAllGather;
  braid::StagingLayout g = braid::staging_layout(r, 1, 4);
  CHECK(g.in_parts == 1 && g.out_parts == 4 && g.out_stride == 10 && g.elem_size == 8 && !g.in_place);
  r.kind = CollKind::kReduceScatter;
  g = braid::staging_layout(r, 1, 4);
  CHECK(g.in_parts == 4 && g.out_parts == 1 && g.in_stride == 10);
  r.kind = CollKind::kBroadcast;
  r.root = 2;
  CHECK_EQ(braid::staging_layout(r, 1, 4).in_parts, 0);
  CHECK_EQ(braid::staging_layout(r, 2, 4).in_parts, 1);
  r.kind = CollKind::kSend;
  threw = false;
  try {
    braid::staging_layout(r, 1, 4);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

// Collectives of a real communicator on "device" buffers staged through the CPU engine, blocking
// and async, at 2 and 3 ranks: each equals the host collective's exact result (the references of
// collective_check), whatever the chunking.
BRAID_TEST(communicator_collectives_through_staging) {
  for (int world : {2, 3}) {
    GroupSpec g;
    g.world = world;
    g.tunables = tiny_tunables(braid::Algo::kAuto);
    run_group(g, [&](RankCtx& ctx) {
      auto engine = std::make_shared<ThreadCopyEngine>(static_cast<uint64_t>(ctx.rank) + 1, 10);
      StagingOptions o;
      o.chunk_bytes = 64;
      o.slots = 2;
      braid::StagedHooks hooks;
      hooks.after = [engine] { engine->finish(); };  // the copies back are done when the work is
      int call = 0;
      for (CollKind kind : {CollKind::kAllReduce, CollKind::kBroadcast, CollKind::kAllGather, CollKind::kReduceScatter,
                            CollKind::kAllToAll, CollKind::kBarrier}) {
        for (size_t count : {size_t(0), size_t(1), size_t(15), size_t(16), size_t(17), size_t(100)}) {
          for (bool in_place : {false, true}) {
            if (in_place && (kind == CollKind::kAllToAll || kind == CollKind::kBroadcast || kind == CollKind::kBarrier))
              continue;
            CallSpec s;
            s.kind = kind;
            s.dtype = call % 2 ? DType::kFloat32 : DType::kBFloat16;
            s.op = call % 3 == 0 ? braid::ReduceOp::kAvg : braid::ReduceOp::kSum;
            s.count = kind == CollKind::kBarrier ? 0 : count;
            s.root = call % world;
            s.in_place = in_place;
            s.call = call++;
            PreparedCall p(s, ctx.rank, world);
            const bool async = call % 2 == 0;
            auto w = braid::submit_staged(ctx.comm, engine, p.request(), o, hooks, nullptr, async);
            if (async) CHECK(w->wait());
            p.check();
          }
        }
      }
      check_no_races(engine->take_log(), "rank " + std::to_string(ctx.rank));
    });
  }
}

// A copy that fails on one rank midway through a staged all_reduce: that rank's work fails with
// the copy's error, its peers' with a communication error well before the timeout (the rank
// aborts the communicator instead of leaving them waiting), and nobody reports success.
BRAID_TEST(failed_copy_on_one_rank_fails_every_rank) {
  GroupSpec g;
  g.world = 3;
  g.timeout_s = 60;
  run_group(g, [&](RankCtx& ctx) {
    auto engine = std::make_shared<ThreadCopyEngine>();
    StagingOptions o;
    o.chunk_bytes = 64;
    o.slots = 2;
    if (ctx.rank == 1) engine->fail_copy(Lane::kToHost, 3);
    CallSpec s;
    s.count = 16 * 8;
    PreparedCall p(s, ctx.rank, ctx.world);
    const auto t0 = std::chrono::steady_clock::now();
    auto w = braid::submit_staged(ctx.comm, engine, p.request(), o, {}, nullptr, true);
    w->wait_done();
    CHECK(!w->succeeded());
    if (ctx.rank == 1) {
      CHECK_MSG(w->error_message().find("injected") != std::string::npos, w->error_message());
    }
    CHECK_MSG(seconds_since(t0) < 30, "the failure took " + std::to_string(seconds_since(t0)) + " s to reach rank " +
                                          std::to_string(ctx.rank));
    // The communicator is unusable afterwards on every rank.
    CallSpec next;
    next.count = 4;
    PreparedCall q(next, ctx.rank, ctx.world);
    bool refused = false;
    try {
      ctx.comm.submit(q.request(), false);
    } catch (const braid::CommError&) {
      refused = true;
    }
    CHECK(refused);
    engine->drain();
  });
}
