"""Compressed dispatch: :class:`RowQuantizer`, the int8 / fp8 row codec whose one byte per element and
float32 scale per row the dispatched activations travel as."""
from __future__ import annotations

from typing import Any, Optional

import torch
from .checks import COMPRESSIONS


def codec_of(compression: Any, where: str) -> Optional["RowQuantizer"]:
    if compression is None or isinstance(compression, RowQuantizer):
        return compression
    if compression not in COMPRESSIONS:
        raise ValueError(f"{where}: compression must be None, {', '.join(map(repr, COMPRESSIONS))} or a "
                         f"RowQuantizer, got {compression!r}")
    return RowQuantizer(compression)


# -- compressed dispatch ---------------------------------------------------------------------------

class RowQuantizer:
    """Per-row (per-token) scaled quantization of the activations a dispatch sends.

    A row of ``d`` values travels as ``d`` one-byte codes and one float32 scale, its largest
    magnitude over the format's largest value: ``"int8"`` rounds ``x / scale`` to the nearest
    integer in [-127, 127] (error at most ``scale / 2`` per element, ``absmax / 254``); ``"fp8"``
    rounds it to float8 e4m3 (as DeepEP sends), 3 mantissa bits (a relative error of at most 2^-4 per
    element above ``scale * 2^-6``, at most ``scale * 2^-10`` below). Arithmetic runs in float32,
    or float64 for float64 rows; decoding returns the rows' dtype."""

    def __init__(self, fmt: str = "int8"):
        if fmt == "int8":
            self.storage, self.qmax = torch.int8, 127.0
        elif fmt == "fp8":
            if not hasattr(torch, "float8_e4m3fn"):
                raise ValueError("compression='fp8' needs a torch with float8 dtypes (torch.float8_e4m3fn)")
            self.storage, self.qmax = torch.float8_e4m3fn, 448.0
        else:
            raise ValueError(f"fmt must be 'int8' or 'fp8', got {fmt!r}")
        self.fmt = fmt

    def row_bytes(self, d: int) -> int:
        """Bytes of one encoded row of ``d`` values."""
        return d + 4

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(R, d) floating rows -> (R, d + 4) uint8: the codes, then the scale's bytes."""
        work = torch.promote_types(x.dtype, torch.float32)
        xw = x.to(work)
        if x.shape[0]:
            scale = (xw.abs().amax(1) / self.qmax).to(torch.float32)
        else:
            scale = xw.new_zeros(0, dtype=torch.float32)
        s = scale.to(work)
        q = xw / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1)
        if self.storage is torch.int8:
            q = q.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)
        else:
            q = q.clamp_(-self.qmax, self.qmax).to(self.storage)
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8).view(-1, 4)], 1)

    def decode(self, payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(R, d + 4) uint8 from :meth:`encode` -> (R, d) rows of ``dtype``."""
        d = payload.shape[1] - 4
        work = torch.promote_types(dtype, torch.float32)
        codes = payload[:, :d].contiguous().view(self.storage).to(work)
        scale = payload[:, d:].clone(memory_format=torch.contiguous_format).view(torch.float32).to(work)
        return (codes * scale).to(dtype)

    def __repr__(self) -> str:
        return f"RowQuantizer({self.fmt!r})"
