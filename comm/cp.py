"""Context-parallel (ring) attention: the sequence sharded over ranks, K/V blocks passed around a ring.

    from braid.comm import cp
    q, k, v = (cp.shard(t, c, balanced=True) for t in (q_full, k_full, v_full))   # (B, H, S/N, D)
    out = cp.ring_attention(q, k, v, c, causal=True)      # this rank's rows of full attention
    full = cp.unshard(out, c, balanced=True)

Each rank holds the queries, keys and values of its part of the sequence. Step i of the ring
computes the local queries against the K/V block that started on rank ``rank - i``, while that
block already travels on to the next rank (the transfer is posted before the block is computed);
the partial outputs merge through their log-sum-exps. The backward passes the K/V blocks around
again, recomputing each block's probabilities from the saved LSE (as flash attention's backward
does), with the block's dK/dV accumulator travelling beside it: after a full turn every
accumulator is back on the rank that owns its block.

Layouts: with ``balanced=False`` rank r holds the r-th of N contiguous chunks; with
``balanced=True`` the sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r, so
that under a causal mask every rank computes the same number of query-key pairs. The default
is balanced for causal attention.

Groups (comm/core/group.py): a braid :class:`~braid.comm.Communicator` (point-to-point on its progress
thread; CUDA tensors are staged through host memory), any ``torch.distributed`` ProcessGroup
(gloo, NCCL, braid's backend), or None for the default group; each ring step is the group's
``send_recv``.
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
import numbers
from collections.abc import Sequence
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .core.communicator import Communicator
from .core.group import Group, as_group, renamed_args

CommunicatorLike = Union[Communicator, "dist.ProcessGroup", None]  # None: the default group

# (query rows, key rows, causal) of one block computation; rows as slices of the local shard.
_Piece = tuple[slice, slice, bool]
_ALL = slice(None)


# -- the ring ----------------------------------------------------------------------------------
class _Ring:
    """This rank's neighbours on the ring of a group (comm/core/group.py: a braid Communicator, a
    torch.distributed ProcessGroup, or None for the default group) and the transfers to them."""

    def __init__(self, group: CommunicatorLike, what: str):
        self.group = as_group(group, "group", what)
        self.rank, self.world_size = self.group.rank, self.group.world_size
        self.next = (self.rank + 1) % self.world_size
        self.prev = (self.rank - 1) % self.world_size

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> Any:
        """Posts ``send`` to the next rank and the receive of ``recv`` from the previous one."""
        return self.group.send_recv(send, self.next, recv, self.prev)

    def all_gather(self, tensor: torch.Tensor) -> list:
        """Every rank's ``tensor`` (same shape everywhere), in rank order; through host memory
        where the group does not carry the tensor's device."""
        host = isinstance(self.group, Group) and self.group.device_problem(tensor.device) is not None
        src = tensor.cpu() if host else tensor.contiguous()
        out = torch.empty((self.world_size, *src.shape), dtype=src.dtype, device=src.device)
        self.group.all_gather(out, src)
        return [t.to(tensor.device) for t in out.unbind(0)]


# -- layouts -----------------------------------------------------------------------------------
def _chunks_of(rank: int, world_size: int, balanced: bool) -> tuple[int, ...]:
    return (rank, 2 * world_size - 1 - rank) if balanced else (rank,)


def _positions(seq_len: int, rank: int, world_size: int, balanced: bool, device: Any) -> torch.Tensor:
    parts = 2 * world_size if balanced else world_size
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
    if seq_len % parts:
        layout = f"2 * world_size = {parts} chunks (balanced)" if balanced else f"world_size = {parts} chunks"
        raise ValueError(f"seq_len ({seq_len}) must divide into {layout}")
    c = seq_len // parts
    chunks = _chunks_of(rank, world_size, balanced)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks])


def _check_balanced(balanced: Any) -> bool:
    if not isinstance(balanced, bool):
        raise TypeError(f"balanced must be a bool, got {balanced!r}")
    return balanced


