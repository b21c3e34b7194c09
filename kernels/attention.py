"""Fused attention: flash_attention and a drop-in scaled_dot_product_attention over Triton kernels.

Layout is torch's, (batch, heads, seq, head_dim), with any strides (the packed-sequence entry
point, flash_attention_varlen, is in attention_varlen.py). What runs in the kernels:

- CUDA tensors (compute capability 8.0 or newer) of float16, bfloat16 or float32; CPU tensors
  only when ``TRITON_INTERPRET=1`` is set (Triton's interpreter; float16 and float32 only, since
  the interpreter computes bfloat16 dot products wrongly).
- Head dims 16 to 256, the same for q, k and v (padded to a power of two inside the kernels).
- Any lengths Sq, Sk >= 1; causal masks and windows aligned top-left as in torch (query row i
  stands at key position i). A row that sees no key (a window past the keys) gets output 0 and
  LSE -inf.
- GQA/MQA: k and v may have fewer heads than q, a divisor of q's; query head h reads kv head
  h // (Hq / Hkv), and dK/dV are summed over the query heads of each group.
- The logits options of flash_attention: a sliding window, a logit soft cap and ALiBi biases (see
  ``flash_attention``), in the forward and the backward; key tiles that the causal mask or the
  window hides from a whole query tile are skipped.

float32 runs in the kernels too; its dot products follow torch's switch for its own CUDA float32
matmuls: full float32 by default, TF32 when ``torch.backends.cuda.matmul.allow_tf32`` is True.

Everything else (an attn_mask tensor, dropout, other dtypes or head dims, CPU tensors without
the interpreter, shapes the kernels do not take) goes to torch, logged once per reason at debug
level on the ``braid.kernels.attention`` logger.

On a GPU the kernels are autotuned (tile sizes, warps, pipeline stages) per head dim, causal flag,
power-of-two length bucket and set of options at their first call; ``BRAID_ATTENTION_TMA=1`` makes
the kernels stream their tiles through tensor descriptors (TMA, sm_90 and newer, half types,
16-byte aligned strides; other inputs keep the pointer path). The forward and both gradient
kernels write every output element from one program without atomics, so results are bitwise
reproducible.
"""
from __future__ import annotations

import functools
import logging
import math
import numbers
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MIN_HEAD_DIM = 16  # tl.dot needs K >= 16
MAX_HEAD_DIM = 256  # a 256-wide tile of q and the float32 accumulator still fit one program
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRETER_DTYPES = (torch.float16, torch.float32)
# The kernels launch (query or key tiles, heads, batch entries or sequences): tiles on the fast x
# axis, so that the programs running together share one (batch, head) and its K and V in L2, then
# the heads of a batch entry (the query heads of a GQA group share their K and V too). A 1-D grid
# would lift the y and z limits, but its index arithmetic cost the forward 250 bytes of register
# spills per thread at its 128 x 64 tiles (ptxas, sm_90, d = 128).
_MAX_GRID_YZ = 65535
_logged_reasons: set[str] = set()


class ScoreSpec(NamedTuple):
    """How the kernels turn q.k into the logits of the softmax, checked by ``score_spec``."""

    scale: float
    causal: bool
    window: Optional[tuple[int, int]] = None  # (left, right), -1 for an open side; None: no window
    softcap: Optional[float] = None  # None: no soft cap
    alibi_slopes: Optional[torch.Tensor] = None  # float32 (H,) or (B, H); None: no ALiBi


