"""How the sharded wrapper lays a module's parameters out: units, flat padded buckets, each rank's shard.

The wrapped module's parameters are grouped into units (the modules given in ``units``, by default
each top-level child; what no unit holds, and parameters shared between units, form the root
unit). A unit's parameters are concatenated, in order, into flat buckets of one dtype and one
``requires_grad`` each, at most the cap large (a larger parameter gets a bucket of its own),
padded to a multiple of the world size. Rank r owns elements [r*S, (r+1)*S) of every bucket,
S = padded size / world size: that slice is a ``torch.nn.Parameter`` of the wrapper. The module's
own parameters become plain tensors: views into a bucket's full flat tensor, made again at each
forward (``torch.split``, whose backward writes one flat gradient per bucket).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

from ..core.group import REGISTERED_BUFFERS, capabilities_of
from ..core.vocabulary import WIRE_DTYPES

# Gradients braid reduces; frozen parameters may have any dtype (they are only copied).
REDUCE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass
class Slot:
    """One parameter's place in a bucket, and every (module, attribute) that holds it."""
    keys: list                    # its names in the unwrapped module's state_dict (tied: several)
    owners: list                  # [(module, attribute name)]
    offset: int
    numel: int
    shape: torch.Size
    param: Optional[nn.Parameter] = None  # the original, until copied into the bucket


@dataclass
class Bucket:
    """Parameters of one dtype and ``requires_grad`` in one flat tensor, and this rank's shard of it."""
    slots: list
    dtype: torch.dtype
    trainable: bool
    padded: int                   # multiple of the world size
    shard_numel: int
    compute_dtype: torch.dtype = None  # of the full buffer: mixed precision's param_dtype, else dtype
    reduce_dtype: torch.dtype = None   # gradients are reduced in it (mixed precision), else compute_dtype
    full: torch.Tensor = None     # flat, ``padded`` elements; storage freed when resharded (ZeRO stage 3)
    shard: nn.Parameter = None
    synced_version: int = -1      # shard._version at the last all-gather (ZeRO stages 1, 2); -1: stale;
                                  # -2: gathered from a frozen image (``frozen``)
    local_guard: Any = None       # (shard.grad, its _version) after a no_sync() backward
    work: Any = None              # in-flight all-gather: (work, version keeper, decode or None)
    unit: Any = None              # the Unit holding it
    index: int = 0                # position among the module's buckets (names its compression residual)
    secondary: Any = None         # hpZ: this rank's piece of the full buffer for its host, between forward
                                  # and backward
    on_device: Any = None         # offload_optimizer: the shard's copy on the module's device, in the
                                  # compute dtype, that the all-gathers read (``shard`` is then the
                                  # float32 master in host memory)
    uploaded_version: int = -1    # shard._version when ``on_device`` was last copied from it; -1: stale
    grad_staging: Any = None      # offload_optimizer on a GPU: pinned host buffer the reduced shard
                                  # gradient is copied into
    frozen: bool = False          # a delayed step of the master runs meanwhile (step_in_backward's
                                  # delay): ``on_device`` holds the master as it was before it; the
                                  # master is neither uploaded nor compared with the last gather


@dataclass
class Unit:
    """The buckets gathered together, for one submodule (``module``) or the root (None)."""
    name: str
    module: Optional[nn.Module]   # None for the root unit
    buckets: list = field(default_factory=list)
    gathered: bool = True         # full buffers hold the current parameters
    in_flight: bool = False


@dataclass
class Parameters:
    """The module's parameters by id, in order of first appearance in ``named_modules``."""
    params: dict                  # id -> nn.Parameter
    owners: dict                  # id -> [(module, attribute name)]
    keys: dict                    # id -> its state_dict names
    units: dict                   # id -> {index of the units holding it (None: outside every unit)}
    device: Optional[torch.device] = None  # where every parameter is


