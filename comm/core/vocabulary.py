"""The names braid's collectives speak on the Python side of the binding: reduce ops and their
codes (csrc/core/dtype.h's ReduceOp, read from the binding's ``_C.REDUCE_OPS``), with
torch.distributed's spellings, and the dtypes that travel as themselves (csrc/core/dtype.h's
DType, csrc/binding/binding_util.h's conversion).

The binding checks what it is given (an op code in range and allowed for the tensor's dtype, a
dtype it has); these tables turn the user's spelling into its codes, once."""
from __future__ import annotations

from typing import Union

import torch
import torch.distributed as dist

import braid.comm._C as _C  # the extension module itself (not the package)

# Codes of csrc/core/dtype.h (ReduceOp) by braid's names, in code order; the bitwise ones (band, bor,
# bxor) take integer tensors only.
REDUCE_OPS = dict(_C.REDUCE_OPS)
SUM, AVG = REDUCE_OPS["sum"], REDUCE_OPS["avg"]
# What a compressed all-reduce does with what arrives: sums it, or averages it.
COMPRESSED_OPS = ("sum", "avg")
# torch.distributed.ReduceOp's members for the same ops (its PRODUCT is braid's "prod").
_DIST_OPS = {getattr(dist.ReduceOp, "PRODUCT" if name == "prod" else name.upper()): code
             for name, code in REDUCE_OPS.items()}

Op = Union[str, "dist.ReduceOp", "dist.ReduceOp.RedOpType"]

# dtypes braid's collectives take as they are; anything else (bool, int8, complex, ...) travels as
# its bytes where only copying is asked (all-gather, broadcast).
WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
               torch.uint8)


def op_code(op: Op) -> int:
    """The code of ``op``: one of REDUCE_OPS' names (any case) or the matching
    ``torch.distributed.ReduceOp`` (a RedOpType, or a ReduceOp as torch's Backend API passes);
    a ValueError naming ``op`` for anything else."""
    if isinstance(op, str):
        code = REDUCE_OPS.get(op)  # the common spelling first: this runs on every call
        if code is None:
            code = REDUCE_OPS.get(op.lower())
    elif isinstance(op, dist.ReduceOp.RedOpType):
        code = _DIST_OPS.get(op)
    elif isinstance(op, dist.ReduceOp):
        code = _DIST_OPS.get(op.op)
    else:
        code = None
    if code is None:
        raise ValueError(f"op must be one of {', '.join(repr(k) for k in REDUCE_OPS)} or the matching "
                         f"torch.distributed.ReduceOp, got {op!r}")
    return code


def compressed_op_code(op: Op) -> int:
    """The code of ``op`` (any spelling op_code takes) for a compressed all-reduce: SUM or AVG; a
    ValueError naming ``op`` for any other."""
    try:
        code = op_code(op)
    except ValueError:
        code = None
    if code not in (SUM, AVG):
        raise ValueError(f"compressed all_reduce supports op {' or '.join(map(repr, COMPRESSED_OPS))}, "
                         f"got {op!r}")
    return code
