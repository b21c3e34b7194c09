"""The group interface every braid layer speaks, and its implementation over torch process groups.

A layer (TP, the ZeRO wrapper, FSDP2's comms, ring attention, the DDP hook) needs from the ranks it
runs on only what :class:`Group` names: this rank and the group's size, the collectives below on
contiguous tensors (blocking, or async returning a work with ``wait()`` / ``is_completed()`` /
``get_future()``), the host layout where it is known, and optional capabilities. Two things are
groups:

- braid's :class:`~braid.comm.Communicator` (CPU tensors; CUDA tensors staged through pinned host
  memory in builds with CUDA), which advertises its fused C++ paths as capabilities;
- any ``torch.distributed.ProcessGroup`` (NCCL, gloo, braid's own c10d backend, a DeviceMesh
  dimension's group) through :class:`ProcessGroupAdapter`.

Every public layer takes a Communicator, a ProcessGroup, or None (the default process group,
resolved at first use: a DDP hook state can be built before ``init_process_group``) and turns it
into a Group with :func:`as_group`. Ranks are the group's own (0 .. size-1): on a sub-group (TP
inside DP) rank 0 is the sub-group's first member, and ``broadcast(t, src)`` takes such a rank.

Collectives of one group must be issued in the same order on every rank, as torch's are.
"""
from __future__ import annotations

import abc
import functools
import threading
import warnings
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .vocabulary import AVG, REDUCE_OPS, Op, op_code
from .work import Work, seconds

# Capabilities a group may advertise (Group.capabilities) beyond the collectives every group has.
COMPRESSED_ALL_REDUCE = "compressed_all_reduce"  # all_reduce(t, compression=q) in one fused call
HIERARCHICAL = "hierarchical"  # hierarchical algorithms inside its own collectives
# empty(size, dtype=) / zeros(...): CPU tensors the ranks of a host read in place (collective calls)
REGISTERED_BUFFERS = "registered_buffers"



def capabilities_of(group: Any) -> frozenset:
    """The capabilities ``group`` advertises (``Group.capabilities``); none for an object that
    does not declare them as a set (a duck-typed stand-in, a ProcessGroup, None)."""
    caps = getattr(group, "capabilities", None)
    return frozenset(caps) if isinstance(caps, (frozenset, set, tuple, list)) else frozenset()


# What duck-typed stand-ins (a test's recorder, a user's wrapper) must have to pass as a group.
GROUP_METHODS = ("rank", "world_size", "all_reduce", "all_gather", "reduce_scatter", "broadcast")

_DIST_OP = {
    REDUCE_OPS["sum"]: dist.ReduceOp.SUM, REDUCE_OPS["max"]: dist.ReduceOp.MAX,
    REDUCE_OPS["min"]: dist.ReduceOp.MIN, REDUCE_OPS["prod"]: dist.ReduceOp.PRODUCT,
    REDUCE_OPS["band"]: dist.ReduceOp.BAND, REDUCE_OPS["bor"]: dist.ReduceOp.BOR,
    REDUCE_OPS["bxor"]: dist.ReduceOp.BXOR,
}
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor; both spellings take the same
# arguments.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Group(abc.ABC):
    """What a braid layer uses of the ranks it runs on.

    Tensors are contiguous; ``all_gather``'s output and ``reduce_scatter``'s input hold
    ``world_size`` times the other tensor's elements, rank r's piece r-th. ``op`` is one of
    "sum", "avg", "max", "min", "prod" (or torch's ReduceOp). With ``async_op=True`` a call
    returns a work: ``wait()`` (on CUDA tensors: makes the current stream wait), ``is_completed()``,
    ``get_future()``; otherwise it returns None once the result is in place (on CUDA: ordered on
    the current stream)."""

    #: Optional fused paths this group offers (COMPRESSED_ALL_REDUCE, HIERARCHICAL,
    #: REGISTERED_BUFFERS).
    capabilities: frozenset = frozenset()

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of ranks in the group."""

    @property
    def local_world_size(self) -> Optional[int]:
        """Ranks on this rank's host, where the group knows its host layout (else None)."""
        return None

    @property
    def num_hosts(self) -> Optional[int]:
        """Hosts the group spans, where known (else None)."""
        return None

    def device_problem(self, device: torch.device) -> Optional[str]:
        """Why tensors on ``device`` cannot travel over this group (None when they can)."""
        return None

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: Op = "sum", async_op: bool = False) -> Any:
        """Reduces ``tensor`` over the ranks, in place."""

    @abc.abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        """``output`` = every rank's ``input``, in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op = "sum",
                       async_op: bool = False) -> Any:
        """``output`` = the reduction over ranks of ``input``'s piece ``rank``."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any:
        """``tensor`` = rank ``src``'s ``tensor`` (``src`` a rank of this group)."""

    @abc.abstractmethod
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   output_split_sizes: Optional[Sequence[int]] = None,
                   input_split_sizes: Optional[Sequence[int]] = None) -> Any:
        """``input`` in ``world_size`` equal pieces, piece j to rank j; ``output`` piece j from rank j.

        With split sizes (as ``torch.distributed.all_to_all_single``): ``input``'s rows (dimension
        0) in pieces of ``input_split_sizes[j]`` rows for rank j, ``output``'s in pieces of
        ``output_split_sizes[j]`` rows from rank j, in rank order; a list left None means equal
        pieces. Rank i's ``input_split_sizes[j]`` must equal rank j's ``output_split_sizes[i]``
        (braid's Communicator raises CollectiveMismatch where they differ, not every backend
        checks): exchange the counts first, with an equal all_to_all."""

    @abc.abstractmethod
    def barrier(self, async_op: bool = False) -> Any:
        """Returns once every rank has called it."""

    @abc.abstractmethod
    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> Any:
        """Posts the send of ``send`` to rank ``dst`` and the receive of ``recv`` from rank ``src``
        together (a ring step cannot wait on its own send); returns a work whose ``wait()``
        completes both."""


