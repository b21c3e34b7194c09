// The middle of a quantized all-reduce: all-to-all of quantized chunks, float32 accumulation in
// rank order, one re-quantization, all-gather. Quantizing the input and dequantizing the result
// stay with the caller, so that a DDP hook can do both on its own thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "../communicator.h"
#include "../compression/quantize.h"
#include "quantized_direct.h"

namespace braid {

struct QuantizedAllReduceArgs {
  QuantFormat fmt;
  size_t chunk = 0;         // elements per rank's chunk (a multiple of fmt.block)
  bool average = false;     // divide the sum by `divisor` (0: the ranks of `scope`) before re-quantizing
  int divisor = 0;
  Scope scope = Scope::kAll;  // the ranks the chunks travel between
  bool stochastic = true;   // rounding of the re-quantization
  uint64_t seed = 0;        // its random stream (elements numbered from rank * chunk)
  uint32_t tag = 0;         // Request::tag of both collectives (ranks must agree on it)
  const uint8_t* send = nullptr;  // one chunk of fmt.bytes(chunk) per rank of the scope, chunk j for rank j
  uint8_t* recv = nullptr;        // world_size chunks: scratch for what the peers sent
  float* acc = nullptr;           // `chunk` floats: scratch for the sum
  uint8_t* gathered = nullptr;    // world_size chunks out: the reduced, re-quantized chunk j of rank j
};

// Runs on the communicator's executing thread as one unit (Communicator::submit_task). Every
// rank decodes the same gathered bytes, so results are bitwise identical everywhere.
void quantized_all_reduce(Communicator& c, const QuantizedAllReduceArgs& a);

// Across hosts, a compressed all-reduce is exact on each host and compressed only between hosts
// (ZeRO++ qgZ's idea): the tensor is reduce-scattered on the host (local rank i keeps the host's
// sum of slice i), `between_hosts` compresses slice i once (error feedback on the slice) and
// all-reduces it with the ranks of local index i on the other hosts (Scope::kCross), leaving the
// result in the slice, and the host all-gathers the slices back into the tensor.
struct HostSlice {
  DType dtype = DType::kFloat32;
  void* data = nullptr;    // the tensor, in place
  size_t numel = 0;
  size_t slice = 0;        // elements per local rank: numel / local ranks, rounded up
  void* padded = nullptr;  // local ranks * slice elements of dtype (used when numel does not divide)
  void* mine = nullptr;    // slice elements of dtype
};
void host_compressed_all_reduce(Communicator& c, const HostSlice& s, const std::function<void()>& between_hosts);

// The quantized all-reduce between hosts (of a slice among the counterparts, the quantizers'
// `between_hosts`; or of the tensor when every host has one rank): quantize once, the quantized
// all-reduce, dequantize, as pipelined_quantized_all_reduce in pieces of BRAID_CROSS_PIECE_BYTES
// (the bits of quantize + quantized_all_reduce + dequantize). `a.piece` is filled in here.
void quantized_between_hosts(Communicator& c, Scope scope, uint32_t tag, const PipelinedQuantizeArgs& a);
// Elements of a piece of a quantized all-reduce between hosts: BRAID_CROSS_PIECE_BYTES of
// float32, whole blocks.
size_t quantized_piece(const Communicator& c, const QuantFormat& fmt);

}  // namespace braid