@renamed_args(communicator="group")
def shard_indices(seq_len: int, group: CommunicatorLike, *, balanced: bool,
                  device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """The sequence positions this rank holds, in local order (an int64 tensor of seq_len / N, on
    ``device``: default the CPU).

    ``balanced=False``: the rank-th of N contiguous chunks. ``balanced=True``: chunks r and 2N-1-r
    of 2N (the layout :func:`ring_attention` uses for causal attention by default). ``seq_len``
    must divide into the chunks. Useful for position ids (RoPE) of a sharded sequence.
    """
    ring = _Ring(group, "shard_indices")
    return _positions(seq_len, ring.rank, ring.world_size, _check_balanced(balanced), device)


def _seq_dim(tensor: torch.Tensor, dim: int, what: str) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"{what}: dim must be an int in [{-tensor.dim()}, {tensor.dim()}), got {dim!r}")
    return dim % tensor.dim()


@renamed_args(communicator="group")
def shard(tensor: torch.Tensor, group: CommunicatorLike, *, balanced: bool,
          dim: int = 2) -> torch.Tensor:
    """This rank's part of ``tensor`` (the whole sequence along ``dim``; 2 for (B, H, S, D)),
    in the layout of :func:`shard_indices`. Differentiable."""
    ring = _Ring(group, "shard")
    dim = _seq_dim(tensor, dim, "shard")
    balanced = _check_balanced(balanced)
    index = _positions(tensor.shape[dim], ring.rank, ring.world_size, balanced, tensor.device)
    return tensor.index_select(dim, index)


