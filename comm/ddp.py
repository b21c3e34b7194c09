"""DDP communication hook: gradient buckets reduced by braid, exactly or compressed, while
backward keeps running.

    state, hook = braid.comm.ddp.comm_hook(c, compression=comm.Int8Quantizer())       # braid
    state, hook = braid.comm.ddp.comm_hook(None, compression=comm.Int8Quantizer())    # default group
    state, hook = braid.comm.ddp.comm_hook(None, comm.Int8Quantizer(), hierarchical=True)
    state, hook = braid.comm.ddp.comm_hook(c, compression="auto")     # chosen per bucket (adaptive.py)
    model.register_comm_hook(state, hook)
    state.decisions()                                                  # "auto": choice and reason per bucket
    state, hook = braid.comm.ddp.comm_hook(c, optimizer=braid.optim.AdamW(model.parameters()))
                                        # each bucket stepped as soon as it is reduced: no opt.step()

Over a braid communicator the hook issues an async braid all-reduce per bucket and returns the
torch future that braid's progress thread completes. Over a torch process group (NCCL, gloo,
braid's c10d backend) braid compresses on the bucket's device and the group carries the bytes:
CPU buckets on braid's issue thread (in bucket order), CUDA buckets on the current stream, with a
``Future(devices=[bucket device])`` completed on it (comm/core/group_carrier.py). Either way the
averaged (decompressed) gradients land in place in ``bucket.buffer()``, so
``gradient_as_bucket_view=True`` works as is.
"""

from typing import Any, Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

import braid.comm._C as _C  # the extension module itself (not the package)

from .compression import COMPRESSOR_NAMES, FLOAT_DTYPES, Adaptive, Compressor, compressor
from .core import group_carrier
from .core.communicator import Communicator
from .core.group import renamed_args
from .core.group_carrier import HostGroups

# Buckets smaller than this go uncompressed: their all-reduce costs its latency, not its bytes,
# and compression would add two kernel passes and a second collective for nothing.
DEFAULT_MIN_COMPRESS_BYTES = 64 * 1024


def _min_bytes_from_env() -> int:
    """BRAID_COMPRESS_MIN_BYTES: a byte count, optionally with a K, M or G suffix, read by the
    core's parser of every BRAID_* size (a ValueError naming the variable when malformed)."""
    return _C.env_bytes("BRAID_COMPRESS_MIN_BYTES", DEFAULT_MIN_COMPRESS_BYTES)


Carrier = Union[Communicator, dist.ProcessGroup, HostGroups, None]


