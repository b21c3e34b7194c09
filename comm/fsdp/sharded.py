"""braid's sharded data-parallel wrapper (ZeRO stages 1-3) on flat padded buckets and async braid collectives.

Layout. The wrapped module's parameters are grouped into units (the modules given in ``units``,
by default each top-level child; what no unit holds, and parameters shared between units, form
the root unit). A unit's parameters are concatenated, in order, into flat buckets of one dtype
and one ``requires_grad`` each, at most ``bucket_cap_mb`` large (a larger parameter gets a bucket
of its own), padded to a multiple of the world size. Rank r owns elements [r*S, (r+1)*S) of every
bucket, S = padded size / world size: that slice is a ``torch.nn.Parameter`` of the wrapper, the
only parameters ``wrapper.parameters()`` yields, so an optimizer built on them keeps 1/N of the
state. The module's own parameters become plain tensors: views into a bucket's full flat tensor,
made again at each forward (``torch.split``, whose backward writes one flat gradient per bucket).

Gradients. Autograd accumulates a bucket's gradient into its full flat tensor; the post-accumulate
hook of that tensor fires once every parameter of the bucket has its gradient, and launches an
async reduce-scatter with braid's average (the mean over ranks, as DDP) into a new shard-sized
tensor. Results are added to their shard's ``.grad`` oldest first: those already done whenever
another bucket launches, the oldest waited for past two pending (a pending one holds a full-size
gradient), the rest at the end of the backward (an autograd engine callback). Inside
``no_sync()`` nothing is launched: the gradients stay in the full flat tensors, and the next
synchronized backward reduces the sum.

Stages.
- 1: full parameters on every rank; the full gradient buffers are kept between steps (zeroed
  after each reduction and accumulated into again, as DDP keeps its buckets); optimizer state
  1/N. Gradients are reduce-scattered, not all-reduced: a rank only updates its shard, and the
  updated shards are all-gathered before the next forward, which moves the bytes of one
  all-reduce per step in all.
- 2: as 1, but the full gradient buffer is released as soon as its reduce-scatter is done.
- 3: parameters too: a unit's buckets are all-gathered before its forward (forward pre-hook) and
  again before its backward (a hook on the gradient of the unit's output), the next unit in
  execution order prefetched, at most two all-gathers in flight; the full buffers are freed
  after the unit's forward (``reshard_after_forward``) and after its gradients are ready. The
  root unit stays gathered from the start of the forward to the end of the backward.

Parameter refresh (stages 1, 2). An optimizer updates the shards in place after a synchronized
backward; the next forward (each unit's pre-hook, with the prefetch) all-gathers the buckets
whose gradient that backward reduced, and any other whose shard's version counter moved since its
last gather (fused optimizers do not bump the counters, so these are not relied upon alone).
``gather_params()`` does it at once, for code that reads the module's parameters between the
step and the next forward, or that changed shards through ``.data`` (which the version counter
does not see).

Every collective is issued by every rank in the same order: ranks must run the same forward and
backward (the same units, the same parameters used), as with DDP.
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..communicator import check_communicator
from ..vocabulary import WIRE_DTYPES

_MB = 1 << 20
# How many unit all-gathers may be in flight at once (the one about to be used and one ahead):
# each holds a unit's full buffers, so this bounds stage 3's memory above the shards.
_MAX_GATHERS_IN_FLIGHT = 2
# How many bucket reduce-scatters may be pending during the backward: each holds a full-size
# gradient until done, so without a bound the backward of stages 2 and 3 would peak at the whole
# unsharded gradient. Past it the oldest is waited for (it is usually done by then).
_MAX_REDUCES_IN_FLIGHT = 2


@dataclass
class _Slot:
    """One parameter's place in a bucket, and every (module, attribute) that holds it."""
    keys: list                    # its names in the unwrapped module's state_dict (tied: several)
    owners: list                  # [(module, attribute name)]
    offset: int
    numel: int
    shape: torch.Size
    param: Optional[nn.Parameter] = None  # the original, until copied into the bucket


@dataclass
class _Bucket:
    slots: list
    dtype: torch.dtype
    trainable: bool
    padded: int                   # multiple of the world size
    shard_numel: int
    full: torch.Tensor = None     # flat, ``padded`` elements; storage freed when resharded (stage 3)
    shard: nn.Parameter = None
    synced_version: int = -1      # shard._version at the last all-gather (stages 1, 2); -1: stale
    local_guard: Any = None       # (shard.grad, its _version) after a no_sync() backward
    work: Any = None              # in-flight all-gather
    unit: Any = None              # the _Unit holding it


