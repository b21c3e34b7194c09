// The top-k and cast compressors' step between hosts, for host_compressed_all_reduce: the
// slice (the host's sum of this rank's part) compressed once and all-reduced with the ranks of
// the same local index on the other hosts. The quantizers' is quantized_between_hosts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../communicator.h"
#include "quantized_all_reduce.h"

namespace braid {

struct SliceTopKArgs {
  size_t k = 0;             // elements each rank sends (at most the slice)
  bool sparse = true;       // (values, indices) all-gather; false: a dense all-reduce of the slice
  bool average = false;     // divide the sum by `divisor` (the number of all ranks)
  int divisor = 1;
  uint32_t tag = 0;         // the all-gather's Request::tag
  float* residual = nullptr;  // slice floats, or null without error feedback
  float* values = nullptr;    // k floats of scratch
  int32_t* indices = nullptr; // k ints of scratch
  uint8_t* send = nullptr;    // 8 k bytes: values then indices
  uint8_t* gathered = nullptr;  // hosts * 8 k bytes
  float* acc = nullptr;       // slice floats of scratch
};
// Top-k of slice (+ residual), all-gathered between hosts and summed in host order in float32.
void top_k_between_hosts(Communicator& c, const HostSlice& s, const SliceTopKArgs& a);

struct SliceCastArgs {
  DType wire = DType::kBFloat16;  // bfloat16 or float16
  bool average = false;
  int divisor = 1;
  float* residual = nullptr;  // slice floats, or null without error feedback
  void* sent = nullptr;       // slice elements of `wire`
  float* acc = nullptr;       // slice floats of scratch
};
// The slice (+ residual) rounded to `wire` once, all-reduced between hosts in `wire`.
void cast_between_hosts(Communicator& c, const HostSlice& s, const SliceCastArgs& a);

}  // namespace braid
