"""The controller of adaptive compression: :class:`Adaptive`, a compressor that measures (the
link per level from its own calls, the codecs by a probe, the overlap window of each bucket, the
host CPU the transfers cost), every ``interval`` steps all-gathers one small vector of
measurements so that every rank decides from the same numbers, calls model.py's :func:`decide`
and runs each bucket through the compressor chosen for it: all-reduces (the DDP hook, compressed
all-reduces) and the sharded wrapper's reduce-scatters (:meth:`Adaptive.reduce_scatter`).
"""
from __future__ import annotations

import functools
import math
import os
import socket
import threading
import time
import zlib
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, Union

import torch

from ...core import group_carrier
from ...core.device_kernels import kernels_for
from ...core.group import COMPRESSED_ALL_REDUCE, Group, GroupWork, capabilities_of
from ...core.group_carrier import GroupCarrier, HostGroups
from ...core.hosts import host_identity
from ...core.vocabulary import AVG, Op, compressed_op_code
from ...core.wire import BraidCollectives, WireStats
from ...core.work import Work
from ..compressors import Compressor, compressor
from ..driver import CompressedWork, check_tensor, copy_back, flat_view
from .model import (
    ACROSS_HOSTS,
    ALL_REDUCE,
    CALL_CPU_S,
    CANDIDATES,
    COLLECTIVE_CANDIDATES,
    CPU_FIELDS,
    DEFAULT_CANDIDATES,
    DEFAULT_LATENCY_S,
    EXACT,
    IN_HOST,
    LEVELS,
    OTHER,
    OTHER_IN_HOST,
    PROBE_ELEMS,
    REDUCE_SCATTER,
    ROUNDINGS,
    ROUNDS,
    BucketMeasure,
    Decision,
    Layout,
    Level,
    Measurements,
    codec_s,
    contention,
    decide,
    fit_levels,
    fit_link,
    level_bytes,
    transfer_s,
)


def _other_threads_cpu() -> float:
    """CPU seconds (user and system) this process's threads other than the calling one have used.
    With torch computing on the calling thread alone, they are the communication's: braid's
    progress thread, a group's issuing thread, gloo's, and the kernel's work in their system
    calls (which, without IRQ time accounting, includes the network stack's softirq work)."""
    return time.process_time() - time.thread_time()


def _cpu_layout() -> list:
    """This rank's [kernel identity, machine's cores, cores it may run on, torch's compute
    threads], for :func:`contention`. Processes on one kernel (simulated hosts in network
    namespaces too) share its cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            kernel = f.read().strip()
    except OSError:
        kernel = socket.gethostname()
    machine = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    return [float(zlib.crc32(kernel.encode())), float(machine), float(usable), float(torch.get_num_threads())]


def _probe(name: str, q: Compressor, x: torch.Tensor, scratch: dict) -> tuple:
    """One encode + decode round trip of ``x`` (float32, 1-D) with candidate ``name``'s own kernels,
    twice, into buffers kept in ``scratch`` (as the compressors keep theirs): (the faster run's
    seconds, the relative error of the decoded values). Leaves ``x`` as it was."""
    kern = kernels_for(x.device)
    numel = x.numel()
    bufs = scratch.get(name)
    if bufs is None or bufs[0].numel() != numel or bufs[0].device != x.device:
        dtype = q.dtype if name in ("bf16", "fp16") else torch.float32
        bufs = scratch[name] = [torch.empty(numel, dtype=torch.float32, device=x.device),
                                torch.empty(numel, dtype=dtype, device=x.device), None]
    y, sent, payload = bufs
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best = math.inf
    for _ in range(2):  # the first run may fault its buffers' pages in: the second is the steady cost
        sync()
        t0 = time.perf_counter()
        if name in ("bf16", "fp16"):
            kern.cast(x, None, sent)
            y.copy_(sent)
        elif name == "topk":
            values, indices = kern.top_k(x, q.k(numel))
            kern.scatter_add(y.zero_(), indices, values)
        else:
            chunk = q.chunk_elems(numel, 1)  # whole blocks, zero padded
            payload = bufs[2] = q.encode(x, None, 1, 0, chunk, 1, out=payload)
            q.decode(payload, y, chunk)
        sync()
        best = min(best, time.perf_counter() - t0)
    norm = float(x.norm())
    err = float((y - x).norm()) / norm if norm > 0 else 0.0
    return best, err if math.isfinite(err) else math.inf


# ----------------------------------------------------------------------------------------------
# The compressor.


class DeviceMarks:
    """Timing marks on a CUDA device: events recorded on its current stream, read once they have
    completed. A CUDA call's host-side moments (when its kernels were enqueued) say nothing of
    when the device ran them, so a call on a GPU is timed by the device: issued when the stream
    reaches it (its gradient is ready), done when the collective's result is ready on the stream
    its future's callbacks run on (synchronized with the collective's kernels)."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def seconds(origin: Any, event: Any) -> float:
        """Seconds from ``origin`` to ``event`` on the device (both completed)."""
        return origin.elapsed_time(event) / 1e3

    @staticmethod
    def wait(event: Any) -> None:
        event.synchronize()


def _marks_for(device: Optional[torch.device]) -> Optional[DeviceMarks]:
    """The device's marks (CUDA), or None where the host's clock times the calls (the CPU, or a
    work whose device the caller did not name: a CPU work)."""
    return DeviceMarks(device) if device is not None and device.type == "cuda" else None