@dataclass
class _Unit:
    name: str
    module: Optional[nn.Module]   # None for the root unit
    buckets: list = field(default_factory=list)
    gathered: bool = True         # full buffers hold the current parameters
    in_flight: bool = False


def _resolve_units(module: nn.Module, units: Optional[Iterable[Union[str, nn.Module]]]) -> list:
    """[(qualified name, module)] of the units, checked: submodules of ``module``, not containers
    without a forward, no duplicates, none inside another."""
    names = {}
    for name, m in module.named_modules():
        names.setdefault(id(m), name)
    if units is None:
        chosen = []
        for name, child in module.named_children():
            # A ModuleList/ModuleDict never runs forward itself (so its hooks never fire): its
            # children are the units.
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                chosen += [(f"{name}.{n}", c) for n, c in child.named_children()]
            else:
                chosen.append((name, child))
        return [(n, m) for n, m in chosen if any(True for _ in m.parameters())]
    if isinstance(units, (str, nn.Module)):
        raise TypeError("units must be a sequence of submodules or their names, not a single "
                        f"{type(units).__name__}")
    chosen = []
    for i, u in enumerate(units):
        if isinstance(u, str):
            try:
                m = module.get_submodule(u)
            except AttributeError:
                raise ValueError(f"units[{i}]={u!r} is not a submodule of the wrapped module") from None
            name = u
        elif isinstance(u, nn.Module):
            if id(u) not in names:
                raise ValueError(f"units[{i}] ({type(u).__name__}) is not a submodule of the wrapped module")
            m, name = u, names[id(u)]
        else:
            raise TypeError(f"units[{i}] must be an nn.Module or a submodule name, got {type(u).__name__}")
        if m is module:
            raise ValueError(f"units[{i}] is the wrapped module itself; its own parameters form the "
                             "root unit already")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(f"units[{i}] ({name!r}) is a {type(m).__name__}, which has no forward of "
                             "its own: list its children instead")
        if any(m is other for _, other in chosen):
            raise ValueError(f"units[{i}] ({name!r}) is given twice")
        chosen.append((name, m))
    for name, m in chosen:
        for other_name, other in chosen:
            if other is not m and any(sub is other for sub in m.modules()):
                raise ValueError(f"units {name!r} and {other_name!r} nest (one inside the other); "
                                 "units must be disjoint")
    return chosen


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


