"""Attention over packed sequences: flash_attention_varlen, with FlashAttention's varlen interface.

Sequences of different lengths are packed back to back along the token axis, (total_tokens,
heads, head_dim), and delimited by cumulative lengths, as FlashAttention's
``flash_attn_varlen_func`` takes them. The kernels (attention_forward.py, attention_backward.py)
launch one program per (query tile of the longest sequence, head, sequence); programs past the end
of their sequence return at once. What runs in the kernels and what falls back to torch is as for
the dense ``flash_attention`` (attention.py), with the length limits applying to the longest
sequence.
"""
from __future__ import annotations

import numbers
import threading
import weakref
from typing import NamedTuple, Optional, Union

import torch

from .attention import (ScoreSpec, Varlen, autocast_inputs, kernel_attention, kernel_unsupported,
                        log_fallback, score_spec, torch_attention)

_FN = "flash_attention_varlen"


class _Checked(NamedTuple):
    """The last cu_seqlens pair whose values were checked, and what the check found."""

    cu_seqlens_q: weakref.ref
    version_q: int
    cu_seqlens_k: weakref.ref
    version_k: int
    bounds_q: list[int]
    bounds_k: list[int]
    longest_q: int
    longest_k: int


# Every layer of a model gets the same cu_seqlens tensors in a step: the values are read to the
# host (a synchronization with the GPU) for the first call only, and checked again when either
# tensor is a different object or was written in place since (its version counter moved).
_checked: Optional[_Checked] = None
_checked_lock = threading.Lock()


def _check_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{_FN}: {name} must be a 3-D (total_tokens, heads, head_dim) tensor, "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    if k.shape != v.shape:
        raise ValueError(f"{_FN}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{_FN}: k's head dim {k.shape[2]} differs from q's {q.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{_FN}: the kv head count {k.shape[1]} (k, v) must divide the query head count "
                         f"{q.shape[1]} (q)")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{_FN}: {name} is {t.dtype} on {t.device}, q {q.dtype} on {q.device}")


