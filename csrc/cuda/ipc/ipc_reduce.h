// The element-wise reduction of the CUDA IPC collectives: one kernel reading up to kMaxIpcRanks
// buffers (this rank's and its peers' device memory) and writing one. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../../core/dtype.h"

namespace braid {
namespace cuda {

// Most ranks of one host an IPC reduction reads at once: the source pointers travel by value in
// the kernel's parameters (16 pointers, 128 bytes), so a call allocates nothing on the device.
constexpr int kMaxIpcRanks = 16;

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrcs - 1][i] for i < count, combined in this
// order, with exactly reduce_n's results (csrc/core/reduce.h): half types accumulate in float32
// and round once (NaN as reduce_n writes it: 0x7E00, 0x7FC0), integers wrap, avg divides the sum
// by `divisor` in the accumulator type (divisor <= 1: no division, as reduce_n's partial results;
// other ops ignore it). dst may alias srcs[0] (each element is read before it is written); it may
// not overlap any source otherwise. Queued on `stream`, the current device's. cudaErrorInvalidValue
// for nsrcs outside 1..kMaxIpcRanks, a null pointer with count > 0, or a bitwise op on a floating
// type (reduce_n refuses it too); otherwise the launch's error.
cudaError_t launch_ipc_reduce(void* dst, const void* const* srcs, int nsrcs, size_t count, DType dtype, ReduceOp op,
                              int divisor, cudaStream_t stream);

}  // namespace cuda
}  // namespace braid