class _Call:
    """One collective of a step, for the link fit: what went, by which collective, when it was
    issued and finished. ``work``: a braid work that knows when it completed (``completed_at()``,
    on time.perf_counter()'s clock), read when asked; other calls are stamped by a callback; calls on
    a CUDA device by marks on the device (:class:`DeviceMarks`), read at the next round."""

    __slots__ = ("key", "numel", "elem_size", "choice", "issued", "collective", "done", "window", "work",
                 "marks", "issued_mark", "done_mark", "end_mark", "shared")

    def __init__(self, key: Hashable, numel: int, elem_size: int, choice: str, issued: float,
                 collective: str = ALL_REDUCE, marks: Optional[DeviceMarks] = None):
        self.key, self.numel, self.elem_size, self.choice, self.issued = key, numel, elem_size, choice, issued
        self.collective = collective
        self.done: Optional[float] = None
        self.window: Optional[float] = None
        self.work: Any = None
        # On a device: its marks, issued now, done and the end of the step's backward later
        # (read into issued / done / window at the next round).
        self.marks = marks
        self.issued_mark = marks.mark() if marks is not None else None
        self.done_mark: Any = None
        self.end_mark: Any = None
        self.shared = (0.0, 0.0)  # the caller's other bytes after this call in its step: (flat, in-host)

    def stamp(self, _fut: Any = None) -> None:
        if self.marks is not None:
            # On a device: a future's callback runs on a stream synchronized with the call's
            # kernels, so a mark recorded now is reached when the call's result is ready.
            self.done_mark = self.marks.mark()
        else:
            self.done = time.perf_counter()

    def finished(self) -> Optional[float]:
        """When the call completed (None: not yet)."""
        if self.done is None and self.work is not None:
            self.done = self.work.completed_at()
        return self.done