class GroupWork(Work):
    """An async call on a group: a process group's work, or the future of a job braid issued
    (compression over a process group: comm/core/group_carrier.py's issue thread, or a CUDA stream),
    and what runs once when it is done (the division of an average, a copy back from host
    memory). A :class:`~braid.comm.Work`: ``wait()``, ``is_completed()``, ``get_future()`` (a
    future of ``[result]``)."""

    __slots__ = ("_work", "_finish", "_result", "_finished", "_future", "_done")

    def __init__(self, work: Any, finish: Optional[Callable[[], None]] = None,
                 result: Optional[torch.Tensor] = None):
        self._work, self._finish, self._result = work, finish, result
        self._finished = finish is None
        self._future: Optional[torch.futures.Future] = None
        self._done: Optional[threading.Event] = None
        if isinstance(work, torch.futures.Future):  # a job's future: its value is the result
            self._future, self._done = work, threading.Event()
            work.add_done_callback(lambda _: self._done.set())

    def _run_finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._finish()

    def _wait_source(self, timeout: Optional[Union[float, timedelta]]) -> bool:
        """Waits for the work or job itself; False if ``timeout`` passed first."""
        if timeout is None:
            if self._done is None:
                self._work.wait()
            return True
        secs = seconds(timeout, zero_ok=True)
        if self._done is not None:
            return self._done.wait(secs)
        return bool(self._work.wait(timedelta(seconds=secs)))

    def wait(self, timeout: Optional[Union[float, timedelta]] = None) -> bool:
        """Waits for the call and completes the result (CUDA: makes the current stream wait);
        raises the call's error. With ``timeout`` (seconds or a timedelta) returns False if it is
        still running then; 0 polls."""
        if not self._wait_source(timeout):
            return False
        if self._future is not None:  # the future's callback finishes the result
            self._future.wait()
        else:
            self._run_finish()
        return True

    def is_completed(self) -> bool:
        return self._done.is_set() if self._done is not None else self._work.is_completed()

    def is_success(self) -> bool:
        if not self.is_completed():
            return False
        try:
            self.wait(0)
        except Exception:  # noqa: BLE001 - the call's error: not a success
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        """A future holding ``[result]`` once the call is done and its result complete (on CUDA
        tensors a ``Future(devices=...)`` whose value is ready on the current stream after
        ``wait()``)."""
        if self._future is None:
            result = self._result

            def finished(fut: torch.futures.Future) -> list:
                fut.value()  # raises the group's error
                self._run_finish()
                return [result]

            try:
                source = self._work.get_future()
            except RuntimeError:  # gloo's reduce-scatter work has no future: a thread waits for it
                source = _future_of_wait(self._work)
                # From now on wait() waits for that thread, never calls the work's wait() again:
                # gloo's reduce-scatter copies its result out at each wait(), which would overwrite
                # what the finish did (an average's division) with the sum.
                self._done = threading.Event()
                source.add_done_callback(lambda _: self._done.set())
            self._future = source.then(finished)
        return self._future

    def completed_at(self) -> Optional[float]:
        """Not recorded for a group's calls: None."""
        return None

    def describe(self) -> str:
        """"group call running", "group call done" or "group call failed: <error>"."""
        if not self.is_completed():
            return "group call running"
        try:
            self.wait(0)
        except Exception as e:  # noqa: BLE001 - described, not raised
            return f"group call failed: {type(e).__name__}: {e}"
        return "group call done"

    def __repr__(self) -> str:
        return f"<braid.comm.core.group.GroupWork {'done' if self.is_completed() else 'running'}>"