def resolve_units(module: nn.Module, units: Optional[Iterable[Union[str, nn.Module]]]) -> list:
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


def collect_parameters(module: nn.Module, unit_specs: list) -> Parameters:
    """Every parameter of ``module`` (tied ones once, with all their owners and names) and the
    units among ``unit_specs`` that hold it; checked: all on one device, trainable ones of a dtype
    braid reduces, at least one."""
    found = Parameters({}, {}, {}, {})
    prefixes = [(name + ".", i) for i, (name, _) in enumerate(unit_specs)]
    for mod_name, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            full_name = f"{mod_name}.{attr}" if mod_name else attr
            if found.device is None:
                found.device, first = p.device, full_name
            elif p.device != found.device:
                raise ValueError(f"parameter {full_name} is on {p.device} but {first} is on {found.device}: "
                                 "move the module to one device before sharding it")
            pid = id(p)
            found.params[pid] = p
            if (m, attr) not in found.owners.setdefault(pid, []):
                found.owners[pid].append((m, attr))
            if p.requires_grad and p.dtype not in REDUCE_DTYPES:
                raise TypeError(f"parameter {full_name} is trainable with dtype {p.dtype}: braid "
                                "reduces gradients of float32, float64, float16 and bfloat16 only "
                                "(frozen parameters of any dtype are fine)")
            found.keys.setdefault(pid, []).append(full_name)
            where = next((i for prefix, i in prefixes if full_name.startswith(prefix)), None)
            found.units.setdefault(pid, set()).add(where)
    if not found.params:
        raise ValueError("module has no parameters to shard")
    return found


def plan_buckets(found: Parameters, pids: list, cap_bytes: int, world_size: int, align: int = 1) -> list:
    """Buckets of the parameters ``pids``: consecutive parameters of one (dtype, requires_grad)
    group, each bucket closed before exceeding ``cap_bytes``; shards a multiple of ``align``
    elements (a quantizer's block, for quantized gathers)."""
    groups: dict = {}
    for pid in pids:
        p = found.params[pid]
        groups.setdefault((p.dtype, p.requires_grad), []).append((pid, p))
    buckets = []
    for (dtype, trainable), group in groups.items():
        current, size = [], 0
        for pid, p in group:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap_bytes:
                buckets.append(new_bucket(current, dtype, trainable, world_size, align))
                current, size = [], 0
            current.append(Slot(found.keys[pid], found.owners[pid], 0, p.numel(), p.shape, p))
            size += nbytes
        if current:
            buckets.append(new_bucket(current, dtype, trainable, world_size, align))
    return buckets


