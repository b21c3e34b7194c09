// The middle of a quantized all-reduce: all-to-all of quantized chunks, float32 accumulation in
// rank order, one re-quantization, all-gather. Quantizing the input and dequantizing the result
// stay with the caller, so that a DDP hook can do both on its own thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../communicator.h"
#include "quantize.h"

namespace braid {

struct QuantizedAllReduceArgs {
  QuantFormat fmt;
  size_t chunk = 0;         // elements per rank's chunk (a multiple of fmt.block)
  bool average = false;     // divide the sum by the world size before re-quantizing
  bool stochastic = true;   // rounding of the re-quantization
  uint64_t seed = 0;        // its random stream (elements numbered from rank * chunk)
  uint32_t tag = 0;         // Request::tag of both collectives (ranks must agree on it)
  const uint8_t* send = nullptr;  // world_size chunks of fmt.bytes(chunk), chunk j for rank j
  uint8_t* recv = nullptr;        // world_size chunks: scratch for what the peers sent
  float* acc = nullptr;           // `chunk` floats: scratch for the sum
  uint8_t* gathered = nullptr;    // world_size chunks out: the reduced, re-quantized chunk j of rank j
};

// Runs on the communicator's executing thread as one unit (Communicator::submit_task). Every
// rank decodes the same gathered bytes, so results are bitwise identical everywhere.
void quantized_all_reduce(Communicator& c, const QuantizedAllReduceArgs& a);

}  // namespace braid
