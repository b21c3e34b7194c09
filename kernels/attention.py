"""Fused attention: flash_attention and a drop-in scaled_dot_product_attention over Triton kernels.

Layout is torch's, (batch, heads, seq, head_dim), with any strides. What runs in the kernels:

- CUDA tensors (compute capability 8.0 or newer) of float16, bfloat16 or float32; CPU tensors
  only when ``TRITON_INTERPRET=1`` is set (Triton's interpreter; float16 and float32 only, since
  the interpreter computes bfloat16 dot products wrongly).
- Head dims 16 to 256, the same for q, k and v (padded to a power of two inside the kernels).
- Any lengths Sq, Sk >= 1; causal masks aligned top-left as in torch (row i sees keys 0..i), so
  with Sq > Sk every row still sees key 0 and no row is empty.
- GQA/MQA: k and v may have fewer heads than q, a divisor of q's; query head h reads kv head
  h // (Hq / Hkv), and dK/dV are summed over the query heads of each group.

float32 runs in the kernels too; its dot products follow torch's switch for its own CUDA float32
matmuls: full float32 by default, TF32 when ``torch.backends.cuda.matmul.allow_tf32`` is True.

Everything else (an attn_mask tensor, dropout, other dtypes or head dims, CPU tensors without
the interpreter, shapes the kernels do not take) goes to torch, logged once per reason at debug
level on the ``braid.kernels.attention`` logger.

On a GPU the kernels are autotuned (tile sizes, warps, pipeline stages) per head dim, causal flag
and power-of-two length bucket at their first call; ``BRAID_ATTENTION_TMA=1`` makes the kernels
stream their tiles through tensor descriptors (TMA, sm_90 and newer, half types, 16-byte aligned
strides; other inputs keep the pointer path). The forward and both gradient kernels write every
output element from one program without atomics, so results are bitwise reproducible.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MIN_HEAD_DIM = 16  # tl.dot needs K >= 16
MAX_HEAD_DIM = 256  # a 256-wide tile of q and the float32 accumulator still fit one program
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRETER_DTYPES = (torch.float16, torch.float32)
# The kernels launch (query or key tiles, batch x heads): tiles on the fast x axis, so that the
# programs running together share one (batch, head) and its K and V in L2. A 1-D grid would lift
# the y limit, but its index arithmetic cost the forward 250 bytes of register spills per thread
# at its 128 x 64 tiles (ptxas, sm_90, d = 128).
_MAX_GRID_Y = 65535
_logged_reasons: set[str] = set()


def _log_fallback(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.debug("braid attention falls back to torch: %s", reason)


@functools.lru_cache(maxsize=None)
def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _interpreting() -> bool:
    from .attention_configs import interpreting  # imports triton: only reached when it exists
    return interpreting()


def _kernel_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> Optional[str]:
    """Why the kernels cannot take these inputs, or None when they can. Shapes that torch rejects
    land here too, so that torch raises its own error for them."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "an input is not a tensor"
    if any(t.is_nested for t in tensors):
        return "nested tensors"
    if any(t.dim() != 4 for t in tensors):
        return "inputs that are not 4-D (batch, heads, seq, head_dim)"
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        return "inputs of different dtypes or devices"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        return "batch sizes that differ (broadcast) or k, v of different shapes"
    if q.shape[-1] != k.shape[-1] or q.shape[-1] != v.shape[-1]:
        return "head dims that differ between q, k and v"
    if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} outside {MIN_HEAD_DIM}..{MAX_HEAD_DIM}"
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads and not (enable_gqa and kv_heads > 0 and heads % kv_heads == 0):
        return "head counts that differ without enable_gqa, or do not divide"
    if min(q.shape[0], heads, kv_heads, q.shape[2], k.shape[2]) == 0:
        return "empty inputs"
    if max(q.shape[2], k.shape[2]) * q.shape[3] >= 2**31:
        return "a (batch, head) slice of 2**31 elements or more (the kernels' offsets are 32-bit)"
    if q.shape[0] * heads > _MAX_GRID_Y:
        return f"batch x heads above {_MAX_GRID_Y} (the y axis of the kernels' launch grid)"
    if not _triton_usable():
        return "triton is not installed"
    if q.device.type == "cuda":
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if _capability(index) < (8, 0):
            return "a GPU older than compute capability 8.0"
        if q.dtype not in _KERNEL_DTYPES:
            return f"dtype {q.dtype} on the GPU"
        return None
    if q.device.type == "cpu" and _interpreting():
        if q.dtype not in _INTERPRETER_DTYPES:
            return f"dtype {q.dtype} in the Triton interpreter"
        return None
    return f"{q.device.type} tensors (CPU needs TRITON_INTERPRET=1 to run the kernels)"


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What autocast does to SDPA's inputs (it is on autocast's lower-precision list on CUDA and
    CPU): floating tensors other than float64 are cast to the autocast dtype."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def dot_precision(q: torch.Tensor) -> str:
    """The precision of the Triton kernels' float32 dot products for ``q``: "tf32" where torch
    allows TF32 matmuls on CUDA, else "ieee"."""
    if q.dtype == torch.float32 and q.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"  # float32 in full precision; ignored for the half types


