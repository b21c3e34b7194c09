"""The compression kernels of a tensor's device: braid's C++ kernels for CPU tensors, its CUDA
kernels (launched on torch's current stream) for CUDA tensors, behind one set of calls.

Both sides use the same formats, random streams and rounding, so a compressed all-reduce gives
the same bits whichever device quantizes, and one code path serves both.
"""

from __future__ import annotations

from typing import Optional

import torch

import braid.comm._C as _C  # the extension module itself (not the package)
from .build_info import is_cuda_build


class CpuKernels:
    """braid's CPU kernels (csrc/core/compression)."""

    device_type = "cpu"

    @staticmethod
    def quantize(x: torch.Tensor, residual: Optional[torch.Tensor], bits: int, block: int, stochastic: bool,
                 seed: int, index_base: int, chunk: int, nchunks: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``nchunks`` chunks of ``chunk`` elements of ``x`` (+ ``residual``, which keeps what the
        rounding dropped), quantized into ``out`` (or a new uint8 tensor), which is returned."""
        return _C.quantize(x, residual, bits, block, stochastic, seed, index_base, chunk, nchunks, out=out)

    dequantize = staticmethod(_C.dequantize)
    dequantize_accumulate = staticmethod(_C.dequantize_accumulate)
    scatter_add = staticmethod(_C.scatter_add)
    error_feedback = staticmethod(_C.error_feedback)
    cast = staticmethod(_C.cast)

    @staticmethod
    def top_k(x: torch.Tensor, k: int) -> tuple:
        """(float32 values, int32 indices) of the ``k`` largest magnitudes, indices ascending."""
        return _C.top_k(x, k)[:2]


class CudaKernels:
    """braid's CUDA kernels (csrc/cuda/compression) on torch's current stream; the cast, which has
    no kernel of its own, in torch operations that round as the CPU kernel does."""

    device_type = "cuda"

    @staticmethod
    def quantize(x, residual, bits, block, stochastic, seed, index_base, chunk, nchunks, out=None):
        q = _C.cuda_quantize(x, residual, bits, block, stochastic, seed, index_base, chunk, nchunks)
        if out is None:
            return q
        out.copy_(q)
        return out

    @staticmethod
    def dequantize(payload, bits, block, output, chunk=0):
        _C.cuda_dequantize(payload, bits, block, output, chunk)

    @staticmethod
    def dequantize_accumulate(payload, bits, block, accumulator):
        _C.cuda_dequantize_accumulate(payload, bits, block, accumulator)

    @staticmethod
    def scatter_add(accumulator, indices, values):
        _C.cuda_scatter_add(accumulator, indices, values)

    @staticmethod
    def error_feedback(x, residual, sent):
        _C.cuda_error_feedback(x, residual, sent)

    @staticmethod
    def top_k(x, k):
        return _C.cuda_top_k(x, k)[:2]

    @staticmethod
    def cast(x: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor) -> None:
        """out = x + residual rounded to nearest even; residual = what the rounding dropped (0
        where that is not finite), as csrc/core/compression/error_feedback.h's cast_with_feedback."""
        v = x.float() if residual is None else x.float() + residual
        out.copy_(v)
        if residual is not None:
            residual.copy_(torch.nan_to_num(v - out.float(), nan=0.0, posinf=0.0, neginf=0.0))


def kernels_for(device: torch.device, arg: str = "tensor"):
    """The kernels for tensors on ``device``; a ValueError naming ``arg`` for a device braid has no
    kernels for (a CUDA tensor with a build without CUDA, any other device type)."""
    if device.type == "cpu":
        return CpuKernels
    if device.type == "cuda":
        if not is_cuda_build():
            raise ValueError(f"{arg} is on {device}, but this braid build has no CUDA kernels (it was "
                             "built where torch had no CUDA or nvcc was not found): reinstall braid on a "
                             "machine with both, or move the tensor to the CPU")
        return CudaKernels
    raise ValueError(f"{arg} must be a CPU or CUDA tensor to be compressed, got a tensor on {device}")
