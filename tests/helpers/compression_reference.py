"""Pure-torch references of braid's compression kernels, written from the format description
(csrc/core/compression/*.h), for bitwise comparison with the C++ kernels."""

from __future__ import annotations

from typing import Optional

import torch

M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform01(seed: int, index: torch.Tensor) -> torch.Tensor:
    """The counter-based uniform of element ``index`` (int64) under ``seed`` (counter_rng.h)."""
    k_lo = mix32(torch.tensor((seed & M32) ^ 0x9E3779B9))
    k_hi = mix32(torch.tensor(((seed >> 32) & M32) ^ 0x85EBCA6B))
    pair = index >> 1
    h = mix32((pair & M32) ^ (mix32((pair >> 32) ^ k_hi) ^ k_lo))
    bits = torch.where(index & 1 == 1, h >> 16, h & 0xFFFF)
    return bits.to(torch.float32) * (1.0 / 65536.0)


def quantize(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    bits: int,
    block: int,
    stochastic: bool,
    seed: int,
    chunk: int = 0,
    nchunks: int = 1,
    index_base: int = 0,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns (payload bytes, new residual) as braid's quantize lays them out."""
    qmax = 127.0 if bits == 8 else 7.0
    count = x.numel()
    xf = x.reshape(-1).to(torch.float32)
    if residual is not None:
        xf = xf + residual
    if chunk == 0:
        chunk = count
    padded = torch.zeros(nchunks * chunk, dtype=torch.float32)
    padded[:count] = xf
    q_all = torch.zeros(nchunks * chunk, dtype=torch.float32)
    deq_all = torch.zeros(nchunks * chunk, dtype=torch.float32)
    payloads = []
    for j in range(nchunks):
        xc = padded[j * chunk : (j + 1) * chunk]
        nblocks = -(-chunk // block)
        xb = torch.zeros(nblocks * block)
        xb[:chunk] = xc
        xb = xb.view(nblocks, block)
        amax = xb.abs().amax(dim=1, keepdim=True) if chunk else torch.zeros(0, 1)
        scale = amax / torch.full_like(amax, qmax)
        inv = torch.where(amax > 0, torch.full_like(amax, qmax) / amax, torch.zeros_like(amax))
        # A block too small for qmax / amax (it overflows) is sent as zeros.
        tiny = torch.isinf(inv)
        inv = torch.where(tiny, torch.zeros_like(inv), inv)
        scale = torch.where(tiny, torch.zeros_like(scale), scale)
        v = xb * inv
        if stochastic:
            first = index_base + j * chunk
            idx = torch.arange(first, first + nblocks * block, dtype=torch.int64).view(nblocks, block)
            q = torch.floor(v + uniform01(seed, idx))
        else:
            q = torch.round(v)
        q = q.clamp(-qmax, qmax)
        q = q.reshape(-1)[:chunk]
        valid = max(0, min(chunk, count - j * chunk))
        q[valid:] = 0
        q_all[j * chunk : (j + 1) * chunk] = q
        deq_all[j * chunk : (j + 1) * chunk] = q * scale.repeat_interleave(block)[:chunk]
        qi = q.to(torch.int64)
        if bits == 8:
            values = qi.to(torch.int8).view(torch.uint8)
        else:
            nib = qi + 8
            if chunk % 2:
                nib = torch.cat([nib, torch.tensor([8])])
            values = (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)
        pad = (-values.numel()) % 4
        payloads += [
            values,
            torch.zeros(pad, dtype=torch.uint8),
            scale.reshape(-1).contiguous().view(torch.uint8),
        ]
    payload = torch.cat(payloads) if payloads else torch.zeros(0, dtype=torch.uint8)
    new_res = None
    if residual is not None:
        new_res = xf - deq_all[:count]
        new_res = torch.where(torch.isfinite(new_res), new_res, torch.zeros_like(new_res))
    return payload, new_res


def dequantize(
    payload: torch.Tensor, count: int, bits: int, block: int, dtype: torch.dtype, chunk: int = 0
) -> torch.Tensor:
    """Decodes braid's chunked layout: q * scale rounded once to ``dtype``."""
    if chunk == 0:
        chunk = count
    out = torch.empty(count, dtype=dtype)
    value_bytes = chunk if bits == 8 else (chunk + 1) // 2
    scales_off = (value_bytes + 3) // 4 * 4
    nblocks = -(-chunk // block)
    cb = scales_off + 4 * nblocks
    for j in range(-(-count // chunk) if chunk else 0):
        part = payload[j * cb : (j + 1) * cb]
        if bits == 8:
            q = part[:chunk].view(torch.int8).to(torch.float32)
        else:
            b = part[:value_bytes].to(torch.int64)
            q = torch.stack([(b & 15) - 8, (b >> 4) - 8], dim=1).reshape(-1)[:chunk].to(torch.float32)
        scale = part[scales_off:cb].view(torch.float32).repeat_interleave(block)[:chunk]
        valid = min(chunk, count - j * chunk)
        out[j * chunk : j * chunk + valid] = (q * scale)[:valid].to(dtype)
    return out