def _row_splits(sizes: Optional[Sequence[int]], t: torch.Tensor, n: int, name: str) -> list:
    """Split sizes along ``t``'s dimension 0 as a list of ``n`` ints (None: equal pieces), or a
    ValueError naming ``name``."""
    rows = t.shape[0] if t.dim() else 1
    if sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all: {name} is None (equal pieces) but dimension 0 ({rows}) does not "
                             f"divide by world_size ({n})")
        return [rows // n] * n
    if isinstance(sizes, torch.Tensor):
        sizes = sizes.tolist()
    values = [int(v) for v in sizes]
    if len(values) != n or any(v < 0 for v in values) or sum(values) != rows:
        raise ValueError(f"all_to_all: {name} must hold world_size ({n}) non-negative counts summing to "
                         f"dimension 0 ({rows}), got {values}")
    return values


def _future_of_wait(work: Any) -> torch.futures.Future:
    """A future completed (with None, or the error) once ``work.wait()`` returns, by a thread."""
    fut: torch.futures.Future = torch.futures.Future()

    def wait() -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - the future carries it to its waiter
            fut.set_exception(e)
            return
        fut.set_result(None)

    threading.Thread(target=wait, daemon=True, name="braid-group-wait").start()
    return fut


class WorkList(Work):
    """Several works waited for as one (a send and a receive posted together), then ``finish`` (a
    copy out of host memory), once. A :class:`~braid.comm.Work`."""

    __slots__ = ("_works", "_finish")

    def __init__(self, works: list, finish: Optional[Callable[[], None]] = None):
        self._works, self._finish = works, finish

    def wait(self, timeout: Optional[Union[float, timedelta]] = None) -> bool:
        """Waits for every work (each given ``timeout``, when set: False if one is still running
        then), then runs ``finish``; raises a work's error."""
        limit = None if timeout is None else timedelta(seconds=seconds(timeout, zero_ok=True))
        for w in self._works:
            if not (w.wait() if limit is None else w.wait(limit)):
                return False
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def completed_at(self) -> Optional[float]:
        return None

    def get_future(self) -> torch.futures.Future:
        """A future of the works' outputs, completed once every one is (``finish`` run first)."""
        def done(fut: torch.futures.Future) -> list:
            for f in fut.value():
                f.value()  # raises a work's error
            self.wait()  # runs finish once
            return [t for f in fut.value() for t in (f.value() or [])]

        return torch.futures.collect_all([w.get_future() for w in self._works]).then(done)

    def describe(self) -> str:
        states = [w.describe() if hasattr(w, "describe") else ("done" if w.is_completed() else "running")
                  for w in self._works]
        return "; ".join(states)

    def __repr__(self) -> str:
        return f"<braid.comm.core.group.WorkList {self.describe()}>"


class _DoneWork(Work):
    """The work of a call that had nothing to move (a group of one): already complete."""

    __slots__ = ("_result",)

    def __init__(self, result: Optional[torch.Tensor]):
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def completed_at(self) -> Optional[float]:
        return None

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([self._result])
        return fut

    def describe(self) -> str:
        return "done (nothing to move)"

    def __repr__(self) -> str:
        return f"<braid.comm.core.group._DoneWork {self.describe()}>"


def _backends_by_device(group: dist.ProcessGroup) -> dict:
    """{"cpu": "gloo", "cuda": "nccl", ...}: the backend serving each device type in ``group``."""
    try:
        config = str(dist.get_backend_config(group))
    except (RuntimeError, ValueError, AttributeError):
        return {}
    out = {}
    for part in config.split(","):
        device, sep, backend = part.partition(":")
        if sep:
            out[device.strip()] = backend.strip()
    return out


class ProcessGroupAdapter(Group):
    """A ``torch.distributed.ProcessGroup`` as a braid :class:`Group`.

    Averages are the group's sum divided by its size (gloo has no average). Tensors on a device
    the group serves only through gloo (CUDA tensors on a gloo group) travel through host memory:
    copied down, reduced or gathered there, copied back on the caller's stream."""

    capabilities = frozenset()

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._rank = group.rank()
        self._size = group.size()
        self._backends = _backends_by_device(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def device_problem(self, device: torch.device) -> Optional[str]:
        kind = torch.device(device).type
        if kind in self._backends or not self._backends:
            return None
        if kind != "cpu" and "cpu" in self._backends:
            return None  # staged through host memory by the group's CPU backend
        served = ", ".join(f"{d} ({b})" for d, b in self._backends.items())
        return f"the process group serves {served} tensors only, not {kind}"

    def backend_for(self, device: torch.device) -> Optional[str]:
        """The name of the group's backend for tensors on ``device`` ("gloo", "nccl", "braid"), or
        None where the group's configuration names none for that device type."""
        return self._backends.get(torch.device(device).type)

    def _staged(self, t: torch.Tensor) -> bool:
        if t.device.type == "cpu":
            return False
        backend = self.backend_for(t.device)
        return backend is None or backend == "gloo"

    def _issue(self, launch: Callable[..., Any], outputs: tuple, inputs: tuple, async_op: bool,
               after: Optional[Callable[[], None]], result: torch.Tensor) -> Any:
        """Runs ``launch(*outputs, *inputs, async_op)`` on the group, through host copies where
        the tensors' device is not the group's; ``after`` completes the result (an average's
        division) once the call is done."""
        finish = after
        if any(self._staged(t) for t in outputs + inputs):
            host_in = tuple(t.cpu() for t in inputs)
            # An in-place call (all_reduce, broadcast: the output is the input) stays in place on
            # its host copy.
            in_place = {id(i): h for i, h in zip(inputs, host_in)}
            host_out = tuple(in_place.get(id(o)) if id(o) in in_place else torch.empty(o.shape, dtype=o.dtype)
                             for o in outputs)
            caller_out = outputs

            def copy_back() -> None:
                for o, h in zip(caller_out, host_out):
                    o.copy_(h)
                if after is not None:
                    after()

            finish, outputs, inputs = copy_back, host_out, host_in
        work = launch(*outputs, *inputs, async_op=async_op)
        if not async_op:
            if finish is not None:
                finish()
            return None
        return GroupWork(work, finish, result)

    def _average(self, tensor: torch.Tensor) -> Callable[[], None]:
        n = self._size

        def divide() -> None:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(n)
            else:
                tensor.div_(n, rounding_mode="trunc")
        return divide

    def _reduce_op(self, op: Op) -> tuple:
        """(torch's op, whether the result is then divided by the size)."""
        code = op_code(op)
        if code == AVG:
            return dist.ReduceOp.SUM, True
        return _DIST_OP[code], False

    def all_reduce(self, tensor: torch.Tensor, op: Op = "sum", async_op: bool = False) -> Any:
        reduce_op, average = self._reduce_op(op)
        if self._size == 1:
            return _DoneWork(tensor) if async_op else None
        group = self.group

        def launch(t, _t, async_op):
            return dist.all_reduce(t, op=reduce_op, group=group, async_op=async_op)

        return self._issue(launch, (tensor,), (tensor,), async_op, self._average(tensor) if average else None,
                           tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
        if output.numel() != self._size * input.numel():
            raise ValueError(f"all_gather: output has {output.numel()} elements, it must hold world_size "
                             f"({self._size}) x input's {input.numel()}")
        group = self.group

        def launch(out, inp, async_op):
            return _all_gather_single(out.view(-1), inp.view(-1), group=group, async_op=async_op)

        return self._issue(launch, (output,), (input,), async_op, None, output)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op = "sum",
                       async_op: bool = False) -> Any:
        if input.numel() != self._size * output.numel():
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, it must hold world_size "
                             f"({self._size}) x output's {output.numel()}")
        reduce_op, average = self._reduce_op(op)
        group = self.group

        def launch(out, inp, async_op):
            return _reduce_scatter_single(out.view(-1), inp.view(-1), op=reduce_op, group=group,
                                              async_op=async_op)

        return self._issue(launch, (output,), (input,), async_op, self._average(output) if average else None,
                           output)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Any:
        if isinstance(src, bool) or not isinstance(src, int):
            raise TypeError(f"src must be an int rank of the group, got {type(src).__name__}")
        if not 0 <= src < self._size:
            raise ValueError(f"src must be a rank of the group, in [0, {self._size}), got {src}")
        if self._size == 1:
            return _DoneWork(tensor) if async_op else None
        group = self.group

        def launch(t, _t, async_op):
            return dist.broadcast(t, group_src=src, group=group, async_op=async_op)

        return self._issue(launch, (tensor,), (tensor,), async_op, None, tensor)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   output_split_sizes: Optional[Sequence[int]] = None,
                   input_split_sizes: Optional[Sequence[int]] = None) -> Any:
        group = self.group
        if output_split_sizes is None and input_split_sizes is None:
            if output.numel() != input.numel() or input.numel() % self._size:
                raise ValueError(f"all_to_all: input and output must have the same number of elements, "
                                 f"divisible by world_size ({self._size}); got {input.numel()} and "
                                 f"{output.numel()}")

            def launch(out, inp, async_op):
                return dist.all_to_all_single(out.view(-1), inp.view(-1), group=group, async_op=async_op)
        else:
            out_splits = _row_splits(output_split_sizes, output, self._size, "output_split_sizes")
            in_splits = _row_splits(input_split_sizes, input, self._size, "input_split_sizes")

            def launch(out, inp, async_op):
                return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)

        return self._issue(launch, (output,), (input,), async_op, None, output)

    def barrier(self, async_op: bool = False) -> Any:
        work = dist.barrier(group=self.group, async_op=async_op)
        return GroupWork(work) if async_op else None

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> WorkList:
        ops = [dist.P2POp(dist.isend, send, group=self.group, group_peer=dst),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=src)]
        return WorkList(dist.batch_isend_irecv(ops))

    def __deepcopy__(self, memo: dict) -> "ProcessGroupAdapter":
        return self  # a group is shared, never copied (a deep copy of a sharded model keeps it)

    def __repr__(self) -> str:
        backends = ",".join(f"{d}:{b}" for d, b in self._backends.items()) or "?"
        return f"<braid ProcessGroupAdapter rank {self._rank} of {self._size} ({backends})>"