class _FlashAttention(torch.autograd.Function):
    """(o, lse) = attention(q, k, v) with the Triton kernels, differentiable in both outputs."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        from .attention_forward import LN2, attention_forward

        # Gradients of unused outputs arrive as None instead of zero tensors: an unused LSE then
        # costs nothing in the backward.
        ctx.set_materialize_grads(False)
        precision = dot_precision(q)
        o, lse2 = attention_forward(q, k, v, causal, scale, precision)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.causal, ctx.scale, ctx.precision = causal, scale, precision
        return o, lse2 * LN2

    @staticmethod
    def backward(ctx, do: torch.Tensor, dlse: torch.Tensor):
        from .attention_backward import attention_backward

        q, k, v, o, lse2 = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = attention_backward(do, q, k, v, o, lse2, dlse, ctx.causal, ctx.scale, ctx.precision)
        return dq, dk, dv, None, None


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
                     return_lse: bool) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """flash_attention in torch ops, for inputs the kernels do not take."""
    gqa = q.shape[1] != k.shape[1]
    if not return_lse:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    # torch's SDPA does not return the LSE: compute the scores explicitly, in float32 at least.
    compute = torch.promote_types(q.dtype, torch.float32)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * scale
    if causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse.unsqueeze(-1)) @ v.to(compute)).to(q.dtype)
    return out, lse.float()


def autotuner_choices() -> list[str]:
    """``"KERNEL KEY: CONFIGURATION"`` for each configuration the autotuner has chosen in this
    process (none with BRAID_ATTENTION_AUTOTUNE=0 or before a GPU call)."""
    from .attention_backward import AUTOTUNERS as backward
    from .attention_forward import AUTOTUNERS as forward

    return [f"{name} {key}: {config}" for name, tuner in {**forward, **backward}.items()
            for key, config in getattr(tuner, "cache", {}).items()]


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, return_lse: bool = False
                    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention softmax(q k^T * softmax_scale [causal mask]) v over (B, H, S, D) tensors.

    Args:
        q: (B, Hq, Sq, D) queries.
        k, v: (B, Hkv, Sk, D) keys and values; Hkv must divide Hq (GQA/MQA when smaller).
        causal: mask aligned top-left as torch's ``is_causal`` (query i sees keys 0..i).
        softmax_scale: defaults to 1/sqrt(D).
        return_lse: also return the natural-log logsumexp of each row's scaled, masked scores,
            float32 of shape (B, Hq, Sq), differentiable (what ring / context-parallel attention
            needs to merge partial results).

    Returns:
        The output (B, Hq, Sq, D) in q's dtype, or (output, lse) with ``return_lse``.

    Raises:
        ValueError: for shapes that do not fit together (not 4-D, batch, head dims or k/v
            shapes that differ, Hkv not dividing Hq).

    Inputs the kernels do not take (see the module docstring) are computed with torch. Under
    autocast the inputs are cast to the autocast dtype first, as torch does for its SDPA.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be a 4-D (batch, heads, seq, head_dim) tensor, "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"flash_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
                         "must share batch size and head dim, and k and v must have the same shape")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"flash_attention: the kv head count {k.shape[1]} must divide the query head "
                         f"count {q.shape[1]}")
    q, k, v = _autocast(q, k, v)
    reason = _kernel_unsupported(q, k, v, enable_gqa=True)
    if reason is not None:
        _log_fallback(reason)
        return _torch_attention(q, k, v, causal, softmax_scale, return_lse)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _FlashAttention.apply(q, k, v, bool(causal), scale)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``: same signature, result
    and errors. Runs the fused kernels when they take the inputs (see the module docstring) and
    calls torch's SDPA otherwise, e.g. for an ``attn_mask`` or ``dropout_p > 0``."""
    if all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        query, key, value = _autocast(query, key, value)
    if attn_mask is not None:
        reason: Optional[str] = "attn_mask"
    elif dropout_p != 0.0:
        reason = "dropout_p > 0"
    else:
        reason = _kernel_unsupported(query, key, value, enable_gqa)
    if reason is not None:
        _log_fallback(reason)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return _FlashAttention.apply(query, key, value, bool(is_causal), scale)[0]