class Adaptive(Compressor):
    """Per bucket (per ``key``), the candidate that minimizes the step, re-decided every
    ``interval`` steps from braid's measurements, the same on every rank.

    Args:
        candidates: names among "exact", "bf16", "fp16", "int8", "int4", "topk" (each with its
            defaults: ``Cast``, ``Int8Quantizer()``, ``Int4Quantizer()``, ``TopK(0.01)``).
        error_budget: the largest estimated relative error of a reduced bucket a candidate may
            bring (the probe's round-trip error on the bucket times sqrt(roundings)); the default
            0.3 admits int4 (about 0.23 on Gaussian gradients) and rules out top-k 1% (about 1.0).
        interval: steps between decision rounds (each all-gathers one small vector); decisions
            change at most this often.
        hysteresis: a new plan must be predicted faster than the current one by this fraction of
            the current plan's overhead.
        link: bandwidths (bytes/s) that replace the measured ones, per level: {"in_host": ...,
            "across_hosts": ...}; for a network you know (or a test).
        error_feedback, warmup_steps, seed: as every compressor's; the residual of a bucket follows
            it from one compressor to the next, and is added to the bucket at its first exact
            all-reduce (or reduce-scatter) after a switch to exact (nothing that was dropped is
            lost).

    Steps: the DDP hook and the sharded wrapper tell it where a step ends (:meth:`end_step`);
    used directly, call ``end_step()`` after each step's last all-reduce. The first
    ``warmup_steps`` steps are exact and measured; the first decision round is at step
    ``warmup_steps``. Over a braid communicator or any process group (gloo, NCCL, HostGroups:
    exact inside a host, the choice across); as the sharded wrapper's ``grad_compression``, its
    gradient reduce-scatters (:meth:`reduce_scatter`: exact, bf16, fp16, int8 or int4). A caller
    whose backward runs other collectives on the same group tells it of them (:meth:`share_link`)
    and of its waits on them (:meth:`stalled`), as the sharded wrapper does for its gathers."""

    def __init__(self, candidates: Sequence[str] = DEFAULT_CANDIDATES, *, error_budget: float = 0.3,
                 interval: int = 8, hysteresis: float = 0.1, link: Optional[Mapping[str, float]] = None,
                 error_feedback: bool = True, warmup_steps: int = 2, seed: int = 0):
        super().__init__(error_feedback=error_feedback, warmup_steps=warmup_steps, seed=seed)
        candidates = tuple(candidates)
        unknown = [c for c in candidates if c not in CANDIDATES]
        if unknown or not candidates or len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must be distinct names among {', '.join(CANDIDATES)}, "
                             f"got {candidates}")
        if EXACT not in candidates:
            candidates = (EXACT, *candidates)
        for name, value in (("error_budget", error_budget), ("hysteresis", hysteresis)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be an int >= 1, got {interval!r}")
        link = dict(link or {})
        if set(link) - set(LEVELS) or any(not (isinstance(v, (int, float)) and v > 0) for v in link.values()):
            raise ValueError(f"link maps 'in_host' and/or 'across_hosts' to bytes per second > 0, "
                             f"got {link!r}")
        self.candidates = candidates
        self.error_budget = float(error_budget)
        self.interval = interval
        self.hysteresis = float(hysteresis)
        self.link = link
        self._compressors: dict[str, Optional[Compressor]] = {EXACT: None}
        for name in candidates[1:]:
            made = compressor(name)  # the named default, with this compressor's common settings
            self._compressors[name] = type(made)(**{**made._config(), "error_feedback": error_feedback,
                                                    "warmup_steps": warmup_steps, "seed": seed})
        self._decisions: dict[Hashable, Decision] = {}
        self._reset_measuring()

    def _reset_measuring(self) -> None:
        """What is measured, not state: a resumed run measures afresh."""
        self._steps = 0                      # steps ended (end_step) since built or loaded
        self._next_round = self.warmup_steps if not self._decisions else self.warmup_steps + self.interval
        self._rounds = 0
        self._step_calls: list[_Call] = []   # this step's calls
        self._shared: list[tuple] = []       # this step's other traffic since its first call (share_link)
        self._other_calls: list[_Call] = []  # ... those of it with a work: link samples
        self._stalls: list[tuple] = []       # this step's waits on other traffic: (end, seconds)
        self._calls_since: list[_Call] = []  # calls of the steps since the last round
        self._errors: dict[Hashable, dict] = {}
        self._codec: dict[str, float] = {}   # seconds per element, EWMA over probe steps
        self._probe_sum: dict[str, list] = {}  # this probe step's [seconds, elements] per candidate
        self._probe_scratch: dict[str, list] = {}
        self._correction: dict[str, float] = {}  # real codec time / the probe's, per candidate
        self._link_fit: Optional[tuple] = None  # (latency, bandwidth per level) of the last exact calls
        # Host CPU of the transfers: the step in progress (thread, the other threads' CPU at its
        # first call, that call's issue), the steps since the last round (calls, from, to, CPU
        # seconds), and the last fit (CPU seconds per byte sent, per level).
        self._cpu_open: Optional[list] = None
        self._cpu_steps: list = []
        self._cpu_fit: dict = {}
        self._one_host = False  # known from the first round: nothing to probe
        self._probed: set = set()
        self._hosts: Optional[tuple] = None  # (hosts, ranks per host) of a process group, once known

    # -- state -------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"candidates": self.candidates, "error_budget": self.error_budget, "interval": self.interval,
                "hysteresis": self.hysteresis, "link": dict(self.link), **super()._config()}

    def state_dict(self) -> dict:
        """The base state, every candidate's (its residuals), and the decisions with their reasons."""
        state = super().state_dict()
        state["compressors"] = {n: q.state_dict() for n, q in self._compressors.items() if q is not None}
        state["decisions"] = {k: (d.choice, d.reason, d.predicted_s, d.exact_s)
                              for k, d in self._decisions.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for name, q in self._compressors.items():
            if q is not None:
                q.load_state_dict(state["compressors"][name])
        self._decisions = {k: Decision(*v) for k, v in state["decisions"].items()}
        self._reset_measuring()

    def decisions(self) -> dict:
        """The current choice per key (DDP: bucket index; the sharded wrapper: ("braid.fsdp.grad",
        bucket index)) with its reason: {key: Decision}."""
        return dict(self._decisions)

    @property
    def compressors(self) -> dict:
        """The candidates' compressors by name (None for exact), with this compressor's common
        settings: what each choice runs (the sharded wrapper pads its shards to their blocks)."""
        return dict(self._compressors)

    def choice(self, key: Hashable) -> str:
        """The candidate the next call of ``key`` runs after the warm-up (exact until decided)."""
        d = self._decisions.get(key)
        return EXACT if d is None else d.choice

    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        for q in self._compressors.values():
            if q is not None and q.residual(key) is not None:
                return q.residual(key)
        return self._residuals.get(key)

    # -- steps -------------------------------------------------------------------------------
    def end_step(self) -> None:
        """The backward of a step ended now (the DDP hook calls it at the last bucket): each call of
        the step gets its window (the backward's time from the call to now, less the waits
        :meth:`stalled` reported in it and the codec probes run in it), and the step counts toward
        the next decision round."""
        now = time.perf_counter()
        opened, self._cpu_open = self._cpu_open, None
        if opened is not None and opened[0] == threading.get_ident():
            self._cpu_steps.append((self._step_calls + self._other_calls, opened[2], now,
                                    _other_threads_cpu() - opened[1]))
        for call in self._step_calls:
            after = [(n, host) for t, n, host in self._shared if t >= call.issued]
            call.shared = (sum(n for n, host in after if not host), sum(n for n, host in after if host))
        self._shared = []
        stalls, self._stalls = self._stalls, []
        # On a device the backward ends, in stream order, where its last bucket was issued.
        marked = [c for c in self._step_calls if c.marks is not None]
        end_mark = marked[-1].issued_mark if marked else None
        for call in self._step_calls:
            # Step 0's buckets are DDP's first layout, rebuilt after it: their calls measure the
            # link, but their windows and sizes are not the buckets' to come.
            if self._steps < 1:
                call.window = None
            elif call.marks is not None:
                call.end_mark = end_mark
            else:
                waited = sum(min(seconds, end - call.issued) for end, seconds in stalls if end > call.issued)
                call.window = max(0.0, now - call.issued - waited)
        for call in self._other_calls:
            # Its work may hold the gather's buffers (a quantized gather's payloads): not kept until
            # the round. Done by now as a rule (the backward waited for it); else its future stamps it.
            if call.work is not None:
                call.finished()
                if call.done is None:
                    call.work.get_future().then(call.stamp)
                call.work = None
        self._calls_since.extend(self._step_calls)
        self._calls_since.extend(self._other_calls)
        self._step_calls, self._other_calls = [], []
        self._steps += 1

    def share_link(self, nbytes: int, *, in_host: bool = False, work: Any = None,
                   device: Optional[torch.device] = None) -> None:
        """The caller issued now, during the backward, another collective on the same group that
        sends ``nbytes`` (this rank's bytes on the wire): the sharded wrapper's parameter
        all-gathers, flat over the group or (``in_host``) inside this rank's host (hpZ). A bucket
        whose window holds such traffic has that much less of the link to hide behind. With its
        ``work`` (async, on ``device``; default the CPU) the call also times the link: it queues
        with the buckets' calls, and both ranks start it from the queue together, where a bucket's
        call issued by a late rank finds its peer's bytes already buffered and looks fast. Counted
        only after the step's first call (earlier traffic is in no bucket's window)."""
        if not self._step_calls:
            return
        now = time.perf_counter()
        self._shared.append((now, float(nbytes), bool(in_host)))
        if work is not None:
            call = _Call(OTHER, int(nbytes), 1, EXACT, now, OTHER_IN_HOST if in_host else OTHER,
                         _marks_for(device))
            if call.marks is None and hasattr(work, "completed_at"):
                call.work = work
            else:
                work.get_future().then(call.stamp)
            self._other_calls.append(call)

    def stalled(self, seconds: float) -> None:
        """The backward waited ``seconds``, ending now, on the caller's other collectives (the
        sharded wrapper, blocked on a parameter gather): time the bucket windows that span it do
        not compute in. Windows are the backward's compute from a bucket to its end; a wait the
        link's traffic caused belongs to the communication the plan is deciding."""
        if self._step_calls and seconds > 0:
            self._stalls.append((time.perf_counter(), float(seconds)))

    # -- the all-reduce ----------------------------------------------------------------------
    def all_reduce(self, comm: Any, tensor: torch.Tensor, op: Op = "avg", *, key: Hashable = "default",
                   async_op: bool = False, step: Optional[int] = None
                   ) -> Optional[Union[CompressedWork, GroupWork]]:
        if COMPRESSED_ALL_REDUCE in capabilities_of(comm):  # the group runs the call
            return comm.all_reduce(tensor, op, async_op, compression=self, key=key, step=step)
        code = compressed_op_code(op)
        check_tensor(tensor)
        carrier = group_carrier.carrier_of(comm, "comm")
        step = self._step_of(step)
        group = carrier.group if isinstance(carrier, HostGroups) else carrier
        name, call = self._begin(key, tensor, step, carrier.size,
                                 lambda out, inp: self._gather_on_group(group, out, inp),
                                 lambda: self._layout_of_group(carrier))
        if name == EXACT:
            flat = flat_view(tensor)
            self.count_wire(self.exact_wire_stats(flat.numel() * flat.element_size(), carrier.size))
            slice_of = self._slice_of_group(carrier)
            flush = step >= self.warmup_steps  # never into a warm-up step's (maybe first) layout

            def job() -> None:
                if flush:
                    self._flush(key, flat, slice_of)
                carrier.all_reduce(flat, code == AVG)
                copy_back(flat, tensor)

            work = GroupWork(group_carrier.issue(job, [tensor], tensor.device, group.inline))
            if not async_op:
                work.wait()
                work = None
        else:
            q = self._compressors[name]
            work = q.all_reduce(carrier, tensor, op, key=key, async_op=async_op, step=step)
            self.count_wire(q.last_wire_bytes)
        return self._record(call, work)

    def all_reduce_on(self, comm: BraidCollectives, tensor: torch.Tensor, op: Op = "avg", *,
                      key: Hashable = "default", async_op: bool = False,
                      step: Optional[int] = None) -> tuple[Optional[Union[CompressedWork, Work]], WireStats]:
        code = compressed_op_code(op)
        check_tensor(tensor)
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor must be a CPU tensor to travel through a braid Communicator, got a "
                             f"tensor on {tensor.device} (reduce CUDA tensors over a torch process group)")
        step = self._step_of(step)
        name, call = self._begin(key, tensor, step, comm.world_size,
                                 lambda out, inp: comm.all_gather(out, inp, False),
                                 lambda: self._layout_of_braid(comm))
        if name == EXACT:
            flat = flat_view(tensor)
            local = comm.local_world_size if comm.num_hosts > 1 and comm.uniform_hosts else 1
            if step >= self.warmup_steps:  # never into a warm-up step's (maybe first) layout
                self._flush(key, flat, (comm.local_rank, local))
            stats = self.exact_wire_stats(flat.numel() * flat.element_size(), comm.world_size)
            raw = comm.all_reduce(flat, code, async_op)
            if raw is None:
                copy_back(flat, tensor)
                work = None
            elif flat.data_ptr() == tensor.data_ptr():
                # The result is already in the tensor: the plain work, timed by its own completion
                # (a Python callback on the progress thread would wait for the GIL, and the next
                # bucket behind it: the exact plan then costs what the exact hook costs).
                work = Work(raw, "all_reduce")
                call.work = raw
            else:
                work = CompressedWork(raw, lambda: copy_back(flat, tensor), tensor)
        else:
            work, stats = self._compressors[name].all_reduce_on(comm, tensor, op, key=key, async_op=async_op,
                                                                step=step)
        self.count_wire(stats)
        return self._record(call, work), stats

    # -- the reduce-scatter ------------------------------------------------------------------
    def reduce_scatter(self, group: Group, tensor: torch.Tensor,
                       issue: Callable[[Optional[Compressor], Optional[torch.Tensor]], tuple], *,
                       key: Hashable = "default", hosts: Optional[HostGroups] = None,
                       step: Optional[int] = None) -> tuple:
        """The reduce-scatter of ``tensor`` (this rank's input, ``group.world_size`` pieces) with
        the candidate decided for ``key``, measured and decided as the all-reduces are: the
        sharded wrapper's gradients (``fsdp.shard(..., grad_compression=q)``, which calls
        :meth:`end_step` at the end of each backward).

        The caller owns the algorithm: ``issue(compressor, residual)`` issues the call and returns
        ``(work, finish)``, ``work`` an async work (``get_future()``) or None once done.
        ``compressor`` None asks for the exact reduce-scatter, with ``residual`` (None, or what
        the bucket's compression dropped before it switched to exact: float32, the size of what
        was encoded) added to this rank's input; otherwise it is the chosen candidate's
        compressor, whose residual for ``key`` the encoding uses and updates (one per bucket,
        carried from candidate to candidate). ``group``: a braid Group (comm/core/group.py) serving
        ``tensor``'s device; ``hosts``: the group split by host where the caller's compressed
        reduce-scatters sum exactly inside a host and encode only across hosts, None where they
        run flat over the group (whose hosts are then found from the ranks' host identities).
        Returns what ``issue`` returned."""
        check_tensor(tensor)
        n, step = group.world_size, self._step_of(step)
        gather = functools.partial(_gather_on, group, tensor.device)
        name, call = self._begin(key, tensor, step, n, gather, lambda: self._layout_of(n, hosts, gather),
                                 REDUCE_SCATTER)
        if name == EXACT:
            # Never into a warm-up step's call, as the all-reduce's flush.
            residual = self.take_residual(key) if step >= self.warmup_steps else None
            work, finish = issue(None, residual)
        else:
            work, finish = issue(self._compressors[name], None)
        self._record(call, work)
        return work, finish

    def _step_of(self, step: Optional[int]) -> int:
        return self._steps if step is None else step

    def _active(self, key: Hashable, step: int, world: int) -> str:
        if step < self.warmup_steps or world == 1:
            return EXACT
        return self.choice(key)

    def _record(self, call: _Call, work: Any) -> Any:
        if work is None:
            call.stamp()
        elif call.work is None:  # (set only for host-timed braid calls)
            work.get_future().then(call.stamp)
        self._step_calls.append(call)
        return work

    def _flush(self, key: Hashable, flat: torch.Tensor, slice_of: tuple) -> None:
        """A bucket switched to exact: its residual (what compression dropped so far) joins this
        exact all-reduce, and leaves. A host path's residual is this rank's slice ``slice_of`` =
        (local index, local ranks) of the host's sum: added to that slice of this rank's input,
        the exact sum carries it all the same."""
        r = self.take_residual(key)
        if r is None:
            return
        index, local = slice_of
        per = -(-flat.numel() // local)
        if r.numel() == flat.numel():
            flat.add_(r.to(flat.device))
        elif r.numel() == per:
            part = flat[index * per:(index + 1) * per]
            part.add_(r[:part.numel()].to(flat.device))

    def _slice_of_group(self, carrier: Any) -> tuple:
        return (carrier.intra.rank, carrier.intra.size) if isinstance(carrier, HostGroups) else (0, 1)

    # -- decision rounds ---------------------------------------------------------------------
    def _begin(self, key: Hashable, tensor: torch.Tensor, step: int, world: int, gather: Any, layout: Any,
               collective: str = ALL_REDUCE) -> tuple:
        """What every call does first: a round or a probe when due (_before_call), then the choice in
        force for ``key`` and the call's timing record: (choice, _Call). The first call of a step,
        timed on the host with torch computing on one thread, opens the step's host CPU sample
        (after the round, whose gather is no step's), which :meth:`end_step` closes."""
        first = not self._step_calls
        self._before_call(key, tensor, step, world, gather, layout, collective)
        name = self._active(key, step, world)
        call = _Call(key, tensor.numel(), tensor.element_size(), name, time.perf_counter(), collective,
                     _marks_for(tensor.device))
        if first and call.marks is None and torch.get_num_threads() == 1:
            self._cpu_open = (threading.get_ident(), _other_threads_cpu(), call.issued)
        return name, call

    def _before_call(self, key: Hashable, tensor: torch.Tensor, step: int, world: int, gather: Any,
                     layout: Any, collective: str = ALL_REDUCE) -> None:
        """At the first call of a step due for a round: the round. At each call of the step before
        a round that re-measures the codecs: the probe of this bucket (for ``collective``)."""
        if world == 1:
            return
        if not self._step_calls and step >= self._next_round and step >= self.warmup_steps:
            self._round(gather, layout())
            self._next_round = step + self.interval
        if step + 1 == self._next_round and self._probing() and key not in self._probed:
            self._probe_bucket(key, tensor, collective)

    def _probing(self) -> bool:
        """Whether the coming round re-measures the codecs: the first one, then every fourth (never
        on one host, where nothing is compressed)."""
        return not self._one_host and (not self._codec or self._rounds % 4 == 0)

    def _probe_bucket(self, key: Hashable, tensor: torch.Tensor, collective: str) -> None:
        """Times each candidate ``collective`` carries on (up to PROBE_ELEMS of) this rank's bucket
        with its kernels, and keeps the error each would make on it."""
        self._probed.add(key)
        began = time.perf_counter()
        x = tensor.detach().reshape(-1)[:PROBE_ELEMS].to(torch.float32)
        errors = {}
        for name, q in self._compressors.items():
            if q is None or name not in COLLECTIVE_CANDIDATES[collective]:
                continue
            seconds, err = _probe(name, q, x, self._probe_scratch)
            acc = self._probe_sum.setdefault(name, [0.0, 0])
            acc[0] += seconds
            acc[1] += x.numel()
            errors[name] = err * math.sqrt(ROUNDINGS[collective][name])
        self._errors[key] = errors
        # The probe is no part of the backward: the windows of the calls before it leave it out.
        end = time.perf_counter()
        self._stalls.append((end, end - began))

    def _fold_probes(self) -> None:
        """The probe step's codec costs into the running estimate: an average over probe steps with
        weight 1/2, so one probe on a loaded machine moves it half way."""
        for name, (seconds, elems) in self._probe_sum.items():
            if elems:
                now, old = seconds / elems, self._codec.get(name)
                self._codec[name] = now if old is None else 0.5 * old + 0.5 * now
        self._probe_sum = {}
        self._probed = set()

    def _layout_of_braid(self, comm: BraidCollectives) -> Layout:
        n, hosts = comm.world_size, comm.num_hosts
        if not comm.uniform_hosts:  # uneven hosts: compressed flat over all ranks, bytes shared out
            return Layout(n, hosts, max(1, n // hosts))
        local = n // hosts
        return Layout(n, hosts, local, hierarchical=hosts > 1 and local > 1,
                      exact_hierarchical=hosts > 1 and local > 1)

    def _layout_of_group(self, carrier: Any) -> Layout:
        hosts = carrier if isinstance(carrier, HostGroups) else None
        return self._layout_of(carrier.size, hosts,
                               lambda out, inp: self._gather_on_group(carrier, out, inp))

    def _layout_of(self, size: int, hosts: Optional[HostGroups], gather: Any) -> Layout:
        """The layout of ``size`` ranks: split by ``hosts`` (exact inside a host, compressed
        across), or flat with the hosts found from every rank's host identity (``gather``ed once)."""
        if hosts is not None:
            return Layout(size, hosts.inter.size, hosts.intra.size, hierarchical=True)
        if self._hosts is None:  # once: which ranks share a host, from every rank's host identity
            mine = torch.tensor([float(zlib.crc32(host_identity().encode()))], dtype=torch.float64)
            ids = gather(torch.empty(size, dtype=torch.float64), mine).tolist()
            counts = [ids.count(h) for h in dict.fromkeys(ids)]
            uniform = len(set(counts)) == 1
            self._hosts = (len(counts), counts[0]) if uniform else (size, 1)
        host_count, local = self._hosts
        return Layout(size, host_count, local)

    def _gather_on_group(self, group: GroupCarrier, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """All-gather of a small CPU float64 vector over a group carrier, in order with its other
        jobs; on a CUDA group (NCCL) through the device."""
        device = torch.device("cuda", torch.cuda.current_device()) if _needs_cuda(group) else inp.device
        o, i = out.to(device), inp.to(device)
        group_carrier.issue(lambda: group.all_gather(o, i), [o], device, group.inline).wait()
        out.copy_(o.cpu())
        return out

    def _local_vector(self, keys: list, layout: Layout) -> list:
        """This rank's measurements: bandwidth per level, latency, codec cost per candidate (the
        probe's, corrected by the real calls), then per bucket its elements, element size, window,
        the other traffic's bytes in that window (in the host, across hosts: :meth:`share_link`)
        and each candidate's error.

        The link is fitted from the exact calls alone (their time is the link's); the compressed
        calls' time beyond their predicted transfer is their real codec time, which corrects the
        probe's estimate. Each bucket counts with its fastest call of the steps since the last
        round (the others waited for a late rank or a busy core). Without exact calls in the
        window the last fit holds."""
        calls = [c for c in self._calls_since if c.finished() is not None]
        fastest: dict = {}
        for c, start in _services(calls):
            group = (c.key, c.numel, c.elem_size, c.choice, c.collective)
            fastest[group] = min(fastest.get(group, math.inf), c.done - start)
        exact = []
        for (_, numel, elem, choice, collective), t in fastest.items():
            by_level = level_bytes(choice, None, numel, elem, layout, collective)
            if choice == EXACT and sum(by_level) > 0:
                rounds = ROUNDS[collective][EXACT] * sum(1 for x in by_level if x > 0)
                exact.append((*by_level, rounds, t))
        if exact:
            self._link_fit = fit_link(exact)
        self._fit_host_cpu(layout)
        if self._link_fit is None:
            return self._vector(keys, calls, math.nan, {IN_HOST: math.nan, ACROSS_HOSTS: math.nan}, layout)
        latency, bw = self._link_fit
        bw = {**bw, **{level: float(rate) for level, rate in self.link.items()}}
        if exact:
            self._correct_codecs(fastest, layout, latency, bw)
        return self._vector(keys, calls, latency, bw, layout)

    def _fit_host_cpu(self, layout: Layout) -> None:
        """The host CPU per byte sent, per level, from the steps since the last round (least
        squares of CPU seconds against bytes per level, as the link's bandwidth); without such
        steps, or before the link's latency is known, the last fit holds.

        A step's sample runs from its first call to the end of its backward: the CPU the other
        threads used in it against the bytes of its calls' service that fell in it (a call's
        bytes spread evenly over its service), which leaves out what runs after the backward
        (the caller's optimizer, a benchmark's other models). Only steps whose calls were all
        exact all-reduces, finished, with no other traffic reported, count: a codec's kernels or
        bytes this Adaptive does not count would be taken for the bytes' cost. A call also costs
        CPU whatever its size (waking a thread, system calls, a callback), which equal steps
        cannot tell from its bytes': each message round may account for up to its fitted latency
        (its wall time without bytes) and CALL_CPU_S, and only the rest is taken for the bytes
        (small buckets would otherwise read as costly bytes, which compression seems to save)."""
        if self._link_fit is None:
            return
        per_round = min(self._link_fit[0], CALL_CPU_S)
        samples = []
        for calls, began, ended, seconds in self._cpu_steps:
            if not calls or any(c.choice != EXACT or c.collective != ALL_REDUCE or c.shared != (0.0, 0.0)
                                or c.finished() is None for c in calls):
                continue
            sent, rounds = [0.0, 0.0], 0.0
            for c, start in _services(calls):
                span = c.done - start
                inside = min(c.done, ended) - max(start, began)
                part = min(1.0, max(0.0, inside / span)) if span > 0 else float(began <= start < ended)
                by_level = level_bytes(EXACT, None, c.numel, c.elem_size, layout)
                sent = [n + part * x for n, x in zip(sent, by_level)]
                rounds += part * ROUNDS[ALL_REDUCE][EXACT] * sum(1 for x in by_level if x > 0)
            if sum(sent) > 0:
                samples.append((*sent, max(0.0, seconds - rounds * per_round)))
        if samples:
            rates = fit_levels(samples)  # bytes per CPU second
            self._cpu_fit = {level: 1 / rate for level, rate in rates.items() if not math.isnan(rate)}

    def _correct_codecs(self, fastest: dict, layout: Layout, latency: float, bw: dict) -> None:
        """Per compressed candidate run since the last round: its calls' time beyond the predicted
        transfer over the probe's codec estimate, held in [0.5, 20] and averaged with the previous
        correction (weight 1/2)."""
        levels = {lv: Level(rate if not math.isnan(rate) else math.inf, latency) for lv, rate in bw.items()}
        m = Measurements(layout, levels, self._codec, ())
        spent: dict = {}
        for (key, numel, elem, choice, collective), t in fastest.items():
            if choice == EXACT or choice not in self._codec:
                continue
            b = BucketMeasure(key, numel, elem, 0.0, collective=collective)
            acc = spent.setdefault(choice, [0.0, 0.0])
            acc[0] += max(0.0, t - transfer_s(choice, self._compressors[choice], b, m))
            acc[1] += codec_s(choice, b, m)
        for choice, (real, probed) in spent.items():
            if probed > 0:
                now = min(20.0, max(0.5, real / probed))
                old = self._correction.get(choice)
                self._correction[choice] = now if old is None else 0.5 * old + 0.5 * now

    def _vector(self, keys: list, calls: list, latency: float, bw: dict, layout: Layout) -> list:
        vec = [bw[IN_HOST], bw[ACROSS_HOSTS], latency]
        vec += [self._codec.get(n, math.nan) * self._correction.get(n, 1.0)
                for n in self.candidates if n != EXACT]
        for k in keys:
            mine = [c for c in calls if c.key == k and c.window is not None]
            least = min(mine, key=lambda c: c.window) if mine else None  # its window, its traffic
            window = least.window if least else math.nan
            flat, host = least.shared if least else (math.nan, math.nan)
            numel = mine[-1].numel if mine else math.nan
            elem = mine[-1].elem_size if mine else math.nan
            errors = self._errors.get(k, {})
            # The other traffic's bytes by level: the flat part split as a flat collective's.
            flat_in, flat_across = level_bytes(EXACT, None, flat, 1, layout, OTHER)
            vec += [numel, elem, window, flat_in + host, flat_across]
            vec += [errors.get(n, math.nan) for n in self.candidates if n != EXACT]
        vec += [self._cpu_fit.get(level, math.nan) for level in LEVELS]
        return vec + _cpu_layout()

    def _round(self, gather: Any, layout: Layout) -> None:
        """One decision round: every rank's measurement vector all-gathered (one small collective),
        combined the same way on every rank, and decided."""
        self._fold_probes()
        _read_marks(self._calls_since)
        keys = sorted({c.key for c in self._calls_since if c.window is not None}, key=repr)
        self._rounds += 1
        if not keys:
            return
        self._one_host = layout.hosts == 1
        local = torch.tensor(self._local_vector(keys, layout), dtype=torch.float64)
        everyone = torch.empty(layout.world * local.numel(), dtype=torch.float64)
        gather(everyone, local)
        rows = everyone.view(layout.world, -1).tolist()
        collectives = {c.key: c.collective for c in self._calls_since}
        m = _combine(rows, keys, layout, self.candidates, collectives)
        self._calls_since, self._cpu_steps = [], []
        if m is None:
            return
        current = {k: d.choice for k, d in self._decisions.items()}
        decided = decide(m, current, candidates=self.candidates, error_budget=self.error_budget,
                         hysteresis=self.hysteresis, compressors=self._compressors)
        for k, d in decided.items():
            self._move_residual(k, current.get(k, EXACT), d.choice)
        self._decisions.update(decided)

    def _move_residual(self, key: Hashable, old: str, new: str) -> None:
        """Error feedback carries across a switch: the bucket's residual goes to the new compressor
        (or, for exact, waits to be added to the bucket's next exact all-reduce or reduce-scatter)."""
        if old == new:
            return
        src, dst = self._compressors[old] or self, self._compressors[new] or self
        r = src.take_residual(key)
        if r is not None:
            dst.put_residual(key, r)


def _services(calls: Sequence[_Call]) -> list:
    """(call, when the link began serving it) for finished ``calls``, in issue order: the link
    serves the calls in issue order, so a call's own time starts when it was issued or when the
    one before it finished, whichever is later."""
    out = []
    prev_done = -math.inf
    for c in sorted(calls, key=lambda c: c.issued):
        out.append((c, max(c.issued, prev_done)))
        prev_done = max(prev_done, c.done)
    return out


def _read_marks(calls: Sequence[_Call]) -> None:
    """The device-timed calls' marks read into seconds (issued, done, window), from the first such
    call's issue: the service order and windows then compare device times with device times. A
    call whose result was not yet marked keeps done None (left out of the fit)."""
    marked = [c for c in calls if c.marks is not None and c.issued_mark is not None]
    if not marked:
        return
    origin = marked[0].issued_mark
    for c in marked:
        marks = c.marks
        for m in (c.issued_mark, c.done_mark, c.end_mark):
            if m is not None:
                marks.wait(m)
        c.issued = marks.seconds(origin, c.issued_mark)
        if c.done_mark is not None:
            c.done = marks.seconds(origin, c.done_mark)
        if c.end_mark is not None:
            c.window = marks.seconds(origin, c.end_mark) - c.issued
        c.issued_mark = c.done_mark = c.end_mark = None  # read once; the events go


def _gather_on(group: Group, device: torch.device, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """Blocking all-gather of a small CPU float64 vector over a braid Group, through ``device``
    (the one the group's collectives serve), issued from the caller's thread in order with the
    caller's other collectives on it."""
    o, i = out.to(device), inp.to(device)
    group.all_gather(o, i)
    out.copy_(o.cpu())
    return out


def _needs_cuda(group: GroupCarrier) -> bool:
    g = group.group
    return (isinstance(g, torch.distributed.ProcessGroup) and torch.cuda.is_available()
            and "nccl" in str(torch.distributed.get_backend(g)).lower()
            and "gloo" not in str(torch.distributed.get_backend(g)).lower())


def _known(values: list) -> list:
    """The values a rank measured (NaN: it had nothing to measure)."""
    return [v for v in values if not math.isnan(v)]


def _combine(rows: list, keys: list, layout: Layout, candidates: Sequence[str], collectives: Mapping
             ) -> Optional[Measurements]:
    """Every rank's vector into one set of measurements (``collectives``: each key's, the same on
    every rank, which make the same calls), the same on every rank: bandwidth the most
    any rank measured (a rank that waited for a later one counted the wait as transfer; the last
    to arrive timed the link alone), codec costs and errors the worst rank's, windows the least,
    the other traffic in them the most; the host CPU per byte the most, and its share taken from
    the backward's cores the worst rank's (:func:`contention`), where the vectors carry them
    (CPU_FIELDS after the buckets)."""
    names = [n for n in candidates if n != EXACT]
    per_bucket = 5  # numel, element size, window, other bytes in the host, across hosts
    cols = list(zip(*rows))
    bw_in, bw_ac = _known(list(cols[0])), _known(list(cols[1]))
    lat = _known(list(cols[2]))
    latency = min(lat) if lat else DEFAULT_LATENCY_S
    levels = {}
    if bw_in:
        levels[IN_HOST] = Level(max(bw_in), latency)
    if bw_ac:
        levels[ACROSS_HOSTS] = Level(max(bw_ac), latency)
    if not levels:
        return None
    for level in LEVELS:  # a level without samples: the other's figure (a bound, not a guess)
        levels.setdefault(level, next(iter(levels.values())))
    codec = {}
    for i, n in enumerate(names):
        got = _known(list(cols[3 + i]))
        codec[n] = max(got) if got else math.inf
    buckets = []
    base, width = 3 + len(names), per_bucket + len(names)
    for j, k in enumerate(keys):
        at = base + j * width
        numel, elem, window, other_in, other_across = (_known(list(cols[at + i])) for i in range(per_bucket))
        if not numel or not elem:
            continue
        errors = {}
        for i, n in enumerate(names):
            got = _known(list(cols[at + per_bucket + i]))
            errors[n] = max(got) if got else math.inf
        least = max(0.0, min(window)) if window else 0.0
        # The other traffic: the most any rank sent, at each level's bandwidth.
        busy = sum(max(got) / levels[level].bytes_per_s for level, got in ((IN_HOST, other_in),
                                                                            (ACROSS_HOSTS, other_across))
                   if got and max(got) > 0)
        buckets.append(BucketMeasure(k, int(max(numel)), int(max(elem)), least, errors, collectives[k], busy))
    if not buckets:
        return None
    tail = base + len(keys) * width
    if len(cols) < tail + CPU_FIELDS:
        return Measurements(layout, levels, codec, buckets)
    cpu = {}
    for level, got in zip(LEVELS, (_known(list(cols[tail])), _known(list(cols[tail + 1])))):
        if got:
            cpu[level] = max(got)
    if cpu:  # a level without samples: the other's figure, as the link's
        cpu = {level: cpu.get(level, next(iter(cpu.values()))) for level in LEVELS}
    share = contention(*(cols[tail + i] for i in range(2, CPU_FIELDS)))
    return Measurements(layout, levels, codec, buckets, cpu, share)
