// The quantized all-reduce between hosts, pipelined: the same results as quantize +
// quantized_all_reduce + dequantize, bit for bit, with quantization, transfers and the owners'
// reduction overlapped piece by piece.
#pragma once

#include <cstddef>
#include <cstdint>

#include "direct.h"
#include "../compression/quantize.h"

namespace braid {

struct PipelinedQuantizeArgs {
  QuantFormat fmt;
  DType dtype = DType::kFloat32;  // of in and out
  const void* in = nullptr;       // count elements
  void* out = nullptr;            // count elements (may be in)
  size_t count = 0;
  size_t chunk = 0;               // elements of each member's part (a multiple of fmt.block)
  size_t piece = 0;               // elements of a piece (a multiple of fmt.block)
  float* residual = nullptr;      // count floats of error feedback, or null
  bool stochastic = true;
  uint64_t seed = 0;              // this member's quantization of its input
  uint64_t requant_seed = 0;      // this member's re-quantization of its part
  bool average = false;           // divide the sum by `divisor`
  int divisor = 1;
};

// Member m owns elements [m * chunk, (m + 1) * chunk) (zeros past count). Every member quantizes
// each piece of every part once (error feedback on the piece) and sends it to the part's owner;
// the owner decodes and sums the members' pieces in member order in float32, re-quantizes the
// sum once and sends it to every member; everyone decodes every part into `out`. Elements are
// numbered as in the one-call layout (piece starts at their global index), so the values and
// the random streams are those of quantize + quantized_all_reduce + dequantize.
void pipelined_quantized_all_reduce(const PeerGroup& g, const PipelinedQuantizeArgs& a);

}  // namespace braid
