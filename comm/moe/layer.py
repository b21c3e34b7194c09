"""The MoE layer (:class:`MoE`, :class:`ExpertMLP`) and the gradient reduction of expert and data
parallelism together (:func:`reduce_gradients`)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..core.group import as_group, check_device
from ..core.group_carrier import HostGroups, resolve_hosts
from ..core.placement import Placement
from .checks import check_capacity, check_experts, positive_int
from .codec import RowQuantizer, codec_of
from .dispatch import DispatchHandle, across_stats, combine_outputs, dispatch_tokens, padded_dispatch
from .routing import capacity, route

# -- the layer -------------------------------------------------------------------------------------

class ExpertMLP(nn.Module):
    """The default expert: ``Linear(d_model, hidden) -> GELU -> Linear(hidden, d_model)``."""

    def __init__(self, d_model: int, hidden: int, device: Any = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.up = nn.Linear(d_model, hidden, device=device, dtype=dtype)
        self.down = nn.Linear(hidden, d_model, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _split_hosts(hierarchical: Any, group: Any) -> Optional[HostGroups]:
    """The group split by host for ``hierarchical`` (None without it)."""
    return resolve_hosts(hierarchical, group, "MoE: ")


class MoE(nn.Module):
    """A mixture-of-experts layer with its experts split over a group (expert parallelism).

    Args:
        d_model: the tokens' width (``x``'s last dimension).
        num_experts: E, a multiple of the group's size N; rank r holds experts
            ``[r E / N, (r + 1) E / N)`` as ``self.experts`` (an ``nn.ModuleList``, in order).
        expert: a callable returning one expert module (called E / N times here), mapping
            (n, d_model) to (n, d_model); default :class:`ExpertMLP` with ``hidden`` (default
            4 d_model).
        top_k: experts per token.
        group: a braid Communicator, a torch ProcessGroup or None (the default group), resolved
            now: the layer builds only its rank's experts.
        router: an ``nn.Linear(d_model, E, bias=False)`` to use instead of a new one. The router
            is replicated: build it from the same seed on every rank (or broadcast it).
        normalize_topk, capacity_factor, drop_policy, aux_loss_coeff, z_loss_coeff: routing
            (:func:`route`, module docstring).
        bias_update_rate: > 0 turns on auxiliary-loss-free balancing; training forwards count
            each expert's load, :meth:`update_expert_bias` moves the bias.
        hierarchical: False, True (split the group by host now, collectively: a Communicator by
            ``split_by_host()``, a ProcessGroup by ``group_carrier.host_groups``) or a
            ``HostGroups``: each token crosses to a host once.
        dispatch_compression: None, "int8" or "fp8" (:class:`RowQuantizer`).

    ``forward(x)`` returns ``(y, aux)``: ``y`` shaped as ``x``, ``aux`` the sum of the enabled
    routing losses on this rank's tokens (add it to the loss). :meth:`stats` describes the last
    forward. Every rank of the group runs every forward and backward of the layer.
    """

    def __init__(self, d_model: int, num_experts: int, expert: Optional[Callable[[], nn.Module]] = None, *,
                 top_k: int = 2, group: Any = None, hidden: Optional[int] = None,
                 router: Optional[nn.Linear] = None, normalize_topk: bool = True,
                 capacity_factor: Optional[float] = None, drop_policy: str = "probs",
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, bias_update_rate: float = 0.0,
                 hierarchical: Union[bool, HostGroups] = False,
                 dispatch_compression: Union[None, str, RowQuantizer] = None,
                 pad_to_capacity: bool = False,
                 device: Any = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        where = "MoE"
        positive_int(d_model, "d_model", where)
        g = as_group(group, "group", where)
        n, rank = g.world_size, g.rank
        check_experts(num_experts, top_k, n, where)
        check_capacity(capacity_factor, drop_policy, where)
        if not isinstance(pad_to_capacity, bool):
            raise TypeError(f"{where}: pad_to_capacity must be a bool, got {type(pad_to_capacity).__name__}")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError(f"{where}: pad_to_capacity=True needs a capacity_factor (the rows each expert "
                             f"gets from each rank)")
        if pad_to_capacity and hierarchical is not False:
            raise ValueError(f"{where}: pad_to_capacity=True is a flat dispatch; it does not combine with "
                             f"hierarchical={hierarchical!r}")
        for name, value in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff),
                            ("bias_update_rate", bias_update_rate)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{where}: {name} must be a number >= 0, got {value!r}")
        if not isinstance(normalize_topk, bool):
            raise TypeError(f"{where}: normalize_topk must be a bool, got {type(normalize_topk).__name__}")
        if router is None:
            router = nn.Linear(d_model, num_experts, bias=False, device=device, dtype=dtype)
        if not isinstance(router, nn.Linear) or router.bias is not None \
                or (router.in_features, router.out_features) != (d_model, num_experts):
            raise ValueError(f"{where}: router must be an nn.Linear({d_model}, {num_experts}, bias=False), "
                             f"got {router!r}")
        if expert is None:
            width = hidden if hidden is not None else 4 * d_model
            positive_int(width, "hidden", where)

            def expert():
                return ExpertMLP(d_model, width, device=device, dtype=dtype)
        elif not callable(expert):
            raise TypeError(f"{where}: expert must be a callable returning an nn.Module, got "
                            f"{type(expert).__name__}")
        local = num_experts // n
        made = [expert() for _ in range(local)]
        for i, m in enumerate(made):
            if not isinstance(m, nn.Module):
                raise TypeError(f"{where}: expert() must return an nn.Module, returned {type(m).__name__} "
                                f"(for expert {rank * local + i})")
        self.group = g
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.first_expert = rank * local
        self.router = router
        self.experts = nn.ModuleList(made)
        self.normalize_topk = normalize_topk
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.bias_update_rate = float(bias_update_rate)
        self.codec = codec_of(dispatch_compression, where)
        self.pad_to_capacity = pad_to_capacity
        self.hosts = _split_hosts(hierarchical, g)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if bias_update_rate else None)
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64, device=device)
                             if bias_update_rate else None, persistent=False)
        self._layout: Optional[Placement] = None
        self._stats: Optional[dict] = None

    @classmethod
    def from_dense(cls, router: nn.Linear, experts: Sequence[nn.Module], group: Any = None, *, top_k: int = 2,
                   **kwargs: Any) -> "MoE":
        """The layer holding this rank's share of ``experts`` (all E of them, in order; the modules
        themselves are kept, not copied) with ``router`` (``nn.Linear(d, E, bias=False)``).
        Keywords as :class:`MoE`'s."""
        if not isinstance(router, nn.Linear):
            raise TypeError(f"MoE.from_dense: router must be an nn.Linear, got {type(router).__name__}")
        experts = list(experts)
        if len(experts) != router.out_features:
            raise ValueError(f"MoE.from_dense: experts holds {len(experts)} modules, the router routes to "
                             f"{router.out_features}")
        g = as_group(group, "group", "MoE.from_dense")
        check_experts(len(experts), top_k, g.world_size, "MoE.from_dense")
        local = len(experts) // g.world_size
        mine = iter(experts[g.rank * local:(g.rank + 1) * local])
        return cls(router.in_features, len(experts), lambda: next(mine), top_k=top_k, group=g, router=router,
                   **kwargs)

    @property
    def local_experts(self) -> range:
        """The global numbers of this rank's experts."""
        return range(self.first_expert, self.first_expert + len(self.experts))

    def forward(self, x: torch.Tensor) -> tuple:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 \
                or x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: x must be a floating tensor of shape (..., d_model={self.d_model}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        check_device(self.group, x.device, "MoE: the tokens (x)")
        tokens = x.reshape(-1, self.d_model)
        if self._layout is None:  # collective, once: every rank runs its first forward together
            layout = Placement(self.group, x.device, self.hosts, tokens.shape[0])
            if self.pad_to_capacity and len(set(layout.tokens)) > 1:
                raise ValueError(f"MoE: pad_to_capacity=True needs the same number of tokens on every rank "
                                 f"(x holds {tokens.shape[0]} here; by rank: {layout.tokens}); checked at "
                                 "the first forward")
            self._layout = layout
        rdtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(tokens.to(rdtype), self.router.weight.to(rdtype))
        r = route(logits, self.top_k, normalize_topk=self.normalize_topk,
                  capacity_factor=self.capacity_factor, drop_policy=self.drop_policy,
                  expert_bias=self.expert_bias, aux_loss_coeff=self.aux_loss_coeff,
                  z_loss_coeff=self.z_loss_coeff)
        if self.expert_load is not None and self.training:
            self.expert_load += r.tokens_per_expert.to(self.expert_load.device)
        if self.pad_to_capacity:
            cap = capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            inputs, counts, state = padded_dispatch(tokens, r.expert_ids, r.weights, self.group,
                                                     self.num_experts, self.codec, cap)
            handle = DispatchHandle(tokens.shape, tokens.dtype, counts,
                                    [self.group.world_size * cap] * len(self.experts))
            handle._hops = [("padded", state)]
        else:
            inputs, handle = dispatch_tokens(tokens, r.expert_ids, r.weights, self.group, self.num_experts,
                                       self.codec, self._layout)
        outputs = torch.cat([e(chunk) for e, chunk in zip(self.experts, inputs.split(handle.counts))])
        y = combine_outputs(outputs, handle)
        # Kept as tensors (stats() reads them): a forward copies nothing from the device to the host.
        self._stats = {"tokens": tokens.shape[0], "tokens_per_expert": r.tokens_per_expert.detach(),
                       "dropped": r.dropped_count, "expert_tokens": handle.counts,
                       "aux_loss": r.aux_loss.detach(), "z_loss": r.z_loss.detach(),
                       "across_hosts": handle._across}
        return y.reshape(x.shape), r.aux_loss + r.z_loss

    def stats(self) -> Optional[dict]:
        """The last forward on this rank: ``tokens``; ``tokens_per_expert`` (E assignments routed
        per expert, before drops); ``dropped`` (assignments over capacity); ``expert_tokens``
        (rows each local expert computed, from every rank); ``aux_loss`` and ``z_loss``;
        ``across_hosts`` (:meth:`DispatchHandle.stats`: rows and bytes this rank sent to other
        hosts, with the lower bound). None before the first forward."""
        if self._stats is None:
            return None
        s = dict(self._stats)
        s.update(tokens_per_expert=s["tokens_per_expert"].tolist(), dropped=int(s["dropped"]),
                 aux_loss=float(s["aux_loss"]), z_loss=float(s["z_loss"]),
                 across_hosts=across_stats(s["across_hosts"]))
        return s

    @torch.no_grad()
    def update_expert_bias(self, group: Any = None) -> Optional[torch.Tensor]:
        """Auxiliary-loss-free balancing (DeepSeek-V3): sums the loads counted since the last
        update over ``group`` (default the layer's; pass the whole job's group where the router is
        replicated beyond the expert-parallel group, as with data parallelism) in one all-reduce,
        and moves each expert's bias by ``bias_update_rate * sign(mean load - load)``. Call it once
        per optimizer step, on every rank. Returns the summed loads (None when the bias is off)."""
        if self.expert_bias is None:
            return None
        g = self.group if group is None else as_group(group, "group", "MoE.update_expert_bias")
        load = self.expert_load.clone()
        g.all_reduce(load)
        f = load.to(torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(f.mean() - f)
        self.expert_load.zero_()
        return load

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, local experts "
                f"{self.first_expert}..{self.first_expert + len(self.experts) - 1}, group={self.group!r}"
                + (f", capacity_factor={self.capacity_factor}" if self.capacity_factor else "")
                + (", hierarchical" if self.hosts is not None else "")
                + (f", dispatch_compression={self.codec.fmt!r}" if self.codec else ""))


# -- expert and data parallelism together ----------------------------------------------------------

def expert_parameters(module: nn.Module) -> list:
    """The parameters of every MoE layer's experts in ``module`` (held by some ranks only)."""
    seen: set = set()
    out = []
    for m in module.modules():
        if isinstance(m, MoE):
            for p in m.experts.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def _all_reduce_grads(params: Iterable[nn.Parameter], group: Any, divisor: int) -> None:
    """Sums the gradients over ``group`` (one flat all-reduce per dtype), divided by ``divisor``."""
    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        group.all_reduce(flat)
        flat.div_(divisor)
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()


def reduce_gradients(module: nn.Module, group: Any, expert_group: Any, *, dense: bool = True) -> None:
    """Expert parallelism inside data parallelism: averages every gradient of ``module`` over the
    whole job, its ``group`` (all ranks, W of them, each with its own tokens).

    Gradients of the experts (:func:`expert_parameters`) are summed over ``expert_group``, the
    ranks holding the same experts (one per expert-parallel group), the others over ``group``;
    both are divided by W: an expert's gradient already sums the tokens of its whole
    expert-parallel group (the dispatch brought them), so this is the gradient of the mean loss
    over all ranks, as data parallelism over W dense replicas gives. For W = EP x DP ranks with
    expert-parallel groups of consecutive ranks, ``expert_group`` of rank r holds ranks
    ``r % EP, r % EP + EP, ...``. ``dense=False`` leaves the other gradients alone (DDP over
    ``group`` reduces them, the experts' parameters ignored by it). Call it after the backward,
    before the optimizer step, on every rank."""
    g = as_group(group, "group", "reduce_gradients")
    eg = as_group(expert_group, "expert_group", "reduce_gradients")
    experts = expert_parameters(module)
    mine = {id(p) for p in experts}
    if dense:
        _all_reduce_grads([p for p in module.parameters() if id(p) not in mine], g, g.world_size)
    _all_reduce_grads(experts, eg, g.world_size)