class Varlen(NamedTuple):
    """Packed sequences: cumulative lengths (int32, (N + 1,)) and the longest lengths."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def log_fallback(reason: str) -> None:
    """Logs once per reason, at debug level, that attention falls back to torch."""
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


def kernel_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool,
                       varlen: Optional[Varlen] = None) -> Optional[str]:
    """Why the kernels cannot take these (B, H, S, D) inputs, or None when they can. With
    ``varlen``, q, k and v are (1, H, T, D) views of packed tokens. Shapes that torch rejects land
    here too, so that torch raises its own error for them."""
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
    rows = (varlen.max_seqlen_q, varlen.max_seqlen_k) if varlen else (q.shape[2], k.shape[2])
    if max(rows) * q.shape[3] >= 2**31:
        return "a sequence of 2**31 elements or more (the kernels' offsets in a sequence are 32-bit)"
    batch = varlen.cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    if max(batch, heads) > _MAX_GRID_YZ:
        return f"more than {_MAX_GRID_YZ} heads or sequences (the y and z axes of the kernels' launch grid)"
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



def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
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


def score_spec(fn: str, q: torch.Tensor, heads: int, batch: int, causal: bool, softmax_scale: Optional[float],
               window, softcap, alibi_slopes: Optional[torch.Tensor]) -> ScoreSpec:
    """The logits options of entry point ``fn`` checked and normalized (an open window (-1, -1)
    and a zero soft cap become None); ``heads`` and ``batch`` are the query heads and the batch
    size (sequences, when packed) that ALiBi slopes may be given for.

    Raises:
        ValueError: naming the argument that is not a (left, right) pair of ints >= -1 (window), a
            finite number >= 0 (softcap) or a float32 tensor of shape (heads,) or (batch, heads)
            on q's device (alibi_slopes).
    """
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: window must be a pair (left, right), got {window!r}") from None
    if not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1
               for w in (left, right)):
        raise ValueError(f"{fn}: window must hold ints >= -1 (-1: no bound on that side), got {window!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0.0 <= softcap < math.inf:
        raise ValueError(f"{fn}: softcap must be a finite number >= 0 (0: no cap), got {softcap!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            raise ValueError(f"{fn}: alibi_slopes must be a float32 tensor, got "
                             f"{getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)}")
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"{fn}: alibi_slopes must have shape ({heads},) or ({batch}, {heads}) (heads or "
                             f"batch x heads), got {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"{fn}: alibi_slopes is on {alibi_slopes.device}, q on {q.device}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return ScoreSpec(scale, bool(causal), None if (left, right) == (-1, -1) else (int(left), int(right)),
                     float(softcap) if softcap else None, alibi_slopes)


class _FlashAttention(torch.autograd.Function):
    """(o, lse) = attention(q, k, v) with the Triton kernels, differentiable in both outputs (not
    in the ALiBi slopes)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec,
                varlen: Optional[Varlen]) -> tuple[torch.Tensor, torch.Tensor]:
        from .attention_forward import LN2, attention_forward

        # Gradients of unused outputs arrive as None instead of zero tensors: an unused LSE then
        # costs nothing in the backward.
        ctx.set_materialize_grads(False)
        precision = dot_precision(q)
        options = {"window": spec.window, "softcap": spec.softcap, "alibi_slopes": spec.alibi_slopes,
                   **(varlen._asdict() if varlen else {})}
        o, lse2 = attention_forward(q, k, v, spec.causal, spec.scale, precision, **options)
        ctx.save_for_backward(q, k, v, o, lse2)
        ctx.spec, ctx.options, ctx.precision = spec, options, precision
        return o, lse2 * LN2

    @staticmethod
    def backward(ctx, do: torch.Tensor, dlse: torch.Tensor):
        from .attention_backward import attention_backward

        q, k, v, o, lse2 = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = attention_backward(do, q, k, v, o, lse2, dlse, ctx.spec.causal, ctx.spec.scale,
                                        ctx.precision, **ctx.options)
        return dq, dk, dv, None, None


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec,
                     varlen: Optional[Varlen] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, natural-log LSE) from the kernels, differentiable in q, k, v, for inputs that
    ``kernel_unsupported`` passed: (B, H, S, D) tensors, or with ``varlen`` (1, H, T, D) views
    of packed tokens."""
    return _FlashAttention.apply(q, k, v, spec, varlen)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, return_lse: bool,
                    shift: int = 0) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """flash_attention in torch ops, for inputs the kernels do not take: (B, H, S, D) tensors,
    query row i standing at key position i + shift (0: top-left alignment)."""
    gqa = q.shape[1] != k.shape[1]
    plain = spec.window is None and spec.softcap is None and spec.alibi_slopes is None and shift == 0
    if plain and not return_lse:
        return F.scaled_dot_product_attention(q, k, v, is_causal=spec.causal, scale=spec.scale,
                                              enable_gqa=gqa)
    # torch's SDPA neither returns the LSE nor takes these options: compute the scores explicitly,
    # in float32 at least.
    compute = torch.promote_types(q.dtype, torch.float32)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * spec.scale
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    # distance[i, j] = (i + shift) - j: how far key j lies before query row i's position.
    distance = (torch.arange(q.shape[2], device=q.device)[:, None] + shift
                - torch.arange(k.shape[2], device=q.device)[None, :])
    if spec.alibi_slopes is not None:
        slopes = spec.alibi_slopes.to(compute).reshape(-1, q.shape[1], 1, 1)
        scores = scores - slopes * distance.abs().to(compute)
    visible = torch.ones_like(distance, dtype=torch.bool)
    if spec.causal:
        visible &= distance >= 0
    if spec.window is not None:
        left, right = spec.window
        if left >= 0:
            visible &= distance <= left
        if right >= 0:
            visible &= distance >= -right
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key has LSE -inf: exponentiating against 0 there gives P = 0, not NaN.
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    out = (probs @ v.to(compute)).to(q.dtype)
    return (out, lse.float()) if return_lse else out


def autotuner_choices() -> list[str]:
    """``"KERNEL KEY: CONFIGURATION"`` for each configuration the autotuner has chosen in this
    process (none with BRAID_ATTENTION_AUTOTUNE=0 or before a GPU call)."""
    from .attention_backward import AUTOTUNERS as backward
    from .attention_forward import AUTOTUNERS as forward

    return [f"{name} {key}: {config}" for name, tuner in {**forward, **backward}.items()
            for key, config in getattr(tuner, "cache", {}).items()]


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                    return_lse: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention softmax(logits) v over (B, H, S, D) tensors.

    The logits of query row i and key j are built in this order: s = softmax_scale * q_i.k_j;
    with ``softcap`` > 0, s = softcap * tanh(s / softcap) (the cap applies to the scaled scores,
    as in Gemma 2 and FlashAttention); with ``alibi_slopes``, s -= slope * |i - j|; then the
    causal mask and the window hide keys (-inf). Masks and biases are aligned top-left, as torch
    aligns ``is_causal``: row i stands at key position i, also when Sq != Sk.

    Args:
        q: (B, Hq, Sq, D) queries.
        k, v: (B, Hkv, Sk, D) keys and values; Hkv must divide Hq (GQA/MQA when smaller).
        causal: row i sees keys 0..i only.
        softmax_scale: defaults to 1/sqrt(D).
        window: (left, right): row i sees keys i - left .. i + right only; -1 leaves that side
            open. (-1, -1) is no window; with ``causal`` the right side ends at i whatever it is.
            A row whose window holds no key (past Sk) gets output 0 and LSE -inf.
        softcap: the soft cap of the scaled scores; 0 for none.
        alibi_slopes: float32 slopes of shape (Hq,) or (B, Hq): ALiBi biases -slope * |i - j|
            added after the cap. Not differentiated.
        return_lse: also return the natural-log logsumexp of each row's logits, float32 of shape
            (B, Hq, Sq), differentiable (what ring / context-parallel attention needs to merge
            partial results).

    Returns:
        The output (B, Hq, Sq, D) in q's dtype, or (output, lse) with ``return_lse``.

    Raises:
        ValueError: for shapes that do not fit together (not 4-D, batch, head dims or k/v
            shapes that differ, Hkv not dividing Hq), and for a bad window, softcap or
            alibi_slopes (the message names it).

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
    spec = score_spec("flash_attention", q, q.shape[1], q.shape[0], causal, softmax_scale, window, softcap,
                      alibi_slopes)
    q, k, v = autocast_inputs(q, k, v)
    reason = kernel_unsupported(q, k, v, enable_gqa=True)
    if reason is not None:
        log_fallback(reason)
        return torch_attention(q, k, v, spec, return_lse)
    out, lse = kernel_attention(q, k, v, spec)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``: same signature, result
    and errors. Runs the fused kernels when they take the inputs (see the module docstring) and
    calls torch's SDPA otherwise, e.g. for an ``attn_mask`` or ``dropout_p > 0``."""
    if all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        query, key, value = autocast_inputs(query, key, value)
    if attn_mask is not None:
        reason: Optional[str] = "attn_mask"
    elif dropout_p != 0.0:
        reason = "dropout_p > 0"
    else:
        reason = kernel_unsupported(query, key, value, enable_gqa)
    if reason is not None:
        log_fallback(reason)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return kernel_attention(query, key, value, ScoreSpec(scale, bool(is_causal)))[0]