class DefaultGroup(Group):
    """The default process group, looked up when first used (not when a layer or hook state is
    built, which may happen before ``init_process_group``), then fixed."""

    capabilities = frozenset()

    def __init__(self, arg: str = "group"):
        self._arg = arg
        self._group: Optional[ProcessGroupAdapter] = None

    def resolve(self) -> ProcessGroupAdapter:
        """The default group's adapter; looked up again if the default group was destroyed and
        made anew since (a process that initializes torch.distributed twice)."""
        group = self._group
        if group is None or (group.group is not dist.group.WORLD):
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(f"{self._arg} is None (the default process group), but torch.distributed "
                                 "is not initialized: call torch.distributed.init_process_group first, or "
                                 "pass a group")
            group = self._group = adapter(dist.group.WORLD)
        return group

    @property
    def resolved(self) -> bool:
        return self._group is not None

    @property
    def rank(self) -> int:
        return self.resolve().rank

    @property
    def world_size(self) -> int:
        return self.resolve().world_size

    def all_reduce(self, tensor, op="sum", async_op=False):
        return self.resolve().all_reduce(tensor, op, async_op)

    def all_gather(self, output, input, async_op=False):
        return self.resolve().all_gather(output, input, async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        return self.resolve().reduce_scatter(output, input, op, async_op)

    def broadcast(self, tensor, src=0, async_op=False):
        return self.resolve().broadcast(tensor, src, async_op)

    def all_to_all(self, output, input, async_op=False, *, output_split_sizes=None, input_split_sizes=None):
        return self.resolve().all_to_all(output, input, async_op, output_split_sizes=output_split_sizes,
                                         input_split_sizes=input_split_sizes)

    def barrier(self, async_op=False):
        return self.resolve().barrier(async_op)

    def send_recv(self, send, dst, recv, src):
        return self.resolve().send_recv(send, dst, recv, src)

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.resolve().group

    def device_problem(self, device: torch.device) -> Optional[str]:
        return self.resolve().device_problem(device)

    def __deepcopy__(self, memo: dict) -> "DefaultGroup":
        return self

    def __repr__(self) -> str:
        return f"<braid DefaultGroup {'-> ' + repr(self._group) if self._group else '(not yet resolved)'}>"


# One adapter per ProcessGroup while anything uses it. Both sides are weak: an adapter holds its
# group, so a strong value would keep the key alive for good, and with it the group's threads and
# sockets after ``destroy_process_group`` (gloo's, about 100 wake-ups a second each).
_ADAPTERS: "weakref.WeakKeyDictionary[dist.ProcessGroup, weakref.ref]" = weakref.WeakKeyDictionary()


def adapter(group: dist.ProcessGroup) -> ProcessGroupAdapter:
    """The :class:`ProcessGroupAdapter` of ``group``: the one in use if there is one, else a new
    one. The adapter keeps its group alive; nothing here keeps the adapter."""
    ref = _ADAPTERS.get(group)
    found = None if ref is None else ref()
    if found is None:
        found = ProcessGroupAdapter(group)
        _ADAPTERS[group] = weakref.ref(found)
    return found


def renamed_args(**renames: str) -> Callable:
    """Keeps keyword arguments that were renamed working: each old name (a keyword of
    ``renames``) reaches the function as its new name (the value), with a DeprecationWarning;
    both names at once is a TypeError. The layers' group argument is ``group=`` everywhere; it
    was ``communicator=`` (tp, cp, fsdp) and ``process_group=`` (the DDP hook)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items() if kwargs else ():  # positional calls: nothing to do
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__qualname__}() got both {old}= and {new}=: pass {new}= only")
                    warnings.warn(f"{fn.__qualname__}(): {old}= is now {new}=", DeprecationWarning,
                                  stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return wrap


def as_group(group: Any, arg: str = "group", where: Optional[str] = None) -> Group:
    """``group`` as a :class:`Group`: a braid Communicator or other Group as it is, a
    ``torch.distributed.ProcessGroup`` adapted, None as the default process group (resolved at
    first use). An object with a communicator's methods (``GROUP_METHODS``) passes as it is. A
    TypeError naming ``arg`` (prefixed with ``where``) for anything else, a ValueError for a rank
    outside the group it was handed (``GroupMember.NON_GROUP_MEMBER``)."""
    prefix = f"{where}: " if where else ""
    if isinstance(group, Group):
        return group
    if group is None:
        return DefaultGroup(arg)
    if isinstance(group, dist.ProcessGroup):
        return adapter(group)
    if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{prefix}{arg}: this rank is not a member of the group (torch.distributed."
                         "new_group returned GroupMember.NON_GROUP_MEMBER here): only the group's ranks "
                         "may use it")
    if all(hasattr(group, name) for name in GROUP_METHODS):
        return group
    raise TypeError(f"{prefix}{arg} must be a braid.comm.Communicator, a torch.distributed.ProcessGroup or "
                    f"None (the default group), got {type(group).__name__}")


def check_device(group: Any, device: torch.device, what: str) -> None:
    """Raises a ValueError (``what`` says whose tensors) when tensors on ``device`` cannot travel
    over ``group``: CUDA tensors on a braid build without CUDA, CPU tensors on an NCCL group, ..."""
    # A duck-typed stand-in is trusted with every device: it knows its own. Meta tensors (a
    # module built on the meta device, then materialized) carry nothing.
    device = torch.device(device)
    reason = group.device_problem(device) if isinstance(group, Group) and device.type != "meta" else None
    if reason:
        raise ValueError(f"{what} are on {device}, but {reason}")


def process_group_of(group: Any) -> Optional[dist.ProcessGroup]:
    """The torch ProcessGroup under ``group`` (an adapter, a resolved default group), or None."""
    if isinstance(group, ProcessGroupAdapter):
        return group.group
    if isinstance(group, DefaultGroup):
        return group.process_group
    if isinstance(group, dist.ProcessGroup):
        return group
    return None
