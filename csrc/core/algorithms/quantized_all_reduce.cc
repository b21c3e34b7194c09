// Quantized all-reduce: reduce-scatter by all-to-all (each chunk is decoded and summed once, in
// rank order), re-quantize once, all-gather. Nothing is re-quantized per hop, so the error is
// that of two quantizations whatever the world size.
#include "quantized_all_reduce.h"

#include <algorithm>
#include <cstring>

#include "quantized_direct.h"

namespace braid {

void quantized_all_reduce(Communicator& c, const QuantizedAllReduceArgs& a) {
  const size_t n = static_cast<size_t>(c.scope_size(a.scope)), me = static_cast<size_t>(c.scope_rank(a.scope));
  const size_t cb = a.fmt.bytes(a.chunk);

  Request scatter;
  scatter.kind = CollKind::kAllToAll;
  scatter.dtype = DType::kUInt8;
  scatter.count = cb;
  scatter.in = a.send;
  scatter.out = a.recv;
  scatter.tag = a.tag;
  scatter.scope = a.scope;
  c.run_collective(scatter);

  std::fill(a.acc, a.acc + a.chunk, 0.0f);
  for (size_t r = 0; r < n; ++r) dequantize_accumulate(a.fmt, a.recv + r * cb, a.chunk, a.acc);
  const size_t divisor = a.divisor > 0 ? static_cast<size_t>(a.divisor) : n;
  if (a.average && divisor > 1) {
    const float d = static_cast<float>(divisor);
    for (size_t i = 0; i < a.chunk; ++i) a.acc[i] /= d;
  }
  uint8_t* mine = a.gathered + me * cb;
  quantize(a.fmt, DType::kFloat32, a.acc, nullptr, a.chunk, a.chunk, 1, a.stochastic, a.seed, me * a.chunk, mine);

  Request gather;
  gather.kind = CollKind::kAllGather;
  gather.dtype = DType::kUInt8;
  gather.count = cb;
  gather.in = mine;
  gather.out = a.gathered;
  gather.tag = a.tag;
  gather.scope = a.scope;
  c.run_collective(gather);
}

void host_compressed_all_reduce(Communicator& c, const HostSlice& s, const std::function<void()>& between_hosts) {
  const size_t local = static_cast<size_t>(c.scope_size(Scope::kHost));
  const size_t es = dtype_size(s.dtype);
  char* whole = static_cast<char*>(s.data);
  if (s.slice * local != s.numel) {  // padded: the tail never meets another element
    whole = static_cast<char*>(s.padded);
    std::memcpy(whole, s.data, s.numel * es);
    std::memset(whole + s.numel * es, 0, (s.slice * local - s.numel) * es);
  }
  Request scatter;
  scatter.kind = CollKind::kReduceScatter;
  scatter.dtype = s.dtype;
  scatter.op = ReduceOp::kSum;
  scatter.count = s.slice;
  scatter.scope = Scope::kHost;
  scatter.in = whole;
  scatter.out = s.mine;
  c.run_collective(scatter);
  between_hosts();
  Request gather;
  gather.kind = CollKind::kAllGather;
  gather.dtype = s.dtype;
  gather.count = s.slice;
  gather.scope = Scope::kHost;
  gather.in = s.mine;
  gather.out = whole;
  c.run_collective(gather);
  if (whole != s.data) std::memcpy(s.data, whole, s.numel * es);
}

size_t quantized_piece(const Communicator& c, const QuantFormat& fmt) {
  const size_t elems = c.tunables().cross_piece_bytes / sizeof(float);
  return std::max(fmt.block, elems / fmt.block * fmt.block);
}

void quantized_between_hosts(Communicator& c, Scope scope, uint32_t tag, const PipelinedQuantizeArgs& a) {
  PipelinedQuantizeArgs p = a;
  p.piece = quantized_piece(c, p.fmt);
  c.run_between_hosts(scope, CollKind::kAllReduce, p.count, tag,
                      [&](const PeerGroup& g) { pipelined_quantized_all_reduce(g, p); });
}

}  // namespace braid