@renamed_args(communicator="group")
def unshard(tensor: torch.Tensor, group: CommunicatorLike, *, balanced: bool,
            dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's part (``tensor``, laid out as :func:`shard` makes it),
    on every rank: an all-gather, then the positions put in order. Not differentiable (the result
    is a new tensor without history)."""
    ring = _Ring(group, "unshard")
    dim = _seq_dim(tensor, dim, "unshard")
    balanced = _check_balanced(balanced)
    parts = ring.all_gather(tensor.detach())
    seq_len = tensor.shape[dim] * ring.world_size
    order = torch.cat([_positions(seq_len, r, ring.world_size, balanced, tensor.device)
                       for r in range(ring.world_size)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))


def _pieces(rank: int, source: int, local_len: int, causal: bool, balanced: bool) -> list:
    """What the queries of ``rank`` compute against the K/V block that started on ``source``.

    Without a mask: everything. Causal, contiguous chunks: the diagonal block with the mask, every
    earlier rank's block whole, later ranks' not at all. Causal, balanced (chunks r and 2N-1-r):
    the own block with the mask (its order is the sequence's, so the top-left mask is right); an
    earlier rank j < r: both local query chunks see all of chunk j and none of chunk 2N-1-j (which
    lies after 2N-1-r); a later rank j > r: only chunk 2N-1-r sees it, and all of it.
    """
    if not causal:
        return [(_ALL, _ALL, False)]
    if source == rank:
        return [(_ALL, _ALL, True)]
    if not balanced:
        return [(_ALL, _ALL, False)] if source < rank else []
    half = local_len // 2
    if source < rank:
        return [(_ALL, slice(0, half), False)]
    return [(slice(half, None), _ALL, False)]


# -- per-block attention -----------------------------------------------------------------------
def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _block_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """How blocks are computed: "kernels" (braid's Triton kernels, on GPUs that take the inputs),
    "cpu_flash" (torch's fused CPU attention, which returns the LSE and takes GQA), or "math"
    (torch matmuls: whatever neither takes, e.g. float64 on a GPU)."""
    if q.is_cuda:
        from braid.kernels import attention

        return "kernels" if attention.kernel_unsupported(q, k, v, enable_gqa=True) is None else "math"
    if q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES:
        return "cpu_flash"
    return "math"


_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, ...) as (B, Hkv, G * S, ...): query head h reads kv head h // G, so the G query
    heads of a group become rows of one matrix against their shared K/V (no repeated K/V)."""
    b, h, s = t.shape[:3]
    return t.reshape(b, kv_heads, (h // kv_heads) * s, *t.shape[3:])


def _scores(qg: torch.Tensor, k: torch.Tensor, q_len: int, causal: bool, scale: float) -> torch.Tensor:
    scores = (qg @ k.transpose(-2, -1)) * scale
    if causal:  # top-left aligned, per query position (row i of each group is position i % q_len)
        rows = torch.arange(q_len, device=qg.device).repeat(qg.shape[-2] // q_len)
        hidden = rows[:, None] < torch.arange(k.shape[-2], device=qg.device)[None, :]
        scores.masked_fill_(hidden, float("-inf"))
    return scores


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _accumulation_dtype(q.dtype)
    b, h, s, d = q.shape
    qg = _grouped(q.to(acc), k.shape[1])
    scores = _scores(qg, k.to(acc), s, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(acc)
    return out.view(b, h, s, d), lse.view(b, h, s)


def _math_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = _accumulation_dtype(q.dtype)
    b, h, s, d = q.shape
    kv_heads = k.shape[1]
    qg, dog = _grouped(q.to(acc), kv_heads), _grouped(do.to(acc), kv_heads)
    delta = (dog * _grouped(out.to(acc), kv_heads)).sum(-1, keepdim=True)
    k, v = k.to(acc), v.to(acc)
    p = torch.exp(_scores(qg, k, s, causal, scale) - _grouped(lse.to(acc), kv_heads).unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dog  # the rows of a group sum into their shared K/V
    ds = p * (dog @ v.transpose(-2, -1) - delta)
    dq = (ds @ k) * scale
    dk = (ds.transpose(-2, -1) @ qg) * scale
    return dq.view(b, h, s, d), dk, dv


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: the output and the natural-log LSE, in the accumulation dtype."""
    acc = _accumulation_dtype(q.dtype)
    path = _block_path(q, k, v)
    if path == "kernels":
        from braid.kernels.attention import dot_precision
        from braid.kernels.attention_forward import LN2, attention_forward

        o, lse2 = attention_forward(q, k, v, causal, scale, dot_precision(q))
        return o.to(acc), lse2 * LN2
    if path == "cpu_flash":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return o.to(acc), lse.to(acc)
    return _math_forward(q, k, v, causal, scale)


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of one block from the whole attention's output ``out`` and LSE: with the final
    LSE the block's probabilities are its share of the final softmax, and rowsum(dO * out) is the
    whole row's, so the block gradients add up to the full ones."""
    path = _block_path(q, k, v)
    if path == "kernels":
        from braid.kernels.attention import dot_precision
        from braid.kernels.attention_backward import attention_backward
        from braid.kernels.attention_forward import LOG2E

        lse2 = (lse * LOG2E).float().contiguous()
        return attention_backward(do, q, k, v, out, lse2, None, causal, scale, dot_precision(q))
    if path == "cpu_flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)
    return _math_backward(do, q, k, v, out, lse, causal, scale)


# -- forward and backward around the ring --------------------------------------------------------
def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Folds a block's (output, LSE) into the running ones, in place: the running output moves
    toward the block's by the block's share of the combined softmax mass, sigmoid(lse_b - lse),
    and lse becomes log(exp(lse) + exp(lse_b)) = lse - logsigmoid(lse - lse_b)."""
    out.sub_(torch.sigmoid(block_lse - lse).unsqueeze(-1) * (out - block_out))
    lse.sub_(F.logsigmoid(lse - block_lse))


def _ring_forward(q, k, v, ring: _Ring, causal: bool, scale: float, balanced: bool):
    n, s = ring.world_size, q.shape[2]
    kv = [torch.stack([k, v]), None]  # this step's block, and the buffer the next one arrives in
    out = lse = None
    for step in range(n):
        if step + 1 < n:  # the next block travels while this one is computed
            if kv[1] is None:
                kv[1] = torch.empty_like(kv[0])
            pending = ring.exchange(kv[0], kv[1])
        for rows, keys, masked in _pieces(ring.rank, (ring.rank - step) % n, s, causal, balanced):
            block_out, block_lse = _block_forward(q[:, :, rows], kv[0][0][:, :, keys], kv[0][1][:, :, keys],
                                                  masked, scale)
            if out is None:  # step 0 is the own block, where every row sees at least itself
                out, lse = block_out, block_lse
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if step + 1 < n:
            pending.wait()
            kv.reverse()
    return out.to(q.dtype), lse


def _ring_backward(do, q, k, v, out, lse, ring: _Ring, causal: bool, scale: float, balanced: bool):
    n, s = ring.world_size, q.shape[2]
    acc = _accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = [torch.stack([k, v]), None]
    grads = None  # the dK/dV accumulator of the block held now, once it arrived from the previous rank
    arriving = None
    for step in range(n):
        if step + 1 < n:
            if kv[1] is None:
                kv[1] = torch.empty_like(kv[0])
            pending = ring.exchange(kv[0], kv[1])
        mine = torch.zeros(kv[0].shape, dtype=acc, device=q.device)
        for rows, keys, masked in _pieces(ring.rank, (ring.rank - step) % n, s, causal, balanced):
            block_k, block_v = kv[0][0][:, :, keys], kv[0][1][:, :, keys]
            bq, bk, bv = _block_backward(do[:, :, rows], q[:, :, rows], block_k, block_v, out[:, :, rows],
                                         lse[:, :, rows], masked, scale)
            dq[:, :, rows] += bq
            mine[0][:, :, keys] += bk
            mine[1][:, :, keys] += bv
        if arriving is not None:  # what the ranks before this one added for this block
            arriving[0].wait()
            mine += arriving[1]
        if n > 1:  # on to the next rank; after the last step it reaches the block's owner
            grads = torch.empty_like(mine)
            arriving = (ring.exchange(mine, grads), grads)
        else:
            arriving = None
            grads = mine
        if step + 1 < n:
            pending.wait()
            kv.reverse()
    if arriving is not None:
        arriving[0].wait()
    return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale, balanced):
        out, lse = _ring_forward(q, k, v, ring, causal, scale, balanced)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.balanced = ring, causal, scale, balanced
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do.contiguous(), q, k, v, out, lse, ctx.ring, ctx.causal, ctx.scale,
                                    ctx.balanced)
        return dq, dk, dv, None, None, None, None


def _check_inputs(q: Any, k: Any, v: Any, balanced: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ring_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"ring_attention: {name} must be 4-D (batch, heads, seq, head_dim), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"ring_attention: q, k and v must share dtype and device, got {q.dtype} on "
                             f"{q.device} and {t.dtype} on {t.device} ({name})")
    if not q.is_floating_point():
        raise TypeError(f"ring_attention: q, k and v must be floating point, got {q.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"ring_attention: k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch size "
                         "and head dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: the kv head count ({k.shape[1]}) must divide the query head "
                         f"count ({q.shape[1]})")
    if q.shape[2] != k.shape[2] or q.shape[2] == 0:
        raise ValueError(f"ring_attention: q and k must hold this rank's same positions (same, non-zero "
                         f"local length), got {q.shape[2]} and {k.shape[2]}")
    if balanced and q.shape[2] % 2:
        raise ValueError(f"ring_attention: the balanced layout holds two equal chunks per rank, so the local "
                         f"length must be even, got {q.shape[2]}")


@renamed_args(communicator="group")
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CommunicatorLike, *,
                   causal: bool = False, scale: Optional[float] = None,
                   balanced: Optional[bool] = None) -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of ``group``; differentiable.

    Args:
        q: (B, Hq, S_local, D) this rank's queries.
        k, v: (B, Hkv, S_local, D) this rank's keys and values; Hkv must divide Hq (GQA/MQA).
        group: a braid ``Communicator`` or a torch.distributed ProcessGroup; every rank of
            it calls ring_attention with the same shapes and options.
        causal: query position i sees key positions 0..i of the whole sequence.
        scale: softmax scale, default 1/sqrt(D).
        balanced: the layout the shards are in (see :func:`shard_indices`); default ``causal``.

    Returns:
        This rank's rows (B, Hq, S_local, D) of softmax(q k^T * scale [mask]) v over the whole
        sequence, in q's dtype and the shards' layout. Blocks are computed by braid's Triton
        kernels on GPUs that take them, by torch's fused CPU attention on the CPU, by torch
        matmuls otherwise; partial results are merged in float32 at least.
    """
    ring = _Ring(group, "ring_attention")
    if not isinstance(causal, bool):
        raise TypeError(f"ring_attention: causal must be a bool, got {causal!r}")
    balanced = causal if balanced is None else _check_balanced(balanced)
    _check_inputs(q, k, v, balanced)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"ring_attention: scale must be a finite number or None, got {scale!r}")
    return _RingAttention.apply(q, k, v, ring, causal, float(scale), balanced)


# -- drop-ins ----------------------------------------------------------------------------------
class RingAttention(nn.Module):
    """``torch.nn.functional.scaled_dot_product_attention`` over a sharded sequence: call it with
    SDPA's arguments (this rank's q, k, v) and it runs :func:`ring_attention`.

    ``balanced`` is the layout of the shards (default: that of ``is_causal`` at each call). An
    ``attn_mask`` or ``dropout_p > 0`` raise ValueError: the ring computes only the causal or
    unmasked attention.
    """

    @renamed_args(communicator="group")
    def __init__(self, group: CommunicatorLike, *, balanced: Optional[bool] = None):
        super().__init__()
        _Ring(group, "RingAttention")
        self.communicator = group
        self.balanced = None if balanced is None else _check_balanced(balanced)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError("RingAttention: attn_mask is not supported (only is_causal or no mask)")
        if dropout_p != 0.0:
            raise ValueError(f"RingAttention: dropout_p must be 0, got {dropout_p!r}")
        if query.dim() == 4 and key.dim() == 4 and query.shape[1] != key.shape[1] and not enable_gqa:
            raise ValueError(f"RingAttention: query has {query.shape[1]} heads and key {key.shape[1]}: "
                             "pass enable_gqa=True for grouped-query attention")
        return ring_attention(query, key, value, self.communicator, causal=bool(is_causal), scale=scale,
                              balanced=self.balanced)

    def extra_repr(self) -> str:
        ring = _Ring(self.communicator, "RingAttention")
        return f"rank={ring.rank}, world_size={ring.world_size}, balanced={self.balanced}"


class _RouteAttention(TorchFunctionMode):
    """Sends every ``F.scaled_dot_product_attention`` call made inside it to a RingAttention."""

    def __init__(self, attention: RingAttention):
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
@renamed_args(communicator="group")
def context_parallel(group: CommunicatorLike, *,
                     balanced: Optional[bool] = None) -> Iterator[RingAttention]:
    """Inside this context, ``torch.nn.functional.scaled_dot_product_attention`` runs as ring
    attention over ``group``: a model whose inputs were sharded with :func:`shard`
    computes its attention over the whole sequence without a change to its code. Yields the
    :class:`RingAttention` used."""
    attention = RingAttention(group, balanced=balanced)
    with _RouteAttention(attention):
        yield attention


@renamed_args(communicator="group")
def parallelize(module: nn.Module, group: CommunicatorLike, plan: Sequence[str], *,
                balanced: Optional[bool] = None) -> nn.Module:
    """Makes the attention of the submodules named in ``plan`` (``fnmatch`` patterns such as
    ``"blocks.*.attn"``) context-parallel: their ``F.scaled_dot_product_attention`` calls run as
    ring attention over ``group`` (forward hooks enter and leave :func:`context_parallel`
    around each call). In place; returns ``module``. The model's inputs must be sharded along
    the sequence (:func:`shard`) in the layout ``balanced`` names (default: causal attention's)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize: module must be an nn.Module, got {type(module).__name__}")
    if isinstance(plan, str) or not isinstance(plan, Sequence):
        raise TypeError(f"parallelize: plan must be a sequence of submodule name patterns, got {plan!r}")
    attention = RingAttention(group, balanced=balanced)
    names = [name for name, _ in module.named_modules() if name]
    for pattern in plan:
        matches = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            raise ValueError(f"parallelize: plan entry {pattern!r} matches no submodule of "
                             f"{type(module).__name__}")
        for name in matches:
            _route_attention_of(module.get_submodule(name), attention)
    return module


def _route_attention_of(sub: nn.Module, attention: RingAttention) -> None:
    modes: list = []

    def enter(_module, _args):
        mode = _RouteAttention(attention)
        mode.__enter__()
        modes.append(mode)

    def leave(_module, _args, _output):
        modes.pop().__exit__(None, None, None)

    sub.register_forward_pre_hook(enter)
    sub.register_forward_hook(leave, always_call=True)


__all__ = ["ring_attention", "shard_indices", "shard", "unshard", "RingAttention", "context_parallel",
           "parallelize"]
