// Quantized all-reduce: reduce-scatter by all-to-all (each chunk is decoded and summed once, in
// rank order), re-quantize once, all-gather. Nothing is re-quantized per hop, so the error is
// that of two quantizations whatever the world size.
#include "quantized_all_reduce.h"

#include <algorithm>

namespace braid {

void quantized_all_reduce(Communicator& c, const QuantizedAllReduceArgs& a) {
  const size_t n = static_cast<size_t>(c.world_size()), me = static_cast<size_t>(c.rank());
  const size_t cb = a.fmt.bytes(a.chunk);

  Request scatter;
  scatter.kind = CollKind::kAllToAll;
  scatter.dtype = DType::kUInt8;
  scatter.count = cb;
  scatter.in = a.send;
  scatter.out = a.recv;
  scatter.tag = a.tag;
  c.run_collective(scatter);

  std::fill(a.acc, a.acc + a.chunk, 0.0f);
  for (size_t r = 0; r < n; ++r) dequantize_accumulate(a.fmt, a.recv + r * cb, a.chunk, a.acc);
  if (a.average && n > 1) {
    const float d = static_cast<float>(n);
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
  c.run_collective(gather);
}

}  // namespace braid
