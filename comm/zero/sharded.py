"""braid's sharded data-parallel wrapper (ZeRO stages 1-3) on flat padded buckets and async braid collectives.

The wrapped module's parameters live in flat padded buckets, grouped by unit; rank r keeps the
r-th slice of every bucket as a ``torch.nn.Parameter`` of the wrapper, the only parameters
``wrapper.parameters()`` yields, so an optimizer built on them keeps 1/N of the state (layout.py).
The module's forward and autograd hooks issue the collectives: all-gathers of the parameters
where the stage needs them, an async reduce-scatter (braid's average) of each bucket's gradient
as soon as the backward completes it (schedule.py). State dicts gather the shards or keep this
rank's slices (state.py).

Stages.
- 1: full parameters on every rank; the full gradient buffers are kept between steps (zeroed
  after each reduction and accumulated into again, as DDP keeps its buckets); optimizer state
  1/N. Gradients are reduce-scattered, not all-reduced: a rank only updates its shard, and the
  updated shards are all-gathered before the next forward, which moves the bytes of one
  all-reduce per step in all.
- 2: as 1, but the full gradient buffer is released as soon as its reduce-scatter is done.
- 3: parameters too: a unit's buckets are all-gathered before its forward and again before its
  backward, the next unit prefetched, and freed after the forward (``reshard_after_forward``)
  and after the unit's gradients are ready.

``gather_params()`` refreshes the module's parameters between the optimizer step and the next
forward, for code that reads them there or that changed shards through ``.data``. Every
collective is issued by every rank in the same order: ranks must run the same forward and
backward (the same units, the same parameters used), as with DDP.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from ..compression.adaptive import COLLECTIVE_CANDIDATES, EXACT, REDUCE_SCATTER, Adaptive
from ..compression import BlockQuantizer
from ..core.group import as_group, check_device, renamed_args
from ..core.group_carrier import HostGroups, resolve_hosts
from ..core.wire import WireStats
from ..core.vocabulary import WIRE_DTYPES
from . import state
from .layout import REDUCE_DTYPES, Unit, collect_parameters, fill, plan_buckets, resolve_units
from .schedule import Schedule, grad_key

_MB = 1 << 20


def _check_args(module: Any, stage: Any, bucket_cap_mb: Any, reshard_after_forward: Any,
                prefetch: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, ShardedModule):
        raise ValueError("module is already a ShardedModule")
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number, got {type(bucket_cap_mb).__name__}")
    if not (bucket_cap_mb > 0 and math.isfinite(bucket_cap_mb)):
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"prefetch must be an int, got {type(prefetch).__name__}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")


def _hosts_of(hierarchical: Any, group: Any, stage: Any, reshard_after_forward: Any,
              grad_compression: Any) -> Optional[HostGroups]:
    """The group split by host for ``hierarchical`` (None without it)."""
    if hierarchical is False:
        return None
    if not isinstance(hierarchical, (bool, HostGroups)):
        raise TypeError(f"hierarchical must be a bool or a HostGroups, got {type(hierarchical).__name__}")
    if not (stage == 3 and reshard_after_forward) and grad_compression is None:
        raise ValueError(f"hierarchical needs stage=3 with reshard_after_forward=True (hpZ: a host-local "
                         f"copy of the weights a forward frees, for the backward's gather) or a "
                         f"grad_compression (reduce-scatters exact inside a host, compressed across); got "
                         f"stage={stage}, reshard_after_forward={reshard_after_forward}, no grad_compression")
    return resolve_hosts(hierarchical, group)


def _check_compression(param_compression: Any, grad_compression: Any, stage: Any) -> None:
    if grad_compression is not None and not isinstance(grad_compression, (BlockQuantizer, Adaptive)):
        raise TypeError("grad_compression must be None or a block quantizer (braid.comm.Int8Quantizer, "
                        f"Int4Quantizer or FP8Quantizer) or a braid.comm.Adaptive, got "
                        f"{type(grad_compression).__name__}: the reduce-scatter sends every rank one "
                        "quantized piece (use mp_policy's reduce_dtype for 16-bit reductions, or Adaptive "
                        "to choose per bucket)")
    if isinstance(grad_compression, Adaptive):
        carried = [c for c in grad_compression.candidates
                   if c != EXACT and c in COLLECTIVE_CANDIDATES[REDUCE_SCATTER]]
        if not carried:
            raise ValueError(f"grad_compression: an Adaptive with candidates {grad_compression.candidates} "
                             "leaves the reduce-scatter nothing but exact (top-k travels in all-reduces "
                             "only): add any of bf16, fp16, int8, int4, or pass grad_compression=None")
    if param_compression is None:
        return
    if not isinstance(param_compression, BlockQuantizer):
        raise TypeError("param_compression must be None or a block quantizer (braid.comm.Int8Quantizer, "
                        f"Int4Quantizer or FP8Quantizer), got {type(param_compression).__name__}: weights "
                        "are gathered whole, so top-k cannot carry them (use mp_policy's param_dtype for "
                        "16-bit gathers)")
    if stage != 3:
        raise ValueError(f"param_compression needs stage=3, got stage={stage}: at ZeRO stages 1 and 2 the "
                         "full parameters persist and the optimizer updates them in place, so quantized "
                         "gathers would overwrite the master weights")


def _blocks(q: Any) -> list:
    """The quantization blocks pieces compressed by ``q`` come in (an Adaptive: each of its block
    quantizers')."""
    if isinstance(q, Adaptive):
        return [c.block for c in q.compressors.values() if isinstance(c, BlockQuantizer)]
    return [] if q is None else [q.block]


class MixedPrecision:
    """The dtypes a sharded module computes and reduces in (FSDP2's ``MixedPrecisionPolicy``;
    that class is accepted too). The optimizer's shards keep the parameters' own dtype (float32
    master weights); ``param_dtype`` is what the full parameters are gathered and computed in,
    ``reduce_dtype`` what gradients are reduce-scattered in (default: ``param_dtype``),
    ``output_dtype`` what the forward's floating-point outputs are cast to (default: left as they
    are), and ``cast_forward_inputs`` casts the forward's floating-point inputs to
    ``param_dtype``. Applies to floating-point parameters."""

    def __init__(self, param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None,
                 output_dtype: Optional[torch.dtype] = None, cast_forward_inputs: bool = True):
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                            ("output_dtype", output_dtype)):
            if value is not None and value not in REDUCE_DTYPES:
                raise ValueError(f"mp_policy.{name} must be None or one of "
                                 f"{', '.join(map(str, REDUCE_DTYPES))}, got {value!r}")
        if not isinstance(cast_forward_inputs, bool):
            raise TypeError(f"mp_policy.cast_forward_inputs must be a bool, got {cast_forward_inputs!r}")
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.output_dtype, self.cast_forward_inputs = output_dtype, cast_forward_inputs

    @classmethod
    def of(cls, policy: Any) -> Optional["MixedPrecision"]:
        """``policy`` (None, a MixedPrecision, or FSDP2's MixedPrecisionPolicy) as a MixedPrecision."""
        if policy is None or isinstance(policy, cls):
            return policy
        if all(hasattr(policy, a) for a in ("param_dtype", "reduce_dtype", "output_dtype",
                                             "cast_forward_inputs")):
            return cls(policy.param_dtype, policy.reduce_dtype, policy.output_dtype,
                       policy.cast_forward_inputs)
        raise TypeError("mp_policy must be None, a braid.comm.zero.MixedPrecision or a "
                        f"torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}")

    def dtypes(self, dtype: torch.dtype) -> tuple:
        """(compute, reduce) dtypes of a bucket of ``dtype``."""
        if not dtype.is_floating_point:
            return dtype, dtype
        compute = self.param_dtype or dtype
        return compute, self.reduce_dtype or compute

    def __repr__(self) -> str:
        return (f"MixedPrecision(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}, "
                f"output_dtype={self.output_dtype}, cast_forward_inputs={self.cast_forward_inputs})")