_REDUCE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` (flat, contiguous) as braid's collectives move it: as itself where braid has its
    dtype, else as its bytes (frozen bool, int8, complex, ... parameters)."""
    return t if t.dtype in WIRE_DTYPES else t.view(torch.uint8)


def _free(b: "_Bucket") -> None:
    """Releases a bucket's full buffer, and takes its views off the modules: a view of released
    storage would read freed memory (a crash, not an error) if anything still used it."""
    b.full.untyped_storage().resize_(0)
    for s in b.slots:
        for m, attr in s.owners:
            m.__dict__.pop(attr, None)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


class ShardedModule(nn.Module):
    """A module whose parameters, gradients and optimizer state are sharded over the ranks of a
    braid communicator (build with :func:`shard`; the module docstring describes the stages).

    ``wrapper(*args)`` runs the module; ``wrapper.parameters()`` are this rank's flat shards (give
    them to any ``torch.optim`` optimizer); ``loss.backward()`` returns with the averaged shard
    gradients in place. The wrapped module stays reachable as ``wrapper.module``.
    """

    def __init__(self, module: nn.Module, communicator: Any, *, stage: int = 3, bucket_cap_mb: float = 25,
                 reshard_after_forward: bool = True, prefetch: int = 1,
                 units: Optional[Sequence[Union[str, nn.Module]]] = None):
        _check_args(module, stage, bucket_cap_mb, reshard_after_forward, prefetch)
        check_communicator(communicator)
        super().__init__()
        self.module = module
        self.communicator = communicator
        self.stage = stage
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self._cap_bytes = int(bucket_cap_mb * _MB)
        self._sync = True
        self._finish_queued = False
        self._in_flight: list[_Unit] = []     # units with all-gathers launched, oldest first
        self._pending: list = []              # (bucket, work, reduced, gradient) per reduce-scatter
        self._order: list[_Unit] = []         # non-root units in the order their forwards ran
        self._order_done = False
        self._keys = list(module.state_dict(keep_vars=True).keys())
        self._build(_resolve_units(module, units))

    # -- construction ----------------------------------------------------------------------
    def _build(self, unit_specs: list) -> None:
        module, c = self.module, self.communicator
        params: dict[int, nn.Parameter] = {}
        owners: dict[int, list] = {}
        unit_of: dict[int, set] = {}
        keys_of: dict[int, list] = {}
        prefixes = [(name + ".", i) for i, (name, _) in enumerate(unit_specs)]
        for mod_name, m in module.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is None:
                    continue
                if p.device.type != "cpu":
                    raise ValueError(f"parameter {mod_name}.{attr} is on {p.device}: braid's sharding runs "
                                     "on CPU tensors (the CUDA path is not built)")
                pid = id(p)
                params[pid] = p
                if (m, attr) not in owners.setdefault(pid, []):
                    owners[pid].append((m, attr))
                full_name = f"{mod_name}.{attr}" if mod_name else attr
                if p.requires_grad and p.dtype not in _REDUCE_DTYPES:
                    raise TypeError(f"parameter {full_name} is trainable with dtype {p.dtype}: braid "
                                    "reduces gradients of float32, float64, float16 and bfloat16 only "
                                    "(frozen parameters of any dtype are fine)")
                keys_of.setdefault(pid, []).append(full_name)
                where = next((i for prefix, i in prefixes if full_name.startswith(prefix)), None)
                unit_of.setdefault(pid, set()).add(where)
        if not params:
            raise ValueError("module has no parameters to shard")
        self._units = [_Unit(name, m) for name, m in unit_specs]
        root = _Unit("<root>", None)
        members: list[list] = [[] for _ in self._units]
        root_members = []
        for pid, where in unit_of.items():  # parameter order: first appearance in named_modules
            # A parameter used by several units (tied weights) goes to the root unit, which is
            # gathered for the whole forward and backward.
            alone = len(where) == 1 and None not in where
            (members[next(iter(where))] if alone else root_members).append(pid)
        if root_members:
            self._units.append(root)
        self._root = root if root_members else None
        shards = []
        for unit, pids in zip(self._units, members + [root_members]):
            for bucket in self._plan_buckets([(pid, params[pid]) for pid in pids], owners, keys_of):
                self._fill(bucket, c)
                bucket.unit = unit
                unit.buckets.append(bucket)
                shards.append(bucket.shard)
        self._units = [u for u in self._units if u.buckets]
        # The ParameterList makes the shards the wrapper's parameters (and moves with state_dict()).
        self.shards = nn.ParameterList(shards)
        for buf in module.buffers():
            if buf.dtype in WIRE_DTYPES:
                c.broadcast(buf.data, 0)
            else:  # bool, int8, ...: through int64
                wide = buf.data.to(torch.int64)
                c.broadcast(wide, 0)
                buf.data.copy_(wide)
        for unit in self._units:
            if unit.module is not None:
                unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
                unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            if self.stage == 3:
                self._reshard(unit)
            else:
                self._set_views(unit, False)

    def _plan_buckets(self, params: list, owners: dict, keys_of: dict) -> list:
        """Consecutive parameters of one (dtype, requires_grad) group, closed before exceeding the cap."""
        groups: dict = {}
        for pid, p in params:
            groups.setdefault((p.dtype, p.requires_grad), []).append((pid, p))
        buckets = []
        n = self.communicator.world_size
        for (dtype, trainable), group in groups.items():
            current, size = [], 0
            for pid, p in group:
                nbytes = p.numel() * p.element_size()
                if current and size + nbytes > self._cap_bytes:
                    buckets.append(self._new_bucket(current, dtype, trainable, n))
                    current, size = [], 0
                current.append(_Slot(keys_of[pid], owners[pid], 0, p.numel(), p.shape, p))
                size += nbytes
            if current:
                buckets.append(self._new_bucket(current, dtype, trainable, n))
        return buckets

    @staticmethod
    def _new_bucket(slots: list, dtype: torch.dtype, trainable: bool, n: int) -> _Bucket:
        offset = 0
        for s in slots:
            s.offset = offset
            offset += s.numel
        padded = -(-offset // n) * n
        return _Bucket(slots, dtype, trainable, padded, padded // n)

    def _fill(self, b: _Bucket, c: Any) -> None:
        """Copies the parameters into the bucket (rank 0's values, as DDP) and cuts this rank's shard."""
        full = torch.zeros(b.padded, dtype=b.dtype)
        with torch.no_grad():
            for s in b.slots:
                full[s.offset:s.offset + s.numel].copy_(s.param.reshape(-1))
                s.param = None
        c.broadcast(_wire(full), 0)
        lo = c.rank * b.shard_numel
        if self.stage == 3:
            shard = full[lo:lo + b.shard_numel].clone()
        else:
            # Stages 1 and 2 keep the full tensor: the shard is its own slice, so the optimizer
            # updates the full parameters' slice in place and the all-gather runs in place.
            shard = full[lo:lo + b.shard_numel]
        b.shard = nn.Parameter(shard, requires_grad=b.trainable)
        b.full = full.requires_grad_(b.trainable)
        b.synced_version = b.shard._version
        if b.trainable:
            b.full.register_hook(functools.partial(self._before_accumulate, b))
            b.full.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b))
        for s in b.slots:
            for m, attr in s.owners:
                m._parameters.pop(attr, None)

    # -- parameters: views, gathers, resharding ----------------------------------------------
    def _set_views(self, unit: _Unit, track_grad: bool) -> None:
        """Points the module attributes at views of the full buffers; with ``track_grad`` the
        views are made by one split per bucket, so autograd returns one flat gradient per bucket."""
        for b in unit.buckets:
            source = b.full if (track_grad and b.trainable) else b.full.detach()
            sizes = [s.numel for s in b.slots]
            pad = b.padded - sum(sizes)
            pieces = torch.split(source, sizes + [pad] if pad else sizes)
            for s, piece in zip(b.slots, pieces):
                view = piece.view(s.shape)
                for m, attr in s.owners:
                    m.__dict__[attr] = view

    def _stale(self, unit: _Unit) -> bool:
        if self.stage == 3:
            return not unit.gathered
        return any(b.shard._version != b.synced_version for b in unit.buckets)

    def _launch_gather(self, unit: _Unit, force: bool = False) -> None:
        """Starts the all-gathers of ``unit``'s buckets: at stage 3 all of them, at stages 1 and 2
        those whose shard changed since their last gather (every one with ``force``)."""
        if unit.in_flight or not (force or self._stale(unit)):
            return
        while len(self._in_flight) >= _MAX_GATHERS_IN_FLIGHT:
            self._wait_gather(self._in_flight[0])
        c = self.communicator
        for b in unit.buckets:
            if self.stage != 3 and not force and b.shard._version == b.synced_version:
                continue
            _alloc(b.full)
            b.synced_version = b.shard._version
            b.work = c.all_gather(_wire(b.full.detach()), _wire(b.shard.detach()), async_op=True)
        unit.in_flight = True
        self._in_flight.append(unit)

    def _wait_gather(self, unit: _Unit) -> None:
        if not unit.in_flight:
            return
        for b in unit.buckets:
            if b.work is not None:
                work, b.work = b.work, None
                work.wait()
        unit.in_flight = False
        unit.gathered = True
        self._in_flight.remove(unit)

    def _gather(self, unit: _Unit, ahead: Sequence[_Unit]) -> None:
        """Makes ``unit``'s full parameters current, prefetching ``ahead`` while waiting."""
        self._launch_gather(unit)
        for other in ahead[:self.prefetch]:
            self._launch_gather(other)
        self._wait_gather(unit)

    def _reshard(self, unit: _Unit) -> None:
        if unit.in_flight:
            self._wait_gather(unit)
        for b in unit.buckets:
            _free(b)
        unit.gathered = False

    def _next_units(self, unit: Optional[_Unit], backward: bool) -> list:
        order = self._order if self._order_done else [u for u in self._units if u is not self._root]
        if backward:
            order = order[::-1]
        if unit is None:
            return list(order)
        try:
            i = order.index(unit)
        except ValueError:
            return []
        return order[i + 1:]

    def gather_params(self) -> None:
        """All-gathers every bucket now (stages 1, 2), so the module's parameters hold the shards'
        values, including changes made through ``.data``, which the version counters that the
        next forward checks do not see. A collective: every rank calls it. Stage 3 keeps no
        full parameters: nothing to do."""
        if self.stage == 3:
            return
        for unit in self._units:
            self._launch_gather(unit, force=True)
        for unit in list(self._in_flight):
            self._wait_gather(unit)
        for unit in self._units:
            self._set_views(unit, False)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._order_done:
            self._order = []
        grad = torch.is_grad_enabled()
        if self._root is not None:
            self._gather(self._root, self._next_units(None, False))
            self._set_views(self._root, grad)
        out = self.module(*args, **kwargs)
        self._order_done = True
        if self.stage == 3 and self._root is not None and not grad:
            self._reshard(self._root)
        return out

    def _pre_forward(self, unit: _Unit, module: nn.Module, args: Any) -> None:
        if not self._order_done and unit not in self._order:
            self._order.append(unit)
        self._gather(unit, self._next_units(unit, False))
        self._set_views(unit, torch.is_grad_enabled())

    def _post_forward(self, unit: _Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self.stage != 3:
            return
        if not torch.is_grad_enabled():
            self._reshard(unit)
            return
        hooked = False
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(self._pre_backward, unit))
                hooked = True
        # The last unit's backward comes first: keeping it avoids a gather on the critical path.
        # An output with no tensor in reach (a type pytree does not know) gives no hook to gather
        # again before the backward: the parameters then stay until their gradients are done.
        last = self._order_done and self._order and self._order[-1] is unit
        if self.reshard_after_forward and hooked and not last:
            self._reshard(unit)

    # -- backward --------------------------------------------------------------------------
    def _queue_finish(self) -> None:
        if not self._finish_queued:
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, unit: _Unit, grad: torch.Tensor) -> None:
        self._queue_finish()
        self._gather(unit, self._next_units(unit, True))

    def _before_accumulate(self, b: _Bucket, grad: torch.Tensor) -> None:
        """Runs before autograd adds a gradient to the bucket's full flat tensor. A local gradient
        left there by ``no_sync()`` backwards is dropped when the shard's gradient was cleared
        since (``optimizer.zero_grad()``, with or without ``set_to_none``), as DDP's would be: it
        lives in ``param.grad`` there."""
        if b.local_guard is not None:
            kept, version = b.local_guard
            b.local_guard = None
            if b.shard.grad is not kept or kept._version != version:
                self._drop_local_grad(b)

    def _drop_local_grad(self, b: _Bucket) -> None:
        if b.full.grad is not None:
            if self.stage == 1:
                b.full.grad.zero_()  # the persistent buffer stays
            else:
                b.full.grad = None

    def _on_grad_ready(self, b: _Bucket, full: torch.Tensor) -> None:
        """The bucket's flat gradient is complete: reduce-scatter it (async), free what can go."""
        self._queue_finish()
        if self._sync:
            # The optimizer will update the shard: gather it before the next forward even when the
            # update leaves the version counter alone (fused optimizers' kernels do).
            b.synced_version = -1
            grad = full.grad
            if self.stage != 1:
                full.grad = None
            reduced = torch.empty(b.shard_numel, dtype=grad.dtype)
            work = self.communicator.reduce_scatter(reduced, grad, op="avg", async_op=True)
            self._pending.append((b, work, reduced, grad))
            self._retire(_MAX_REDUCES_IN_FLIGHT)
        if self.stage == 3 and b.unit is not self._root:
            # Every use of the bucket's parameters in this backward is done (autograd produced
            # all their gradients): its full buffer can go now, not at the end of the backward.
            # The unit counts as resharded: a later use gathers all its buckets again.
            _free(b)
            b.unit.gathered = False

    def _finish_backward(self) -> None:
        """End of the backward: wait for the reduce-scatters in issue order, set the shard
        gradients, release what stage 3 still holds."""
        self._finish_queued = False
        self._retire(0)
        if not self._sync:
            # Remember the shard gradients as they are now: if they are cleared before the next
            # backward, so is the local gradient these no_sync() backwards accumulated. A shard
            # without one gets zeros, so that a clear (set to None) can be seen.
            with torch.no_grad():
                for b in self._buckets():
                    if b.trainable and b.full.grad is not None:
                        if b.shard.grad is None:
                            b.shard.grad = torch.zeros_like(b.shard)
                        b.local_guard = (b.shard.grad, b.shard.grad._version)
        for unit in list(self._in_flight):
            self._wait_gather(unit)
        for unit in self._units:
            if self.stage == 3:
                self._reshard(unit)
            else:
                # The forward's views belong to this backward's graph: autograd forbids using
                # them once the optimizer updates the bucket in place, so plain views replace them.
                self._set_views(unit, False)

    def _retire(self, keep: int) -> None:
        """Completes pending reduce-scatters, oldest first: every one already done, then waits
        until at most ``keep`` remain. Each result goes into its shard's ``.grad``."""
        with torch.no_grad():
            while self._pending and (len(self._pending) > keep or self._pending[0][1].is_completed()):
                b, work, reduced, grad = self._pending.pop(0)
                work.wait()
                if b.shard.grad is None:
                    b.shard.grad = reduced
                else:
                    b.shard.grad += reduced
                if self.stage == 1:
                    grad.zero_()  # the persistent buffer accumulates the next step's gradient

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate local gradients in the full
        flat buffers and communicate nothing; the next backward outside reduces the sum (as
        DDP's ``no_sync``). The local buffers are full-size at every stage while they wait."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the shard gradients and any local gradient accumulated under ``no_sync``."""
        super().zero_grad(set_to_none)
        for b in self._buckets():
            self._drop_local_grad(b)
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
        self._check_idle("clip_grad_norm_")
        grads = [b.shard.grad for b in self._buckets() if b.shard.grad is not None]
        # Padding elements have zero gradients (no parameter uses them): they add nothing.
        if norm_type == math.inf:
            local = max((g.abs().max() for g in grads), default=torch.tensor(0.0)).double().reshape(1)
            self.communicator.all_reduce(local, op="max")
            total = local[0]
        else:
            local = torch.zeros(1, dtype=torch.float64)
            for g in grads:
                local += g.double().abs().pow(norm_type).sum()
            self.communicator.all_reduce(local, op="sum")
            total = local[0].pow(1.0 / norm_type)
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(coef)
        return total.float()

    # -- state dicts -----------------------------------------------------------------------
    def _buckets(self) -> Iterator[_Bucket]:
        for unit in self._units:
            yield from unit.buckets

    def _slots(self) -> dict:
        """state_dict key -> (bucket, slot) for every parameter key, tied names included."""
        return {key: (b, s) for b in self._buckets() for s in b.slots for key in s.keys}

    def _check_idle(self, what: str) -> None:
        if self._pending or self._finish_queued:
            raise RuntimeError(f"{what} during a backward pass: call it between steps")

    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """The unwrapped module's ``state_dict()``: same keys, full tensors (copies). A collective
        (every rank calls it: each bucket is all-gathered); with ``rank0_only`` the other ranks
        return an empty dict and keep no copy."""
        self._check_idle("full_state_dict")
        keep = not rank0_only or self.communicator.rank == 0
        slots = self._slots()
        by_bucket: dict[int, dict] = {}
        for key, (b, s) in slots.items():
            by_bucket.setdefault(id(b), {})[key] = s
        values: dict[str, torch.Tensor] = {}
        for b in self._buckets():
            # From the shards, whatever the stage: they are the state (the full buffers of
            # stages 1 and 2 may not have seen the latest step yet).
            flat = torch.empty(b.padded, dtype=b.dtype)
            self.communicator.all_gather(_wire(flat), _wire(b.shard.detach()))
            if keep:
                for key, s in by_bucket.get(id(b), {}).items():
                    values[key] = flat[s.offset:s.offset + s.numel].view(s.shape).clone()
        if not keep:
            return {}
        rest = self.module.state_dict()
        return {k: values[k] if k in values else rest[k].clone() for k in self._keys}

    def sharded_state_dict(self) -> dict:
        """This rank's part of the state: the unwrapped module's keys; a parameter's value is the
        slice of its flattened elements that this rank's shards hold (1-D, maybe empty), so the
        slices of ranks 0..N-1 concatenated give the flattened parameter; buffers are whole."""
        self._check_idle("sharded_state_dict")
        values = {key: self._piece(b, s).clone() for key, (b, s) in self._slots().items()}
        rest = self.module.state_dict()
        return {k: values[k] if k in values else rest[k].clone() for k in self._keys}

    def _piece(self, b: _Bucket, s: _Slot) -> torch.Tensor:
        lo = self.communicator.rank * b.shard_numel
        start = min(max(s.offset - lo, 0), b.shard_numel)
        stop = min(max(s.offset + s.numel - lo, 0), b.shard_numel)
        return b.shard.detach()[start:stop]

    def load_full_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Loads an unwrapped module's ``state_dict()`` (every rank passes it whole): each rank
        keeps its slices. With ``strict`` the keys must match exactly."""
        self._load(state_dict, strict, full=True)

    def load_sharded_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Loads what :meth:`sharded_state_dict` returned on this rank (same world size)."""
        self._load(state_dict, strict, full=False)

    def _load(self, state_dict: dict, strict: bool, full: bool) -> None:
        self._check_idle("load_state_dict")
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if strict:
            missing = [k for k in self._keys if k not in state_dict]
            unexpected = [k for k in state_dict if k not in self._keys]
            if missing or unexpected:
                raise KeyError(f"state_dict keys do not match the module: missing {missing}, "
                               f"unexpected {unexpected}")
        slots = self._slots()
        lo_of = self.communicator.rank
        with torch.no_grad():
            for key, (b, s) in slots.items():
                if key not in state_dict:
                    continue
                value = state_dict[key]
                piece = self._piece(b, s)
                if full:
                    if tuple(value.shape) != tuple(s.shape):
                        raise ValueError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, the "
                                         f"module's parameter {tuple(s.shape)}")
                    lo = lo_of * b.shard_numel
                    start = max(lo - s.offset, 0)
                    piece.copy_(value.reshape(-1)[start:start + piece.numel()])
                else:
                    if value.numel() != piece.numel():
                        raise ValueError(f"state_dict[{key!r}] holds {value.numel()} elements, this "
                                         f"rank's slice {piece.numel()}: was it saved at another world size?")
                    piece.copy_(value.reshape(-1))
        rest = {k: v for k, v in state_dict.items() if k not in slots}
        self.module.load_state_dict(rest, strict=strict)
        self.gather_params()

    # -- accounting --------------------------------------------------------------------------
    def memory_stats(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
        """Bytes this rank holds now for parameters (shards and live full buffers), gradients
        (shard gradients and live full-size ones) and, given the optimizer, its state tensors.
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

        buckets = list(self._buckets())
        stats = {
            "params": size([b.shard for b in buckets] + [b.full for b in buckets]),
            "grads": size([b.shard.grad for b in buckets] + [b.full.grad for b in buckets]
                          + [p[3] for p in self._pending]),
        }
        if optimizer is not None:
            stats["optimizer"] = size(t for state in optimizer.state.values() for t in state.values()
                                      if isinstance(t, torch.Tensor))
        return stats

    @property
    def unit_names(self) -> list:
        """The units, in construction order (``<root>`` for the root unit)."""
        return [u.name for u in self._units]


def shard(module: nn.Module, communicator: Any, *, stage: int = 3, bucket_cap_mb: float = 25,
          reshard_after_forward: bool = True, prefetch: int = 1,
          units: Optional[Sequence[Union[str, nn.Module]]] = None) -> ShardedModule:
    """Wraps ``module`` for sharded data-parallel training on ``communicator`` (ZeRO ``stage`` 1,
    2 or 3; see the module docstring of ``braid.comm.fsdp.sharded``).

    Args:
        module: the model, on CPU, the same architecture on every rank; rank 0's parameters and
            buffers are broadcast to the others (as DDP).
        communicator: a ``braid.comm.Communicator`` over the data-parallel ranks.
        stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters.
        bucket_cap_mb: largest flat bucket (MiB); one collective per bucket.
        reshard_after_forward: stage 3: free a unit's full parameters after its forward (and
            gather them again for its backward), or keep them until its backward is done.
        prefetch: how many units ahead to all-gather while the current one computes (at most
            two all-gathers are in flight whatever the value).
        units: the submodules (or their names) whose parameters are gathered together; default:
            each top-level child (the children of a top-level ModuleList/ModuleDict).

    The optimizer goes on ``wrapper.parameters()``, unchanged::

        model = shard(model, c, stage=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    """
    return ShardedModule(module, communicator, stage=stage, bucket_cap_mb=bucket_cap_mb,
                         reshard_after_forward=reshard_after_forward, prefetch=prefetch, units=units)
