"""The names braid's collectives speak on the Python side of the binding: the dtypes that travel
as themselves (csrc/core/dtype.h's DType, csrc/binding/binding_util.h's conversion)."""
from __future__ import annotations

import torch

# dtypes braid's collectives take as they are; anything else (bool, int8, complex, ...) travels as
# its bytes where only copying is asked (all-gather, broadcast).
WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
               torch.uint8)