def _check_cu_seqlens(q: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> int:
    """Checks what can be checked without reading the values; returns the number of sequences."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
            raise ValueError(f"{_FN}: {name} must be an int32 tensor, got "
                             f"{getattr(cu, 'dtype', type(cu).__name__)}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{_FN}: {name} must be 1-D of shape (batch + 1,) with batch >= 1, "
                             f"got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{_FN}: {name} is on {cu.device}, q on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"{_FN}: cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must describe the same number of sequences")
    return cu_seqlens_q.shape[0] - 1


def _read_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int,
                 total_k: int) -> _Checked:
    """The values of cu_seqlens_q and cu_seqlens_k, checked: from 0, non-decreasing, ending at the
    token counts. One read of device memory unless this pair was checked before, unchanged."""
    global _checked
    with _checked_lock:
        last = _checked
        if (last is not None and last.cu_seqlens_q() is cu_seqlens_q and last.cu_seqlens_k() is cu_seqlens_k
                and last.version_q == cu_seqlens_q._version and last.version_k == cu_seqlens_k._version):
            return last
    bounds_q, bounds_k = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()
    longest = []
    for name, bounds, total, tensor in (("cu_seqlens_q", bounds_q, total_q, "q"),
                                        ("cu_seqlens_k", bounds_k, total_k, "k")):
        if bounds[0] != 0:
            raise ValueError(f"{_FN}: {name} must start at 0, got {bounds[0]}")
        lengths = [end - start for start, end in zip(bounds, bounds[1:])]
        shrinking = next((i for i, n in enumerate(lengths) if n < 0), None)
        if shrinking is not None:
            raise ValueError(f"{_FN}: {name} must not decrease, but entry {shrinking + 1} "
                             f"({bounds[shrinking + 1]}) is below entry {shrinking} ({bounds[shrinking]})")
        if bounds[-1] != total:
            raise ValueError(f"{_FN}: {name} must end at the token count of {tensor}, {total}, "
                             f"got {bounds[-1]}")
        longest.append(max(lengths))
    checked = _Checked(weakref.ref(cu_seqlens_q), cu_seqlens_q._version, weakref.ref(cu_seqlens_k),
                       cu_seqlens_k._version, bounds_q, bounds_k, *longest)
    with _checked_lock:
        _checked = checked
    return checked


def _torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, checked: _Checked
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attention_varlen in torch ops, one sequence at a time, for inputs the kernels do not
    take: the output (total_q, Hq, D) and the LSE (Hq, total_q)."""
    outs, lses = [], []
    bounds = zip(checked.bounds_q, checked.bounds_q[1:], checked.bounds_k, checked.bounds_k[1:])
    for b, (q0, q1, k0, k1) in enumerate(bounds):
        q_b, k_b, v_b = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t, lo, hi in ((q, q0, q1), (k, k0, k1),
                                                                               (v, k0, k1)))
        slopes = spec.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        out, lse = torch_attention(q_b, k_b, v_b, spec._replace(alibi_slopes=slopes), return_lse=True,
                                   shift=(k1 - k0) - (q1 - q0))
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           causal: bool = False, softmax_scale: Optional[float] = None,
                           window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, return_lse: bool = False
                           ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention within each of N sequences packed along the token axis, forward and backward.

    Sequence b holds the query tokens cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and the key
    tokens cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of k and v; a token attends only to keys
    of its own sequence. The logits are built as in ``flash_attention``: scale, soft cap,
    ALiBi bias, then the causal mask and the window. Masks and biases are aligned
    bottom-right, as FlashAttention (2.1 and later) aligns them: in a sequence of Sq queries and
    Sk keys, query row i stands at key position i + Sk - Sq, so that the last query sits at the
    last key (the dense ``flash_attention`` aligns top-left, as torch does; the two agree when
    Sq == Sk). A query row that sees no key (Sq > Sk with ``causal``, a window past the keys, an
    empty key sequence) gets output 0, LSE -inf and zero gradients; an empty query sequence
    produces no rows.

    Args:
        q: (total_q, Hq, D) queries of all sequences, back to back.
        k, v: (total_k, Hkv, D) keys and values; Hkv must divide Hq (GQA/MQA when smaller).
            Same dtype and device as q.
        cu_seqlens_q, cu_seqlens_k: int32 cumulative lengths of shape (N + 1,), N >= 1, on q's
            device: 0, then non-decreasing (sequences of length 0 are allowed), ending at
            total_q and total_k.
        max_seqlen_q, max_seqlen_k: at least the longest query and key sequence (the launch
            grid's size; larger values only launch programs that return at once).
        causal: query row i sees keys up to its position i + Sk - Sq only.
        softmax_scale: defaults to 1/sqrt(D).
        window: (left, right): query row i sees keys (i + Sk - Sq) - left .. (i + Sk - Sq) + right
            only; -1 leaves that side open. (-1, -1) is no window; with ``causal`` the right side
            ends at the row's position whatever it is.
        softcap: the soft cap of the scaled scores, softcap * tanh(scores / softcap); 0 for none.
        alibi_slopes: float32 slopes of shape (Hq,) or (N, Hq): ALiBi biases
            -slope * |i + Sk - Sq - j| added after the cap. Not differentiated.
        return_lse: also return the natural-log logsumexp of each query row's logits, float32
            of shape (Hq, total_q) as FlashAttention returns it, differentiable.

    Returns:
        The output (total_q, Hq, D) in q's dtype, or (output, lse) with ``return_lse``.

    Raises:
        ValueError: naming the argument, for q, k, v that are not 3-D or do not fit together
            (head dims, head counts, dtypes, devices), cu_seqlens that are not int32 or not 1-D,
            do not start at 0, decrease or do not end at the token counts, a max_seqlen below a
            real length, and a bad window, softcap or alibi_slopes.

    The values of cu_seqlens are checked on the host: the first call with a pair of tensors reads
    them (a synchronization with the GPU); later calls with the same, unmodified tensors, as
    every layer of a model makes in one step, reuse that check. Inputs the kernels do not take
    (see attention.py) are computed with torch, one sequence at a time. Under autocast the inputs
    are cast to the autocast dtype first, as for ``flash_attention``.
    """
    _check_tokens(q, k, v)
    batch = _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k)
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"{_FN}: {name} must be an int >= 0, got {n!r}")
    spec = score_spec(_FN, q, q.shape[1], batch, causal, softmax_scale, window, softcap, alibi_slopes)
    checked = _read_bounds(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    for name, given, longest in (("max_seqlen_q", max_seqlen_q, checked.longest_q),
                                 ("max_seqlen_k", max_seqlen_k, checked.longest_k)):
        if given < longest:
            raise ValueError(f"{_FN}: {name} is {given}, below the longest sequence, {longest}")
    q, k, v = autocast_inputs(q, k, v)
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    # The kernels take (B, H, S, D) tensors: the packed tokens are one batch entry of all of them.
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    reason = kernel_unsupported(q4, k4, v4, enable_gqa=True, varlen=varlen)
    if reason is not None:
        log_fallback(reason)
        out, lse = _torch_varlen(q, k, v, spec, checked)
    else:
        out4, lse4 = kernel_attention(q4, k4, v4, spec, varlen)
        out, lse = out4[0].transpose(0, 1), lse4[0]
    return (out, lse) if return_lse else out