def _cast_floats(tree: Any, dtype: Optional[torch.dtype]) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree
    from torch.utils._pytree import tree_map

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return tree_map(cast, tree)


class ShardedModule(nn.Module):
    """A module whose parameters, gradients and optimizer state are sharded over the ranks of a
    group: a braid Communicator or any torch ProcessGroup (build with :func:`shard`; the module
    docstring describes the stages).

    ``wrapper(*args)`` runs the module; ``wrapper.parameters()`` are this rank's flat shards (give
    them to any ``torch.optim`` optimizer); ``loss.backward()`` returns with the averaged shard
    gradients in place. The wrapped module stays reachable as ``wrapper.module``.
    """

    @renamed_args(communicator="group")
    def __init__(self, module: nn.Module, group: Any = None, *, stage: int = 3,
                 bucket_cap_mb: float = 25, reshard_after_forward: bool = True, prefetch: int = 1,
                 units: Optional[Sequence[Union[str, nn.Module]]] = None, mp_policy: Any = None,
                 param_compression: Any = None, grad_compression: Any = None,
                 hierarchical: Union[bool, HostGroups] = False, offload_optimizer: bool = False):
        _check_args(module, stage, bucket_cap_mb, reshard_after_forward, prefetch)
        if not isinstance(offload_optimizer, bool):
            raise TypeError("offload_optimizer must be True or False, got "
                            f"{type(offload_optimizer).__name__}")
        _check_compression(param_compression, grad_compression, stage)
        group = as_group(group, "group", "shard")
        hosts = _hosts_of(hierarchical, group, stage, reshard_after_forward, grad_compression)
        policy = MixedPrecision.of(mp_policy)
        super().__init__()
        self.mp_policy = policy
        self.param_compression = param_compression
        self.grad_compression = grad_compression
        self.module = module
        self.communicator = group
        self.stage = stage
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.offload_optimizer = offload_optimizer
        self._keys = list(module.state_dict(keep_vars=True).keys())
        units, root = self._build(resolve_units(module, units), int(bucket_cap_mb * _MB))
        self._schedule = Schedule(group, stage, prefetch, reshard_after_forward, units, root,
                                  self.device, param_compression, grad_compression, hosts)
        self._schedule.install()

    def _build(self, unit_specs: list, cap_bytes: int) -> tuple:
        """Fills the buckets of every unit with rank 0's parameters and broadcasts rank 0's
        buffers; returns the units that hold buckets (the root unit last, when some parameters
        belong to no single unit) and the root unit (or None)."""
        module, c = self.module, self.communicator
        found = collect_parameters(module, unit_specs)
        check_device(c, found.device, "shard: the module's parameters")
        self.device = found.device
        units = [Unit(name, m) for name, m in unit_specs]
        root = Unit("<root>", None)
        members: list[list] = [[] for _ in units]
        root_members = []
        for pid, where in found.units.items():  # parameter order: first appearance in named_modules
            # A parameter used by several units (tied weights) goes to the root unit, which is
            # gathered for the whole forward and backward.
            alone = len(where) == 1 and None not in where
            (members[next(iter(where))] if alone else root_members).append(pid)
        if root_members:
            units.append(root)
        shards = []
        for unit, pids in zip(units, members + [root_members]):
            # Quantized pieces are whole blocks: every shard a multiple of each quantizer's block.
            align = math.lcm(*_blocks(self.param_compression), *_blocks(self.grad_compression), 1)
            for bucket in plan_buckets(found, pids, cap_bytes, c.world_size, align):
                bucket.index = len(shards)
                bucket.compute_dtype, bucket.reduce_dtype = (
                    self.mp_policy.dtypes(bucket.dtype) if self.mp_policy else (bucket.dtype, bucket.dtype))
                fill(bucket, c, keep_full=self.stage != 3, device=found.device,
                     offload=self.offload_optimizer)
                bucket.unit = unit
                unit.buckets.append(bucket)
                shards.append(bucket.shard)
        # The ParameterList makes the shards the wrapper's parameters (and moves with state_dict()).
        self.shards = nn.ParameterList(shards)
        for buf in module.buffers():
            if buf.dtype in WIRE_DTYPES:
                c.broadcast(buf.data, 0)
            else:  # bool, int8, ...: through int64
                wide = buf.data.to(torch.int64)
                c.broadcast(wide, 0)
                buf.data.copy_(wide)
        return [u for u in units if u.buckets], root if root_members else None

    def gather_params(self) -> None:
        """All-gathers every bucket now (ZeRO stages 1, 2), so the module's parameters hold the shards'
        values, including changes made through ``.data``, which the version counters that the
        next forward checks do not see. A collective: every rank calls it. ZeRO stage 3 keeps no
        full parameters: nothing to do."""
        if self.stage != 3:
            self._schedule.gather_all()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mp = self.mp_policy
        if mp is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        out = self._schedule.forward(self.module, args, kwargs)
        return _cast_floats(out, mp.output_dtype) if mp is not None else out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate local gradients in the full
        flat buffers and communicate nothing; the next backward outside reduces the sum (as
        DDP's ``no_sync``). The local buffers are full-size at every stage while they wait."""
        previous, self._schedule.sync = self._schedule.sync, False
        try:
            yield
        finally:
            self._schedule.sync = previous

    def step_in_backward(self, optimizer: Optional[torch.optim.Optimizer], delay: bool = False) -> None:
        """Steps ``optimizer`` (a ``braid.optim`` optimizer over this module's shards) bucket by
        bucket as each bucket's averaged gradient lands in its shard, during the backward that
        synchronizes, while the later buckets' reduce-scatters are in flight: ZeRO-Offload's
        overlap of the optimizer with the backward. The shards end as ``optimizer.step()`` after
        the backward leaves them, bit for bit; call ``zero_grad()`` as usual and not
        ``optimizer.step()`` (it raises). The whole gradient's norm is not known before a shard
        steps, so ``clip_grad_norm_`` cannot be used with it. ``None`` detaches the optimizer
        (``step()`` works again).

        ``delay=True`` (with ``offload_optimizer=True``): ZeRO-Offload's delayed parameter update.
        The step of each shard runs on the host thread while the *next* step's forward and
        backward compute, with the parameters as they were before it: the gradient of step t is
        computed with the parameters of step t - 1 (one step stale), and the optimizer's work
        leaves the critical path entirely instead of only overlapping the backward. The
        gradients go to the optimizer when the backward ends (``.grad`` is then None). Calls
        that read or change the shards between steps (state dicts, ``step_in_backward``,
        ``clip_grad_norm_``) first wait for the delayed steps. The effect on convergence: see
        docs/usage/sharding.md (the ZeRO-Offload paper applies it after some thousands of steps
        of training without it)."""
        if not isinstance(delay, bool):
            raise TypeError(f"delay must be True or False, got {type(delay).__name__}")
        if delay and not self.offload_optimizer:
            raise ValueError("step_in_backward(delay=True) needs offload_optimizer=True: the delayed steps "
                             "run on the host thread of the offloaded optimizer")
        previous = self._schedule.optimizer
        if optimizer is None:
            self._schedule.check_idle("step_in_backward")
            if previous is not None:
                previous.stepped_by = None
            self._schedule.optimizer = None
            self._schedule.delay = False
            return
        steps_params = callable(getattr(optimizer, "step_param", None))
        if not steps_params or not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a braid.optim optimizer (Adam, AdamW, SGD: they step one "
                            f"parameter at a time), got {type(optimizer).__name__}")
        shards = {id(b.shard) for b in self._schedule.buckets() if b.trainable}
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not shards <= owned:
            raise ValueError("step_in_backward: the optimizer must hold every trainable shard of this module "
                             "(build it from module.parameters())")
        self._schedule.check_idle("step_in_backward")
        if previous is not None and previous is not optimizer:
            previous.stepped_by = None
        optimizer.stepped_by = "braid's ZeRO wrapper (step_in_backward)"
        self._schedule.optimizer = optimizer
        self._schedule.delay = delay

    def finish_steps(self) -> None:
        """Waits for the optimizer steps still running on the host thread under
        ``step_in_backward(opt, delay=True)`` (e.g. before saving the optimizer's ``state_dict``);
        the next forward then computes with the parameters they updated. Between steps only."""
        self._schedule.check_idle("finish_steps")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the shard gradients and any local gradient accumulated under ``no_sync``."""
        super().zero_grad(set_to_none)
        for b in self._schedule.buckets():
            self._schedule.drop_local_grad(b)
            b.local_guard = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scales the shard gradients so that the norm of the whole (unsharded) gradient is at
        most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on an unsharded model;
        returns that norm. A collective (one all-reduce of a scalar): every rank calls it."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}")
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
        self._schedule.check_idle("clip_grad_norm_")
        if self._schedule.optimizer is not None:
            raise RuntimeError("clip_grad_norm_ with step_in_backward: the shards were stepped during the "
                               "backward, before the whole gradient's norm was known")
        grads = [b.shard.grad for b in self._schedule.buckets() if b.shard.grad is not None]
        # Where the shard gradients are: the module's device, or host memory (offload_optimizer),
        # whose partial norm travels on the device, where the group serves it.
        where = torch.device("cpu") if self.offload_optimizer else self.device
        # Padding elements have zero gradients (no parameter uses them): they add nothing.
        if norm_type == math.inf:
            local = max((g.abs().max() for g in grads),
                        default=torch.tensor(0.0, device=where)).double().reshape(1).to(self.device)
            self.communicator.all_reduce(local, op="max")
            total = local[0].to(where)
        else:
            local = torch.zeros(1, dtype=torch.float64, device=where)
            for g in grads:
                local += g.double().abs().pow(norm_type).sum()
            local = local.to(self.device)
            self.communicator.all_reduce(local, op="sum")
            total = local[0].to(where).pow(1.0 / norm_type)
        # The scale stays on the device, as torch.nn.utils.clip_grad_norm_'s: the host never waits
        # for the norm (a coefficient clamped to 1 leaves the gradients as they are).
        coef = (max_norm / (total + 1e-6)).clamp_(max=1.0)
        for g in grads:
            g.mul_(coef)
        return total.float()

    # -- state dicts -----------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """The unwrapped module's ``state_dict()``: same keys, full tensors (copies). A collective
        (every rank calls it: each bucket is all-gathered); with ``rank0_only`` the other ranks
        return an empty dict and keep no copy."""
        self._schedule.check_idle("full_state_dict")
        keep = not rank0_only or self.communicator.rank == 0
        buckets = list(self._schedule.buckets())
        return state.full_state_dict(buckets, self.communicator, self.module, self._keys, keep)

    def sharded_state_dict(self) -> dict:
        """This rank's part of the state: the unwrapped module's keys; a parameter's value is the
        slice of its flattened elements that this rank's shards hold (1-D, maybe empty), so the
        slices of ranks 0..N-1 concatenated give the flattened parameter; buffers are whole."""
        self._schedule.check_idle("sharded_state_dict")
        buckets = list(self._schedule.buckets())
        return state.sharded_state_dict(buckets, self.communicator.rank, self.module, self._keys)

    def load_full_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Loads an unwrapped module's ``state_dict()`` (every rank passes it whole): each rank
        keeps its slices. With ``strict`` the keys must match exactly."""
        self._load(state_dict, strict, full=True)

    def load_sharded_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Loads what :meth:`sharded_state_dict` returned on this rank (same world size)."""
        self._load(state_dict, strict, full=False)

    def _load(self, state_dict: dict, strict: bool, full: bool) -> None:
        self._schedule.check_idle("load_state_dict")
        buckets = list(self._schedule.buckets())
        for b in buckets:  # hpZ's host copies hold the old weights
            b.secondary = None
        state.load(buckets, self.communicator.rank, self.module, self._keys, state_dict, strict, full)
        self.gather_params()

    # -- accounting --------------------------------------------------------------------------
    def wire_stats(self, reset: bool = True) -> dict:
        """Bytes this rank sent and received in the all-gathers and the reduce-scatters since the
        last call (or construction): ``{"all_gather", "all_gather_in_host", "reduce_scatter",
        "reduce_scatter_in_host": WireStats}`` (the ``_in_host`` ones: ``hierarchical``'s
        exchanges inside this rank's host; the others cross the whole group, or with
        ``hierarchical`` qgZ the hosts), ``dense`` being what they would move uncompressed.
        ``reset`` starts the next count."""
        stats = dict(self._schedule.wire)
        if reset:
            self._schedule.wire = {k: WireStats(0, 0, 0) for k in stats}
        return stats

    def memory_stats(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
        """Bytes this rank holds now for parameters (shards and live full buffers), gradients
        (shard gradients and live full-size ones), with ``grad_compression`` its error-feedback
        residuals, and, given the optimizer, its state tensors. With ``offload_optimizer`` the
        master shards, their gradients and the optimizer's state are in host memory: counted
        under ``"offloaded"``, and ``"params"`` counts the shards' images on the device instead.
        Storage shared by several tensors is counted once."""
        seen: set = set()

        def size(tensors: Iterable[Optional[torch.Tensor]]) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                if st.nbytes() and st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
            return total

        buckets = list(self._schedule.buckets())
        resident = [b for b in buckets if b.on_device is None]
        offloaded = [b for b in buckets if b.on_device is not None]
        stats = {
            "params": size([b.shard for b in resident] + [b.on_device for b in offloaded]
                           + [b.full for b in buckets] + [b.secondary for b in buckets]),
            "grads": size([b.shard.grad for b in resident] + [b.full.grad for b in buckets]
                          + [p[3] for p in self._schedule.pending]),
        }
        q = self.grad_compression
        if q is not None:  # qgZ's error-feedback residuals, one per bucket
            stats["residuals"] = size(q.residual(grad_key(b)) for b in buckets)
        state_tensors = [] if optimizer is None else [
            t for entry in optimizer.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]
        if self.offload_optimizer:
            stats["offloaded"] = size([b.shard for b in offloaded] + [b.shard.grad for b in offloaded]
                                      + [b.grad_staging for b in offloaded] + state_tensors)
        elif optimizer is not None:
            stats["optimizer"] = size(state_tensors)
        return stats

    @property
    def unit_names(self) -> list:
        """The units, in construction order (``<root>`` for the root unit)."""
        return [u.name for u in self._schedule.units]


@renamed_args(communicator="group")
def shard(module: nn.Module, group: Any = None, *, stage: int = 3, bucket_cap_mb: float = 25,
          reshard_after_forward: bool = True, prefetch: int = 1,
          units: Optional[Sequence[Union[str, nn.Module]]] = None, mp_policy: Any = None,
          param_compression: Any = None, grad_compression: Any = None,
          hierarchical: Union[bool, HostGroups] = False, offload_optimizer: bool = False) -> ShardedModule:
    """Wraps ``module`` for sharded data-parallel training on ``group`` (ZeRO ``stage`` 1,
    2 or 3; see the module docstring of ``braid.comm.zero.sharded``).

    Args:
        module: the model, on one device (CPU, or a GPU over a group that serves it: NCCL, braid
            built with CUDA, gloo through host memory), the same architecture on every rank;
            rank 0's parameters and buffers are broadcast to the others (as DDP). Flat buffers,
            shards and gradients live on that device.
        group: the data-parallel group: a ``braid.comm.Communicator``, any
            ``torch.distributed.ProcessGroup``, or None (the default process group).
        stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters.
        bucket_cap_mb: largest flat bucket (MiB); one collective per bucket.
        reshard_after_forward: ZeRO stage 3: free a unit's full parameters after its forward (and
            gather them again for its backward), or keep them until its backward is done.
        prefetch: how many units ahead to all-gather while the current one computes (at most
            two all-gathers are in flight whatever the value).
        units: the submodules (or their names) whose parameters are gathered together; default:
            each top-level child (the children of a top-level ModuleList/ModuleDict).
        mp_policy: mixed precision (:class:`MixedPrecision`, or FSDP2's
            ``MixedPrecisionPolicy``): e.g. ``param_dtype=torch.bfloat16`` gathers and computes in
            bfloat16 while the optimizer's shards stay float32, and ``reduce_dtype=torch.float32``
            reduces gradients in float32.
        param_compression: ZeRO stage 3: gather the weights block-quantized (ZeRO++'s qwZ):
            ``comm.Int8Quantizer(block=...)`` (3.9x fewer bytes than float32) or
            ``comm.Int4Quantizer(...)``. Each rank quantizes its shard once per gather, rounding
            to nearest (the quantizer's ``stochastic``, ``error_feedback`` and ``seed`` do not
            apply to weights), and every rank decodes the same bytes, so the gathered weights
            are identical everywhere; the optimizer's shards and ``full_state_dict()`` stay exact.
            Shards are padded to whole quantization blocks.
        grad_compression: reduce-scatter the gradients block-quantized (ZeRO++'s qgZ), at any
            stage: ``comm.Int4Quantizer()`` or ``Int8Quantizer()``. Each rank quantizes its
            bucket gradient once into one piece per rank (error feedback: what the rounding
            dropped is added to the next step's gradient, a float32 residual of the bucket's
            size kept in the compressor, checkpointed with ``q.state_dict()``), the pieces go by
            an all-to-all, and each rank decodes its pieces and sums them in rank order in
            float32. The compressor's first ``warmup_steps`` reductions of each bucket are exact.
            To resume a run bit for bit, save and load ``grad_compression.state_dict()`` (its
            residuals and call counts) with the sharded state and the optimizer's.
            ``comm.Adaptive()`` chooses per bucket, from what it measures while training, among
            exact, bf16 / fp16 pieces and int8 / int4 ones (top-k is for all-reduces), the same on
            every rank (``grad_compression.decisions()``, keyed ``("braid.fsdp.grad", bucket
            index)``): exact on one host; its warm-up steps are exact; its state dict holds the
            decisions and residuals. Shards are padded to whole blocks of its quantizers.
        hierarchical: the group split by host. At ZeRO stage 3 with ``reshard_after_forward``
            (ZeRO++'s hpZ): after a unit's forward each rank keeps its piece of the unit's
            weights for its host (1 / ranks-per-host of them, reported by ``memory_stats``),
            and the backward gathers them inside the host: that gather never crosses hosts.
            With ``grad_compression`` (any stage; hierarchical qgZ): the gradients are summed
            exactly inside the host (float32) and only the cross-host exchange is quantized
            (an Adaptive's choice across hosts), one quantization per host
            (``wire_stats()["reduce_scatter_in_host"]`` counts the host's traffic). True splits
            a ProcessGroup (or None) by host identity with ``group_carrier.host_groups`` and a
            Communicator with its ``split_by_host()``, collectives over the whole job (every
            rank calls ``shard``); or pass a ``HostGroups``.
        offload_optimizer: ZeRO-Offload, at any stage: the shards that ``parameters()`` yields
            (the float32 masters, hence the optimizer's state) live in host memory, pinned when
            the module is on a GPU; the device keeps only each shard's image in the compute
            dtype, which the all-gathers read. Each bucket's reduced shard gradient streams to
            the host as its reduce-scatter completes, and a host thread adds it to the master's
            ``.grad`` while the backward goes on; with ``step_in_backward(opt)`` (a
            ``braid.optim`` optimizer) that thread also steps the bucket there and then. A
            master that changed is copied back to the device before its next all-gather. The
            results are those of the resident run bit for bit; state dicts hold the same values
            (``sharded_state_dict`` and the optimizer's state on the host).

    The optimizer goes on ``wrapper.parameters()``, unchanged::

        model = shard(model, c, stage=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    """
    return ShardedModule(module, group, stage=stage, bucket_cap_mb=bucket_cap_mb,
                         reshard_after_forward=reshard_after_forward, prefetch=prefetch, units=units,
                         mp_policy=mp_policy, param_compression=param_compression,
                         grad_compression=grad_compression, hierarchical=hierarchical,
                         offload_optimizer=offload_optimizer)