class CommHookState:
    """State of the braid DDP hook: what carries the buckets (a braid communicator, a torch process
    group, None for the default group, or HostGroups), the compressor (with its residuals) and the
    number of synchronized steps seen.

    Pickling and ``state_dict()`` keep the compressor state and the step but not the communicator
    or group (live connections): after loading, set ``state.group`` (``state.process_group``,
    torch's hook states' name, and ``state.communicator`` are the same attribute) before the next
    backward. A state on the default group (None) needs nothing: it finds the default group again.

    The compressor's warm-up counts the steps this state has run since it was built or loaded
    (``steps_here``), not the restored ``step``: a DDP built to resume from a checkpoint lays out
    its first step's buckets in another order than the one the residuals were kept for, and
    rebuilds them after that step, as the original run did. So the first ``warmup_steps`` steps
    after loading are exact again, and compression resumes on the bucket layout whose residuals
    were saved.
    """

    @renamed_args(process_group="group")
    def __init__(self, group: Carrier, compression: Optional[Compressor], min_compress_bytes: int,
                 hierarchical: bool = False, optimizer: Any = None):
        self.hierarchical = hierarchical  # a group to split by host at first use
        self.optimizer = optimizer  # a braid.optim optimizer stepped bucket by bucket, or None
        self.group = group
        self.compression = compression
        self.min_compress_bytes = min_compress_bytes
        self.step = 0
        self.steps_here = 0

    @property
    def group(self) -> Carrier:
        return self._group

    @group.setter
    def group(self, value: Carrier) -> None:
        self._group = value
        self._detached = False
        self._carrier = value if isinstance(value, Communicator) else None  # group carriers: at first use

    process_group = group  # the name torch's hook states use (PowerSGDState.process_group)
    communicator = group  # the name of braid-only releases

    def carrier(self) -> Any:
        """The braid communicator, or the group carrier, that moves the buckets."""
        if self._detached:
            raise RuntimeError("the braid comm hook state has no communicator or process group (set "
                               "state.group after loading a checkpoint)")
        if self._carrier is None:
            group = self._group
            if self.hierarchical and not isinstance(group, HostGroups):
                # At the first bucket of the first step: every rank of the job gets here in the
                # same order, as host_groups (a new_group) needs.
                group = group_carrier.host_groups(group_carrier.process_group_for(group, "group"))
            self._carrier = group_carrier.carrier_of(group, "group")
        return self._carrier

    def decisions(self) -> dict:
        """With ``compression="auto"`` (an :class:`~braid.comm.Adaptive`): the choice per bucket
        index and why ({index: Decision(choice, reason, ...)}; empty before the first decision
        round, at step ``warmup_steps``). Other compressors make no decisions: {}."""
        return self.compression.decisions() if isinstance(self.compression, Adaptive) else {}

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "min_compress_bytes": self.min_compress_bytes,
            "compression": None if self.compression is None else self.compression.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["compression"] is None) != (self.compression is None):
            raise ValueError("state and hook disagree on whether gradients are compressed")
        self.step = int(state["step"])
        self.steps_here = 0
        self.min_compress_bytes = int(state["min_compress_bytes"])
        if self.compression is not None:
            self.compression.load_state_dict(state["compression"])

    def __getstate__(self) -> dict:
        # The optimizer is not part of it (its state_dict is the optimizer's own): set
        # state.optimizer again after loading, as the process group.
        return {
            "compression": self.compression,
            "min_compress_bytes": self.min_compress_bytes,
            "step": self.step,
            "default_group": self._group is None,
            "hierarchical": self.hierarchical,
        }

    def __setstate__(self, state: dict) -> None:
        self.hierarchical = state.get("hierarchical", False)
        self.group = None
        self._detached = not state.get("default_group", False)
        self.compression = state["compression"]
        self.min_compress_bytes = state["min_compress_bytes"]
        self.step = state["step"]
        self.steps_here = 0
        self.optimizer = None


