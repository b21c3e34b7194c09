"""Gradient compression: compressors (int8 / int4 / fp8 block quantization, top-k, 16-bit casts,
each with error feedback) in compressors.py, and adaptive control (the choice per bucket from
measured links) in adaptive/. A compressor runs over any group: braid's communicator (its fused
one-call paths where it has them), a torch ProcessGroup, or hosts split by HostGroups.

    from braid import comm
    c.all_reduce(t, op="avg", compression=comm.Int8Quantizer())
    comm.Int8Quantizer().all_reduce(process_group, t)
"""
from ..core.wire import WireStats
from .adaptive import Adaptive
from .compressors import (FLOAT_DTYPES, MAX_QUANT_BLOCK, check_tensor, copy_back, CompressedWork, Compressor,
                          BlockQuantizer, Int8Quantizer, Int4Quantizer, FP8Quantizer, TopK, Cast,
                          COMPRESSOR_NAMES, compressor)

__all__ = ['Adaptive', 'WireStats', 'FLOAT_DTYPES', 'MAX_QUANT_BLOCK', 'check_tensor', 'copy_back',
           'CompressedWork', 'Compressor', 'BlockQuantizer', 'Int8Quantizer', 'Int4Quantizer', 'FP8Quantizer',
           'TopK', 'Cast', 'COMPRESSOR_NAMES', 'compressor']
