"""Live recovery: a replica's whole state (model, optimizer, data position, whatever its
``state_dict`` callback returns) streamed from a healthy peer over braid point-to-point, tensor by
tensor, without a checkpoint file.

The sender first sends the structure (the nested dicts and lists with every tensor replaced by a
placeholder of its shape and dtype, pickled) and then each tensor's bytes in order. Tensors travel
as raw bytes, so every dtype crosses bit for bit; the receiver allocates each on the CPU and the
``load_state_dict`` callback copies it where it belongs (a GPU, a pinned buffer). A DTensor (an
FSDP2 module's or its optimizer's state) travels as its local shard: rank i of a replica sends to
rank i of the joiner, whose shards have the same places; :func:`load_local_shards` puts them back.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections import OrderedDict
from typing import Any, List, Tuple

import torch
from torch.distributed.tensor import DTensor

from braid.comm import Communicator


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _dict_like(value: dict) -> type:
    return OrderedDict if isinstance(value, OrderedDict) else dict


def _flatten(value: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if isinstance(t, DTensor):
            t = t.to_local()
        tensors.append(t)
        return _Slot(len(tensors) - 1, tuple(t.shape), t.dtype, bool(value.requires_grad))
    if isinstance(value, dict):  # dict and OrderedDict (a module's state_dict) keep their type
        return _dict_like(value)((k, _flatten(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [_flatten(v, tensors) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _fill(value: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        t = tensors[value.index]
        return t.requires_grad_(True) if value.requires_grad and t.is_floating_point() else t
    if isinstance(value, dict):
        return _dict_like(value)((k, _fill(v, tensors)) for k, v in value.items())
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_fill(v, tensors) for v in value)
    return value


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8)


def send_state(comm: Communicator, dst: int, state: Any, step: int) -> int:
    """Sends ``state`` and the step number to rank ``dst`` of ``comm``; returns the bytes sent."""
    tensors: List[torch.Tensor] = []
    skeleton = pickle.dumps((step, _flatten(state, tensors)), protocol=pickle.HIGHEST_PROTOCOL)
    head = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    comm.send(torch.tensor([head.numel()], dtype=torch.int64), dst)
    comm.send(head, dst)
    sent = head.numel()
    for t in tensors:
        raw = _as_bytes(t)
        if raw.numel():
            comm.send(raw, dst)
            sent += raw.numel()
    return sent


def recv_state(comm: Communicator, src: int) -> Tuple[Any, int]:
    """Receives what :func:`send_state` sent from rank ``src``: ``(state, step)``, tensors on the
    CPU."""
    size = torch.zeros(1, dtype=torch.int64)
    comm.recv(size, src)
    head = torch.empty(int(size.item()), dtype=torch.uint8)
    comm.recv(head, src)
    step, skeleton = pickle.loads(head.numpy().tobytes())
    slots: List[_Slot] = []

    def collect(value: Any) -> None:
        if isinstance(value, _Slot):
            slots.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)

    collect(skeleton)
    tensors: List[torch.Tensor] = [None] * len(slots)  # type: ignore[list-item]
    for slot in sorted(slots, key=lambda s: s.index):
        t = torch.empty(slot.shape, dtype=slot.dtype)
        raw = _as_bytes(t)
        if raw.numel():
            comm.recv(raw, src)  # a view of t: the bytes land in it
        tensors[slot.index] = t
    return _fill(skeleton, tensors), step


def load_local_shards(module: torch.nn.Module, optimizer: Any, model_state: dict,
                      optimizer_state: Any = None) -> None:
    """Loads, on an FSDP2 module (``fully_shard``) and its optimizer, the state that the same rank
    of a healthy replica sent (its ``module.state_dict()`` and ``optimizer.state_dict()``, whose
    DTensors travelled as their local shards): each parameter's and buffer's local shard is
    copied in place; in the optimizer's state, a tensor shaped like its parameter's local shard
    becomes a DTensor of that parameter's mesh and placements, then ``load_state_dict`` takes it.
    ``optimizer`` may be None (the module only)."""
    own = dict(module.named_parameters())
    own.update(module.named_buffers())
    missing = sorted(set(model_state) ^ set(own))
    if missing:
        raise KeyError(f"load_local_shards: the received state and the module differ in {missing[:5]}")
    with torch.no_grad():
        for name, value in model_state.items():
            target = own[name]
            local = target.to_local() if isinstance(target, DTensor) else target
            if local.shape != value.shape:
                raise ValueError(
                    f"load_local_shards: {name}'s local shard is {tuple(local.shape)} here but "
                    f"{tuple(value.shape)} on the sender (replicas must shard alike)"
                )
            local.copy_(value)
    if optimizer is None or optimizer_state is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in optimizer_state.get("state", {}).items():
        param = params[index]
        if not isinstance(param, DTensor):
            continue
        shard_shape = param.to_local().shape
        for key, value in list(entry.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard_shape:
                entry[key] = DTensor.from_local(
                    value.to(param.device), param.device_mesh, param.placements, run_check=False,
                    shape=param.shape, stride=param.stride(),
                )
    optimizer.load_state_dict(optimizer_state)
