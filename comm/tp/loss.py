"""Cross-entropy over logits split by vocabulary across the tensor-parallel ranks (Megatron style).

A column-parallel output head (``ColumnParallelLinear(h, V, gather_output=False)``) leaves each
rank the logits of its V / N vocabulary entries, rank r holding entries [r V/N, (r+1) V/N).
Gathering them (``gather_output=True``) makes every rank hold, and differentiate, all V logits of
every token; :func:`vocab_parallel_cross_entropy` instead computes the loss from the slices with
three all-reduces of one value per token (the maximum, the sum of exponentials, the target's logit)
and never gathers a logit: each rank's memory and work for the loss are 1/N of the gathered form.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from ..core.group import as_group, renamed_args

REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Any, ignore_index: int,
                reduction: str) -> torch.Tensor:
        per_rank = logits.shape[-1]
        start = group.rank * per_rank
        x = logits.float()
        # The row maximum over every rank's slice keeps exp() in range (one all-reduce, max).
        top = x.amax(dim=-1)
        if group.world_size > 1:
            group.all_reduce(top, "max")
        x = x - top.unsqueeze(-1)
        exp = x.exp()
        total = exp.sum(dim=-1)
        valid = target != ignore_index
        local = target - start
        mine = (local >= 0) & (local < per_rank) & valid
        index = torch.where(mine, local, torch.zeros_like(local))
        picked = x.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        if group.world_size > 1:
            # the two sums in one call: the sum of exponentials and the target's (shifted) logit
            both = torch.stack([total, picked])
            group.all_reduce(both, "sum")
            total, picked = both[0], both[1]
        loss = (total.log() - picked) * valid
        count = valid.sum()
        ctx.save_for_backward(exp, total, index, mine, valid, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        if reduction == "mean":
            return loss.sum() / count  # nan when no token counts, as F.cross_entropy
        if reduction == "sum":
            return loss.sum()
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        exp, total, index, mine, valid, count = ctx.saved_tensors
        # d loss / d logit_v = softmax_v - [v is the target], per counted token
        g = exp / total.unsqueeze(-1)
        g.scatter_add_(-1, index.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        # mean: grad / count for every token; sum: the scalar grad; none: each token's own
        scale = valid.to(g.dtype) * (grad.float() / count if ctx.reduction == "mean" else grad.float())
        g.mul_(scale.unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None


@renamed_args(communicator="group")
def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any = None, *,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` of logits split by vocabulary over ``group``'s ranks.

    Args:
        logits: (..., V / N), this rank's slice of the vocabulary: entries [rank V/N, (rank+1) V/N),
            as ``ColumnParallelLinear(..., gather_output=False)`` leaves them; any float dtype (the
            loss is computed in float32, the gradient returned in the logits' dtype).
        target: (...) int64 class indices over the whole vocabulary, the same on every rank.
        group: the tensor-parallel group (a braid Communicator, a ProcessGroup, or None for the
            default group); every rank calls this with its slice.
        ignore_index: targets equal to it count for nothing (and not in the mean).
        reduction: "mean" (over the counted tokens), "sum" or "none" (per token).

    Returns the same value on every rank, equal to ``F.cross_entropy`` of the gathered logits to
    float32 rounding; the gradient reaches each rank's slice only."""
    g = as_group(group, "group", "vocab_parallel_cross_entropy")
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError("vocab_parallel_cross_entropy: logits must be a floating-point tensor of "
                        f"shape (..., vocabulary / ranks), got {logits!r:.80}")
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64:
        raise TypeError("vocab_parallel_cross_entropy: target must be an int64 tensor of class indices, "
                        f"got {getattr(target, 'dtype', type(target).__name__)}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: target's shape {tuple(target.shape)} must be "
                         f"logits' without the last dimension, {tuple(logits.shape[:-1])}")
    if target.device != logits.device:
        raise ValueError(f"vocab_parallel_cross_entropy: target is on {target.device}, logits on "
                         f"{logits.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be one of {REDUCTIONS}, "
                         f"got {reduction!r}")
    if logits.device.type == "cpu":  # a CUDA check would wait for the device; torch's asserts there
        vocab = logits.shape[-1] * g.world_size
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
        if bool(bad.any()):
            raise IndexError(f"vocab_parallel_cross_entropy: target {int(target[bad][0])} is outside the "
                             f"vocabulary [0, {vocab})")
    return _VocabParallelCrossEntropy.apply(logits, target, g, int(ignore_index), reduction)
