"""The sharded wrapper's state dicts: the unwrapped module's keys, with full tensors gathered from
the shards or with this rank's slices, and loading either back into the shards."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .layout import piece, wire


def slots_by_key(buckets: Iterable) -> dict:
    """state_dict key -> (bucket, slot) for every parameter key, tied names included."""
    return {key: (b, s) for b in buckets for s in b.slots for key in s.keys}


def full_state_dict(buckets: list, group: Any, module: nn.Module, keys: list, keep: bool) -> dict:
    """The unwrapped module's ``state_dict()`` with full tensors (copies), every bucket
    all-gathered from the shards (a collective); an empty dict unless ``keep``."""
    by_bucket: dict[int, dict] = {}
    for key, (b, s) in slots_by_key(buckets).items():
        by_bucket.setdefault(id(b), {})[key] = s
    values: dict[str, torch.Tensor] = {}
    for b in buckets:
        # From the shards, whatever the stage: they are the state (the full buffers of
        # ZeRO stages 1 and 2 may not have seen the latest step yet).
        # Offloaded master shards (host memory) travel from the module's device, as the group
        # serves it: the state dict is the same either way.
        flat = torch.empty(b.padded, dtype=b.dtype, device=b.full.device)
        group.all_gather(wire(flat), wire(b.shard.detach().to(b.full.device)))
        if keep:
            for key, s in by_bucket.get(id(b), {}).items():
                values[key] = flat[s.offset:s.offset + s.numel].view(s.shape).clone()
    if not keep:
        return {}
    return _with_buffers(values, module, keys)


def sharded_state_dict(buckets: list, rank: int, module: nn.Module, keys: list) -> dict:
    """The unwrapped module's keys; a parameter's value is the slice of its flattened elements that
    rank ``rank``'s shards hold (1-D, maybe empty); buffers are whole."""
    values = {key: piece(b, s, rank).clone() for key, (b, s) in slots_by_key(buckets).items()}
    return _with_buffers(values, module, keys)


def _with_buffers(values: dict, module: nn.Module, keys: list) -> dict:
    """``values`` for the parameters and copies of the module's own state for the rest, in the
    unwrapped module's key order."""
    rest = module.state_dict()
    return {k: values[k] if k in values else rest[k].clone() for k in keys}


def load(buckets: list, rank: int, module: nn.Module, keys: list, state_dict: dict, strict: bool,
         full: bool) -> None:
    """Copies ``state_dict`` (whole tensors with ``full``, else this rank's slices) into the
    shards and the rest into the module; with ``strict`` the keys must be ``keys`` exactly."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    if strict:
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if missing or unexpected:
            raise KeyError(f"state_dict keys do not match the module: missing {missing}, "
                           f"unexpected {unexpected}")
    slots = slots_by_key(buckets)
    with torch.no_grad():
        for key, (b, s) in slots.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            mine = piece(b, s, rank)
            if full:
                if tuple(value.shape) != tuple(s.shape):
                    raise ValueError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, the "
                                     f"module's parameter {tuple(s.shape)}")
                start = max(rank * b.shard_numel - s.offset, 0)
                mine.copy_(value.reshape(-1)[start:start + mine.numel()])
            else:
                if value.numel() != mine.numel():
                    raise ValueError(f"state_dict[{key!r}] holds {value.numel()} elements, this "
                                     f"rank's slice {mine.numel()}: was it saved at another world size?")
                mine.copy_(value.reshape(-1))
    rest = {k: v for k, v in state_dict.items() if k not in slots}
    module.load_state_dict(rest, strict=strict)
