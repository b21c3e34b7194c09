"""Gradient compression: compressors (int8 / int4 / fp8 block quantization, top-k, 16-bit casts,
each a format with its error feedback) in compressors.py, the one driver of their all-reduce
(its algorithm chosen in one function) in driver.py, and adaptive control (the choice per bucket from
measured links) in adaptive/. A compressor runs over any group: braid's communicator (its fused
one-call paths where it has them), a torch ProcessGroup, or hosts split by HostGroups.

    from braid import comm
    c.all_reduce(t, op="avg", compression=comm.Int8Quantizer())
    comm.Int8Quantizer().all_reduce(process_group, t)
"""
from ..core.wire import WireStats
from .adaptive import Adaptive
from .compressors import (MAX_QUANT_BLOCK, Compressor, BlockQuantizer, Int8Quantizer, Int4Quantizer,
                          FP8Quantizer, TopK, Cast, COMPRESSOR_NAMES, compressor)
from .driver import FLOAT_DTYPES, CompressedWork, check_tensor, copy_back

__all__ = ['Adaptive', 'WireStats', 'FLOAT_DTYPES', 'MAX_QUANT_BLOCK', 'check_tensor', 'copy_back',
           'CompressedWork', 'Compressor', 'BlockQuantizer', 'Int8Quantizer', 'Int4Quantizer', 'FP8Quantizer',
           'TopK', 'Cast', 'COMPRESSOR_NAMES', 'compressor']