def new_bucket(slots: list, dtype: torch.dtype, trainable: bool, n: int, align: int = 1) -> Bucket:
    """A bucket of ``slots`` laid end to end, padded to ``n`` shards of a multiple of ``align``
    elements each."""
    offset = 0
    for s in slots:
        s.offset = offset
        offset += s.numel
    padded = -(-offset // (n * align)) * n * align
    return Bucket(slots, dtype, trainable, padded, padded // n)


def fill(b: Bucket, group: Any, keep_full: bool, device: torch.device, offload: bool = False) -> None:
    """Copies the parameters into the bucket (rank 0's values, as DDP), cuts this rank's shard and
    takes the parameters off their modules. With ``keep_full`` (ZeRO stages 1 and 2) the shard is a
    slice of the full tensor, so an optimizer updates the full parameters' slice in place and the
    all-gather runs in place; otherwise (ZeRO stage 3, or a full buffer of another dtype under mixed
    precision) it is a copy.

    With ``offload`` (a trainable bucket) the shard, the optimizer's parameter, is a copy in host
    memory (pinned when the device is a GPU) and ``on_device`` holds its image on the device in the
    compute dtype for the all-gathers: the slice of the full tensor where the shard would have been
    one, else a tensor of its own.

    A full buffer that stays allocated (``keep_full`` in the parameters' dtype) on the CPU lives in
    the group's registered buffers where it has them (a braid Communicator): the ranks of a host
    then read each other's shards in place in the all-gathers. (At ZeRO stage 3 the buffer is
    freed between uses, which a registered buffer cannot be.)"""
    registered = (keep_full and b.compute_dtype == b.dtype and b.dtype in WIRE_DTYPES and device.type == "cpu"
                  and REGISTERED_BUFFERS in capabilities_of(group))
    full = group.zeros(b.padded, dtype=b.dtype) if registered else torch.zeros(b.padded, dtype=b.dtype,
                                                                               device=device)
    with torch.no_grad():
        for s in b.slots:
            full[s.offset:s.offset + s.numel].copy_(s.param.reshape(-1))
            s.param = None
    group.broadcast(wire(full), 0)
    lo = group.rank * b.shard_numel
    same = b.compute_dtype == b.dtype
    in_place = keep_full and same
    if offload and b.trainable:
        shard = full[lo:lo + b.shard_numel].to("cpu", copy=True)
        if device.type == "cuda":
            shard = shard.pin_memory()
        image = full.detach()[lo:lo + b.shard_numel]  # outside autograd: the uploads write it in place
        b.on_device = image if in_place else image.to(b.compute_dtype, copy=True)
    else:
        shard = full[lo:lo + b.shard_numel] if in_place else full[lo:lo + b.shard_numel].clone()
    b.shard = nn.Parameter(shard, requires_grad=b.trainable)
    if not same:
        full = full.to(b.compute_dtype)
    b.full = full.requires_grad_(b.trainable)
    b.synced_version = b.uploaded_version = b.shard._version
    for s in b.slots:
        for m, attr in s.owners:
            m._parameters.pop(attr, None)


def wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` (flat, contiguous) as braid's collectives move it: as itself where braid has its
    dtype, else as its bytes (frozen bool, int8, complex, ... parameters)."""
    return t if t.dtype in WIRE_DTYPES else t.view(torch.uint8)


def gather_input(b: Bucket) -> torch.Tensor:
    """What this rank contributes to the bucket's all-gather: its shard as the full buffer holds it
    (cast to the compute dtype under mixed precision; offloaded: its image on the device)."""
    if b.on_device is not None:
        return wire(b.on_device)
    shard = b.shard.detach()
    return wire(shard) if b.compute_dtype == b.dtype else shard.to(b.compute_dtype)


def free(b: Bucket) -> None:
    """Releases a bucket's full buffer, and takes its views off the modules: a view of released
    storage would read freed memory (a crash, not an error) if anything still used it."""
    b.full.untyped_storage().resize_(0)
    for s in b.slots:
        for m, attr in s.owners:
            m.__dict__.pop(attr, None)


def alloc(t: torch.Tensor) -> None:
    """Gives a freed full buffer its memory again (its contents are then undefined)."""
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def set_views(unit: Unit, track_grad: bool) -> None:
    """Points the module attributes at views of the full buffers; with ``track_grad`` the views are
    made by one split per bucket, so autograd returns one flat gradient per bucket."""
    for b in unit.buckets:
        source = b.full if (track_grad and b.trainable) else b.full.detach()
        sizes = [s.numel for s in b.slots]
        pad = b.padded - sum(sizes)
        pieces = torch.split(source, sizes + [pad] if pad else sizes)
        for s, piece in zip(b.slots, pieces):
            view = piece.view(s.shape)
            for m, attr in s.owners:
                m.__dict__[attr] = view


def piece(b: Bucket, s: Slot, rank: int) -> torch.Tensor:
    """The part of slot ``s``'s flattened elements that rank ``rank``'s shard of ``b`` holds (a
    view, maybe empty)."""
    lo = rank * b.shard_numel
    start = min(max(s.offset - lo, 0), b.shard_numel)
    stop = min(max(s.offset + s.numel - lo, 0), b.shard_numel)
    return b.shard.detach()[start:stop]
