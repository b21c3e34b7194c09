"""Fault-tolerant DDP and optimizer: torch's DistributedDataParallel whose gradient buckets braid
averages over the Manager's current members (its comm hook, compression included), and an
optimizer wrapper whose ``zero_grad`` starts the step and whose ``step`` applies it only when the
Manager commits it.

    manager = braid.ft.Manager(state_dict=..., load_state_dict=..., min_replicas=1)
    model = braid.ft.DistributedDataParallel(manager, model)
    optimizer = braid.ft.Optimizer(manager, torch.optim.AdamW(model.parameters()))
    for batch in data:
        optimizer.zero_grad()          # the step's quorum (a new epoch after a failure or a join)
        loss_fn(model(batch)).backward()
        optimizer.step()               # applied only where every live replica finished the step

torch's DDP needs a process group of its own; here it is a group of this process alone (its
broadcasts are no-ops), and every exchange between replicas goes through the hook.
"""

# Annotations are real objects here (no `from __future__ import annotations`): DDP checks the
# hook's annotations against dist.GradBucket and Future[Tensor].
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from braid.comm import ddp as braid_ddp
from braid.comm.compression import Compressor

from .manager import Manager


def local_group() -> dist.ProcessGroup:
    """A gloo process group of this process only, on a private in-memory store (what torch's DDP
    needs as its own group when another carrier moves the gradients)."""
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _hook(manager: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """braid's DDP hook over the Manager's communicator; a failure marks the step failed and
    leaves the bucket as it is (the step is discarded), so the backward itself never raises."""
    buf = bucket.buffer()
    if manager.errored is not None or manager.communicator is None:
        return _done(buf)
    try:
        fut = braid_ddp.braid_hook(manager.hook_state, bucket)
    except Exception as e:  # a poisoned communicator raises at issue
        manager.note_error(e)
        return _done(buf)

    def settled(f: torch.futures.Future) -> torch.Tensor:
        try:
            return f.value()
        except Exception as e:
            manager.note_error(e)
            return buf

    return fut.then(settled)


class DistributedDataParallel(_TorchDDP):
    """torch's DDP over the replicas of ``manager``. ``compression``: as in
    ``braid.comm.ddp.comm_hook`` (None exact, "int8", "int4", "topk", "bf16", "auto", or a
    compressor). Other keyword arguments go to torch's DDP (``process_group`` excepted). CPU
    modules (a braid Communicator carries the buckets)."""

    def __init__(
        self,
        manager: Manager,
        module: torch.nn.Module,
        *,
        compression: Union[Compressor, str, None] = None,
        min_compress_bytes: Optional[int] = None,
        **ddp_kwargs: Any,
    ):
        if not isinstance(manager, Manager):
            raise TypeError(f"manager must be a braid.ft.Manager, got {type(manager).__name__}")
        if "process_group" in ddp_kwargs:
            raise ValueError("process_group is the Manager's: braid.ft.DistributedDataParallel takes none")
        super().__init__(module, process_group=local_group(), **ddp_kwargs)
        state, _ = braid_ddp.comm_hook(None, compression, min_compress_bytes=min_compress_bytes)
        manager.attach_ddp(state, self._lay_out_buckets_anew)
        self.manager = manager
        self.register_comm_hook(manager, _hook)

    def _lay_out_buckets_anew(self) -> None:
        """Every replica's buckets must hold the same parameters in the same order. torch lays them
        out in reverse parameter order, then, after the first step, once more in the order the
        gradients became ready; a replica in its first step would disagree with the others. So
        when a replica joins, every member builds its reducer anew (as torch does when it
        unpickles a DDP module): all start from the first layout and rebuild alike after the
        epoch's first step."""
        self.reducer._remove_autograd_hooks()
        parameters, expect_sparse_gradient = self._build_params_for_reducer()
        names = self._build_debug_param_to_name_mapping(parameters)
        self._ddp_init_helper(parameters, expect_sparse_gradient, names, self.static_graph)
        dist._register_comm_hook(self.reducer, self.manager, _hook)


class Optimizer(torch.optim.Optimizer):
    """Wraps ``optimizer``: ``zero_grad()`` starts the Manager's step, ``step()`` applies the
    wrapped step only when the Manager commits (returns whether it did). Everything else (param
    groups, state, ``state_dict``, learning-rate schedulers) is the wrapped optimizer's."""

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer):  # noqa: D107 (no super call:
        # the wrapped optimizer holds the parameters and the state)
        if not isinstance(manager, Manager):
            raise TypeError(f"manager must be a braid.ft.Manager, got {type(manager).__name__}")
        self.manager = manager
        self.optimizer = optimizer

    @property
    def param_groups(self):  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self):  # type: ignore[override]
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> bool:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "braid.ft.Optimizer.step takes no closure: the step is decided by the replicas' vote"
            )
        if self.manager.should_commit():
            self.optimizer.step()
            return True
        return False

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"braid.ft.Optimizer({self.optimizer!r})"