def _bucket_tensor(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


# Annotations are real objects here (no `from __future__ import annotations`): DDP compares the
# hook's annotations with dist.GradBucket and Future[Tensor] and rejects strings.
def braid_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages ``bucket.buffer()`` over the ranks in place with braid; compressed when the state
    has a compressor, the bucket holds floats, is at least ``min_compress_bytes`` and the warm-up
    is over. Returns a future of the bucket's tensor."""
    c = state.carrier()
    buf = bucket.buffer()
    steps_here = state.steps_here
    if bucket.is_last():
        state.step += 1
        state.steps_here += 1
    comp = state.compression
    small = buf.numel() * buf.element_size() < state.min_compress_bytes
    if comp is not None and not small and buf.dtype in FLOAT_DTYPES:
        work = comp.all_reduce(c, buf, "avg", key=bucket.index(), async_op=True, step=steps_here)
        fut = work.get_future()
    elif isinstance(c, Communicator):
        fut = c.all_reduce(buf, op="avg", async_op=True).get_future()
    else:  # the group's own all-reduce, issued in order with the compressed buckets
        fut = group_carrier.issue(lambda: c.all_reduce(buf, True), [buf], buf.device)
    if bucket.is_last() and isinstance(comp, Adaptive):
        # The last bucket is ready: the backward is over, which closes the buckets' windows.
        comp.end_step()
    if state.optimizer is not None:
        optimizer = state.optimizer
        return fut.then(lambda done: _step_bucket(optimizer, bucket, done))
    return fut.then(_bucket_tensor)


def _step_bucket(optimizer: Any, bucket: dist.GradBucket, done: torch.futures.Future) -> torch.Tensor:
    """Steps the parameters of a reduced bucket, each with its averaged gradient (a view of the
    bucket); runs as the bucket's all-reduce completes, while the backward goes on."""
    reduced = _bucket_tensor(done)
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        optimizer.step_param(param, grad)
    return reduced


@renamed_args(process_group="group")
def comm_hook(
    group: Carrier = None,
    compression: Union[Compressor, str, None] = None,
    *,
    min_compress_bytes: Optional[int] = None,
    hierarchical: bool = False,
    optimizer: Any = None,
) -> Tuple[CommHookState, Callable[..., Any]]:
    """Returns ``(state, hook)`` for ``model.register_comm_hook(state, hook)``.

    Args:
        group: what carries the buckets, over the DDP ranks (same ranks, same order): a
            braid ``Communicator`` (CPU), a torch ``ProcessGroup`` (NCCL for CUDA models, gloo or
            braid's c10d backend on CPU; braid compresses on the bucket's device and the group
            moves the bytes), ``None`` for the default group, or a ``HostGroups``. ``None`` is
            looked up at the first bucket, so the state can be built before
            ``init_process_group`` (as Lightning's ``DDPStrategy(ddp_comm_state=...)`` does).
        compression: None for the exact average, a compressor (``Int8Quantizer()``,
            ``Int4Quantizer()``, ``TopK(0.01)``, ``Cast(torch.bfloat16)``) or the name of one with
            its defaults ("int8", "int4", "topk", "bf16", "fp16"), or "auto" (``comm.Adaptive()``:
            per bucket the choice the measured link, codec costs and overlap predict fastest,
            within an error budget; see ``state.decisions()``); its warm-up counts
            DDP steps, so the first ``warmup_steps`` steps (and the bucket rebuild after step 1)
            are exact, and so are the first ones after loading a checkpoint into the state.
        min_compress_bytes: buckets smaller than this are reduced exactly (default
            ``BRAID_COMPRESS_MIN_BYTES`` or 64 KiB).
        hierarchical: over a process group, exact inside each host and compressed only across
            hosts: the group is split by host identity with ``group_carrier.host_groups``, which
            every rank of the job calls (as ``new_group``; for None, at the first bucket); for a
            subgroup, build the HostGroups with it on every rank and pass that instead. A braid
            communicator does this by itself.
        optimizer: a ``braid.optim`` optimizer (``Adam``, ``AdamW``, ``SGD``) over the model's
            parameters, stepped by the hook bucket by bucket as each bucket's average completes,
            while the backward still computes the buckets after it (the step overlaps the
            backward and the other buckets' communication). Call ``opt.zero_grad()`` as usual but
            not ``opt.step()`` (it raises: the parameters were stepped already); learning-rate
            schedulers work on it as on any optimizer. Steps happen only in backward passes that
            synchronize (not under ``no_sync()``). CPU float32 parameters.
    """
    if not isinstance(hierarchical, bool):
        raise TypeError(f"hierarchical must be a bool, got {hierarchical!r}")
    if not isinstance(group, (Communicator, dist.ProcessGroup, HostGroups, int, type(None))):
        raise TypeError("group must be a braid.comm.Communicator, a torch.distributed.ProcessGroup, "
                        f"a HostGroups or None (the default group), got {type(group).__name__}")
    if isinstance(group, Communicator):
        if hierarchical:
            raise ValueError("hierarchical=True applies to torch process groups: a braid Communicator whose "
                             "ranks span hosts is already exact on each host and compressed between hosts")
    elif group is not None and not isinstance(group, HostGroups):
        group_carrier.process_group_for(group, "group")  # a member of it
        if hierarchical:
            group = group_carrier.host_groups(group)
    if compression == "auto":
        compression = Adaptive()
    elif isinstance(compression, str) and compression not in COMPRESSOR_NAMES:
        names = ", ".join(map(repr, ("auto",) + COMPRESSOR_NAMES))
        raise ValueError(f"compression must be one of {names}, a braid.comm compressor or None, "
                         f"got {compression!r}")
    elif isinstance(compression, str):
        compression = compressor(compression)
    if compression is not None and not isinstance(compression, Compressor):
        raise TypeError(
            f"compression must be a braid.comm compressor or None, got {type(compression).__name__}"
        )
    if min_compress_bytes is None:
        min_compress_bytes = _min_bytes_from_env()
    elif (
        isinstance(min_compress_bytes, bool)
        or not isinstance(min_compress_bytes, int)
        or min_compress_bytes < 0
    ):
        raise ValueError(f"min_compress_bytes must be an int >= 0, got {min_compress_bytes!r}")
    if optimizer is not None:
        steps_params = callable(getattr(optimizer, "step_param", None))
        if not steps_params or not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a braid.optim optimizer (Adam, AdamW, SGD: they step one "
                            f"parameter at a time), got {type(optimizer).__name__}")
        optimizer.stepped_by = "braid's DDP comm hook"
    lazy_split = hierarchical and group is None
    return CommHookState(group, compression, min_compress_bytes, lazy_split, optimizer), braid_hook
