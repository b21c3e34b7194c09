// Top-k and cast between hosts: the compressed middle of host_compressed_all_reduce.
#include "between_hosts.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../reduce.h"
#include "../compression/error_feedback.h"
#include "../compression/top_k.h"

namespace braid {

namespace {
// float32 `acc` into `out` of dtype (divided by `divisor` when averaging).
void store_slice(DType dtype, const float* acc, void* out, size_t n, bool average, int divisor) {
  const Operand src{acc, true};
  reduce_n(dtype, average ? ReduceOp::kAvg : ReduceOp::kSum, &src, 1, ReduceDst::result(out, divisor), n);
}

// In place, among this rank's counterparts on the other hosts; avg divides by `divisor`.
void all_reduce_between_hosts(Communicator& c, DType dtype, void* data, size_t n, bool average, int divisor) {
  Request r = make_request(CollKind::kAllReduce, dtype, n, data, data);
  r.op = average ? ReduceOp::kAvg : ReduceOp::kSum;
  r.scope = Scope::kCross;
  r.divisor = divisor;
  c.run_collective(r);
}

// `in` of dtype into float32 `out`.
void load_slice(DType dtype, const void* in, float* out, size_t n) {
  const Operand src{in, false};
  if (dtype == DType::kFloat32)
    std::memcpy(out, in, n * sizeof(float));
  else
    reduce_n(dtype, ReduceOp::kSum, &src, 1, ReduceDst::partial(out), n);
}
}  // namespace

void top_k_between_hosts(Communicator& c, const HostSlice& s, const SliceTopKArgs& a) {
  const size_t hosts = static_cast<size_t>(c.scope_size(Scope::kCross)), per = s.slice, k = a.k;
  const void* src = s.mine;
  DType src_dtype = s.dtype;
  if (a.residual != nullptr) {  // residual = slice + residual: what this rank owes the sum
    error_feedback_update(s.dtype, s.mine, a.residual, nullptr, per);
    src = a.residual;
    src_dtype = DType::kFloat32;
  }
  if (!a.sparse) {  // the dense all-reduce is smaller than k values and indices per host
    load_slice(src_dtype, src, a.acc, per);
    if (a.residual != nullptr) std::fill(a.residual, a.residual + per, 0.0f);  // everything is sent
    all_reduce_between_hosts(c, DType::kFloat32, a.acc, per, a.average, a.divisor);
    store_slice(s.dtype, a.acc, s.mine, per, false, 1);
    return;
  }
  top_k_select(src_dtype, src, per, k, a.values, a.indices);
  if (a.residual != nullptr) {
    // The sent entries leave the residual (x - x = 0); a non-finite value sent leaves NaN there,
    // so then every non-finite entry is reset to 0, as the other compressors do.
    bool finite = true;
    for (size_t i = 0; i < k; ++i) {
      a.acc[i] = -a.values[i];
      finite = finite && std::isfinite(a.values[i]);
    }
    scatter_add(a.residual, a.indices, a.acc, k);
    if (!finite)
      for (size_t i = 0; i < per; ++i) a.residual[i] = finite_or_zero(a.residual[i]);
  }
  std::memcpy(a.send, a.values, 4 * k);
  std::memcpy(a.send + 4 * k, a.indices, 4 * k);
  Request gather;
  gather.kind = CollKind::kAllGather;
  gather.dtype = DType::kUInt8;
  gather.count = 8 * k;
  gather.scope = Scope::kCross;
  gather.tag = a.tag;
  gather.in = a.send;
  gather.out = a.gathered;
  c.run_collective(gather);
  std::fill(a.acc, a.acc + per, 0.0f);
  for (size_t h = 0; h < hosts; ++h) {  // host order: every rank sums the same pairs in the same order
    const uint8_t* part = a.gathered + h * 8 * k;
    const auto* idx = reinterpret_cast<const int32_t*>(part + 4 * k);
    for (size_t i = 0; i < k; ++i)  // indices come off the wire: checked, not trusted
      if (idx[i] < 0 || static_cast<size_t>(idx[i]) >= per)
        throw CommError(ErrorKind::kGeneric, "top-k indices from host " + std::to_string(h) + " out of range [0, " +
                                                 std::to_string(per) + "): " + std::to_string(idx[i]));
    scatter_add(a.acc, idx, reinterpret_cast<const float*>(part), k);
  }
  store_slice(s.dtype, a.acc, s.mine, per, a.average, a.divisor);
}

void cast_between_hosts(Communicator& c, const HostSlice& s, const SliceCastArgs& a) {
  const size_t per = s.slice;
  cast_with_feedback(s.dtype, s.mine, a.residual, a.wire, a.sent, per);
  all_reduce_between_hosts(c, a.wire, a.sent, per, a.average, a.divisor);
  if (s.dtype == a.wire) {
    std::memcpy(s.mine, a.sent, per * dtype_size(a.wire));
    return;
  }
  load_slice(a.wire, a.sent, a.acc, per);
  store_slice(s.dtype, a.acc, s.mine, per, false, 1);
}

}  // namespace braid
