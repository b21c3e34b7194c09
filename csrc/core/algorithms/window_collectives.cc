// Collectives on registered buffers (ShmGroup's windows): when every rank's data lies in the same
// window, each rank reads what it needs straight from its peers' buffers: one copy (or one
// reduction pass) per byte instead of a copy into the slots and another out of them. Each starts
// with ShmGroup::arrive_windowed and returns false when the data is not in a window on every
// rank, after which the caller runs the slot algorithm (its arrival already made). Every rank
// finishes with a closing step, so that no rank changes its buffer while a peer still reads it.
// Reductions run in rank order over the same elements as the slot algorithms, so the results
// are bitwise theirs.
#include <algorithm>

#include "../reduce.h"
#include "algorithms.h"

namespace braid {

namespace {
void close(ShmGroup& g) { g.wait_all(g.post_next()); }
}  // namespace

bool window_all_gather(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const size_t bytes = d.count * dtype_size(static_cast<DType>(d.dtype));
  const char* data[kMaxLocalRanks];
  if (!g.arrive_windowed(d, in, bytes, data)) return false;
  const int n = g.world_size(), me = g.rank();
  const bool stream = g.streaming(bytes * n);
  char* dst = static_cast<char*>(out);
  for (int i = 0; i < n; ++i) {  // from the next rank on: the ranks read different peers at once
    const int j = (me + i) % n;
    if (dst + j * bytes != data[j]) copy_output(dst + j * bytes, data[j], bytes, stream);
  }
  close(g);
  return true;
}

bool window_broadcast(ShmGroup& g, const CollectiveDesc& d, void* buf) {
  const size_t bytes = d.count * dtype_size(static_cast<DType>(d.dtype));
  const char* data[kMaxLocalRanks];
  if (!g.arrive_windowed(d, buf, bytes, data)) return false;
  const int root = static_cast<int>(d.root);
  if (g.rank() != root) copy_output(buf, data[root], bytes, g.streaming(bytes));
  close(g);
  return true;
}

bool window_all_to_all(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const int n = g.world_size(), me = g.rank();
  const size_t bytes = d.count * dtype_size(static_cast<DType>(d.dtype));  // one chunk
  const char* data[kMaxLocalRanks];
  if (!g.arrive_windowed(d, in, bytes * n, data)) return false;
  const bool stream = g.streaming(bytes * n);
  char* dst = static_cast<char*>(out);
  for (int i = 0; i < n; ++i) {
    const int j = (me + i) % n;
    copy_output(dst + j * bytes, data[j] + me * bytes, bytes, stream);  // rank j's chunk for me
  }
  close(g);
  return true;
}

bool window_reduce_scatter(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const size_t es = dtype_size(dt);
  const int n = g.world_size(), me = g.rank();
  const size_t m = d.count;
  const char* data[kMaxLocalRanks];
  if (!g.arrive_windowed(d, in, m * es * n, data)) return false;
  Operand srcs[kMaxLocalRanks];
  for (int r = 0; r < n; ++r) srcs[r] = {data[r] + me * m * es, false};
  reduce_n(dt, static_cast<ReduceOp>(d.op), srcs, n, ReduceDst::result(out, n).streamed(g.streaming(m * es)), m);
  close(g);
  return true;
}

bool window_all_reduce(ShmGroup& g, const CollectiveDesc& d, const void* in, void* out) {
  const char* data[kMaxLocalRanks];
  // In place only: each rank writes its reduced part where the peers then read it.
  if (!g.arrive_windowed(d, in != out ? nullptr : in, d.count * dtype_size(static_cast<DType>(d.dtype)), data))
    return false;
  window_all_reduce_arrived(g, d, data, out);
  return true;
}

void window_all_reduce_arrived(ShmGroup& g, const CollectiveDesc& d, const char* const* data, void* out) {
  const auto dt = static_cast<DType>(d.dtype);
  const size_t es = dtype_size(dt);
  const int n = g.world_size(), me = g.rank();
  const size_t per = (d.count + n - 1) / n;
  auto begin = [&](int j) { return std::min(static_cast<size_t>(j) * per, d.count); };
  // Part me, over every rank's part me in rank order, into this rank's buffer (each peer reads
  // only its own part of this rank's input meanwhile).
  Operand srcs[kMaxLocalRanks];
  for (int r = 0; r < n; ++r) srcs[r] = {data[r] + begin(me) * es, false};
  char* dst = static_cast<char*>(out);
  reduce_n(dt, static_cast<ReduceOp>(d.op), srcs, n, ReduceDst::result(dst + begin(me) * es, n),
           begin(me + 1) - begin(me));
  g.wait_all(g.post_next());
  for (int i = 1; i < n; ++i) {  // every peer's reduced part
    const int j = (me + i) % n;
    copy_bytes(dst + begin(j) * es, data[j] + begin(j) * es, (begin(j + 1) - begin(j)) * es);
  }
  close(g);
}

}  // namespace braid
