"""Routing: softmax, top-k, capacity and drops (:func:`route`, :class:`Routing`)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from .checks import check_capacity, positive_int


# -- routing ---------------------------------------------------------------------------------------

class Routing:
    """The router's decision for a batch of tokens (:func:`route`).

    ``expert_ids`` (T, k) int64, -1 where the assignment was dropped; ``weights`` (T, k) the
    combine weights (differentiable; a dropped assignment's weight is kept but unused);
    ``tokens_per_expert`` (E,) assignments per expert before drops; ``dropped`` their number
    dropped; ``aux_loss`` and ``z_loss`` scalar tensors (zero when their coefficient is)."""

    def __init__(self, expert_ids, weights, tokens_per_expert, dropped, aux_loss, z_loss):
        self.expert_ids, self.weights = expert_ids, weights
        self.tokens_per_expert, self.dropped_count = tokens_per_expert, dropped
        self.aux_loss, self.z_loss = aux_loss, z_loss

    @property
    def dropped(self) -> int:
        """The number of assignments dropped (reading it copies ``dropped_count``, a tensor on the
        logits' device, to the host)."""
        return int(self.dropped_count)


def count_per(index: torch.Tensor, n: int) -> torch.Tensor:
    """How many times each of 0..n-1 occurs in ``index`` (torch.bincount, without the device-to-host
    copy of its maximum on a GPU)."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(
        0, index, torch.ones_like(index, dtype=torch.int64))


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments each expert keeps of ``tokens`` tokens: ``ceil(capacity_factor * tokens * top_k /
    num_experts)``."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def _keep(expert: torch.Tensor, weight: torch.Tensor, num_experts: int, cap: int,
          drop_policy: str) -> torch.Tensor:
    """Which of the assignments (``expert``, ``weight``: flat, token-major) fit their expert's
    capacity ``cap``: per expert the highest weights ("probs") or the first tokens ("position"),
    the earlier token first among equals."""
    order = torch.arange(expert.numel(), device=expert.device)
    if drop_policy == "probs":
        order = torch.argsort(-weight, stable=True)
    order = order[torch.argsort(expert[order], stable=True)]    # by expert, priority within
    counts = count_per(expert, num_experts)
    first = torch.cumsum(counts, 0) - counts
    position = torch.arange(expert.numel(), device=expert.device) - first[expert[order]]
    keep = torch.empty_like(expert, dtype=torch.bool)
    keep[order] = position < cap
    return keep


def route(logits: torch.Tensor, top_k: int, *, normalize_topk: bool = True,
          capacity_factor: Optional[float] = None, drop_policy: str = "probs",
          expert_bias: Optional[torch.Tensor] = None, aux_loss_coeff: float = 0.0,
          z_loss_coeff: float = 0.0) -> Routing:
    """Routes tokens from the router's ``logits`` (T, E), computed in their dtype (the MoE layer
    passes float32, or float64 for float64 models): softmax, top-k of the probabilities plus
    ``expert_bias`` (selection only), weights the selected probabilities, renormalised to sum to 1
    when ``normalize_topk``; capacity, drops and losses as the module docstring says."""
    where = "route"
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"{where}: logits must be a floating tensor of shape (tokens, num_experts), "
                        f"got {got}")
    if logits.dim() != 2:
        raise ValueError(f"{where}: logits must have shape (tokens, num_experts), got shape "
                         f"{tuple(logits.shape)}")
    t, e = logits.shape
    positive_int(top_k, "top_k", where)
    if top_k > e:
        raise ValueError(f"{where}: top_k={top_k} is larger than the {e} experts")
    check_capacity(capacity_factor, drop_policy, where)
    probs = torch.softmax(logits, dim=-1)
    scores = probs.detach() if expert_bias is None else probs.detach() + expert_bias.to(probs.dtype)
    ids = torch.topk(scores, top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if normalize_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    tokens_per_expert = count_per(ids.reshape(-1), e)
    dropped = torch.zeros((), dtype=torch.int64, device=logits.device)
    if capacity_factor is not None and t:
        keep = _keep(ids.reshape(-1), weights.detach().reshape(-1), e,
                     capacity(t, top_k, e, capacity_factor), drop_policy).view(t, top_k)
        dropped = (~keep).sum()
        ids = torch.where(keep, ids, -1)
    zero = logits.new_zeros(())
    aux = zero
    if aux_loss_coeff and t:
        f = tokens_per_expert.to(probs.dtype) / (t * top_k)
        aux = aux_loss_coeff * e * (f * probs.mean(0)).sum()
    z = zero
    if z_loss_coeff and t:
        z = z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
    return Routing(ids, weights, tokens_per_expert, dropped, aux, z)
