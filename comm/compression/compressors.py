"""Gradient compressors for braid's all_reduce and DDP hook.

Block quantization to int8 / int4 (one float32 scale per block), top-k sparsification and casts
to 16-bit floats, each with error feedback (what compression dropped is added to the next call's
input, per key) and a warm-up of exact reductions. A compressor's state is explicit:
``state_dict()`` / ``load_state_dict()`` and pickling carry the residuals and call counts.

    q = comm.Int8Quantizer()
    c.all_reduce(grad, op="avg", compression=q, key="layer1")
    c.last_wire_bytes            # WireStats(sent=..., received=..., dense=...)

The same compressors run over any torch process group (gloo, NCCL, braid's c10d backend) and on
CUDA tensors: ``q.all_reduce(group, grad)`` quantizes on the tensor's device and lets the group
carry the packed bytes (comm/core/group_carrier.py).
"""

from __future__ import annotations

import math
import zlib
from datetime import timedelta
from typing import Any, Callable, Hashable, Optional, Union

import torch

import braid.comm._C as _C  # the extension module itself (not the package)

from ..core import group_carrier
from ..core.device_kernels import CpuKernels, kernels_for
from ..core.group import COMPRESSED_ALL_REDUCE, GroupWork
from ..core.group_carrier import GroupCarrier, HostGroups
from ..core.vocabulary import AVG, Op, compressed_op_code
from ..core.wire import BraidCollectives, CompressionHost, WireStats, dense_wire_bytes
from ..core.work import Work

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Largest quantization block: csrc/core/compression/quantize.h's kMaxQuantBlock (the kernels hold a
# block in a stack buffer of float32).
MAX_QUANT_BLOCK = _C.MAX_QUANT_BLOCK
_MASK64 = (1 << 64) - 1
_INT32_MAX = 2**31 - 1
_CPU = torch.device("cpu")


def _slice_buffers(flat: torch.Tensor, local: int) -> tuple:
    """This rank's slice of ``flat`` across ``local`` host ranks, and the padded copy of ``flat``
    (empty when its size divides) for an all-reduce exact on the host."""
    per = -(-flat.numel() // local)
    size = per * local if per * local != flat.numel() else 0
    padded = torch.empty(size, dtype=flat.dtype, device=flat.device)
    return padded, torch.empty(per, dtype=flat.dtype, device=flat.device)


def _exact_on_hosts(comm: BraidCollectives) -> bool:
    """Whether a compressed all-reduce on ``comm`` reduces exactly on each host and compresses
    only between hosts: ranks on several hosts, the same number on each, more than one."""
    return comm.num_hosts > 1 and comm.local_world_size > 1 and comm.uniform_hosts


# The algorithms of a compressed all-reduce, chosen in one place (choose_path):
EXACT = "exact"  # the warm-up, a group of one: the group's own exact all-reduce
FLAT = "flat"  # compressed among all the ranks (top-k: dense instead where its pairs weigh more)
HOSTS = "hosts"  # a HostGroups: exact in each host, compressed across (any groups)
BETWEEN_HOSTS = "between_hosts"  # braid's communicator across hosts: the same in one fused call
PIPELINED = "pipelined"  # braid's communicator, one rank per host: the quantized pipeline between hosts


def choose_path(q: "Compressor", target: Any, numel: int, step: int) -> str:
    """The algorithm of ``q``'s all-reduce of ``numel`` elements at warm-up ``step`` over
    ``target``: a carrier (GroupCarrier or HostGroups: the compressor's algorithm over the group's
    collectives) or braid's communicator's collectives (its fused calls). The only place the
    choice is made; every path runs the same codec."""
    fused = not isinstance(target, (GroupCarrier, HostGroups))
    n = target.world_size if fused else target.size
    if step < q.warmup_steps or n == 1 or (numel == 0 and not fused):
        return EXACT
    if not fused:
        return HOSTS if isinstance(target, HostGroups) else FLAT
    if _exact_on_hosts(target):
        return BETWEEN_HOSTS
    if q.pipelines and target.num_hosts == target.world_size > 1:
        return PIPELINED
    return FLAT


def check_tensor(tensor: torch.Tensor) -> None:
    """A tensor a compressor can carry: a float32, bfloat16 or float16 torch.Tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"tensor must be float32, bfloat16 or float16 to be compressed, got {tensor.dtype}")


def copy_back(flat: torch.Tensor, tensor: torch.Tensor) -> None:
    """The result into the caller's tensor, when the call worked on a contiguous copy of it."""
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def _send_everything(flat: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """What a top-k call sends when the dense all-reduce is cheaper: input + residual (already
    summed into the residual, which then keeps nothing), or the input without error feedback."""
    if residual is None:
        return flat
    dense = residual.clone()
    residual.zero_()
    return dense


def _mix64(*parts: int) -> int:
    """A 64-bit hash of integers (splitmix64 rounds): seeds of the stochastic rounding streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


def _key_hash(key: Hashable) -> int:
    """Stable across processes (Python's hash() of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


class CompressedWork(Work):
    """Handle of an async compressed all-reduce, a :class:`~braid.comm.Work`: the collective runs
    on braid's progress thread, and decoding into the caller's tensor is chained to it, so it
    happens once, on that thread, as soon as the collective completes (it issues no collective, so
    it may run there)."""

    __slots__ = ("_decoded",)

    def __init__(self, work: Any, finish: Callable[[], None], tensor: torch.Tensor):
        super().__init__(work, "all_reduce")

        def decode(fut: torch.futures.Future) -> list:
            fut.value()  # raises the collective's error
            finish()
            return [tensor]

        self._decoded = work.get_future().then(decode)

    def wait(self, timeout: Optional[Union[float, timedelta]] = None) -> bool:
        """Blocks until the collective is done and the result decoded; raises its error. With
        ``timeout`` (seconds or a timedelta) returns False if the collective is still running
        then; 0 only polls."""
        if not super().wait(timeout):  # raises braid's typed errors
            return False
        self._decoded.wait()
        return True

    def is_completed(self) -> bool:
        return self._decoded.done()

    def is_success(self) -> bool:
        return self._decoded.done() and super().is_success()

    def describe(self) -> str:
        if super().is_completed() and super().is_success() and not self._decoded.done():
            return "all_reduce decoding"
        return super().describe()

    def __repr__(self) -> str:
        return f"<braid.comm.CompressedWork {self.describe()}>"

    def get_future(self) -> torch.futures.Future:
        """A future holding ``[tensor]`` once the result is decoded into it."""
        return self._decoded


class Compressor:
    """Base of the compressors: error-feedback residuals per key, warm-up, seeds, wire counts.

    Args:
        error_feedback: keep a float32 residual per key (rebuilt when the key's tensor changes
            size) holding what compression dropped, and add it to the next input.
        warmup_steps: the first ``warmup_steps`` calls per key (or DDP steps) are exact
            all-reduces; at least 2 because DDP rebuilds its buckets after the first step.
        seed: base of the stochastic rounding streams (mixed with rank, key and call number).
    """

    def __init__(self, *, error_feedback: bool = True, warmup_steps: int = 2, seed: int = 0):
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 2:
            raise ValueError(
                f"warmup_steps must be an int >= 2 (DDP rebuilds its buckets after step 1), "
                f"got {warmup_steps!r}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.warmup_steps = warmup_steps
        self.seed = seed
        self._residuals: dict[Hashable, torch.Tensor] = {}
        self._calls: dict[Hashable, int] = {}
        self._scratch: dict[Hashable, list] = {}  # reusable buffers, not state
        self.wire_total = WireStats(0, 0, 0)
        self.last_wire_bytes: Optional[WireStats] = None  # of the last call, whatever carried it
        self.last_path: Optional[str] = None  # the algorithm of the last all-reduce (choose_path)

    # Whether braid's communicator has a fused call for this compressor (its compressed_all_reduce
    # capability); without one a Communicator runs the compressor's algorithm through its own
    # collectives, as a process group does.
    fused = True
    # Whether it has the fused pipeline between hosts (one rank per host): choose_path asks.
    pipelines = False

    # -- state -----------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"error_feedback": self.error_feedback, "warmup_steps": self.warmup_steps, "seed": self.seed}

    def state_dict(self) -> dict:
        """Everything needed to resume: configuration, residuals (copies), call counts, wire totals."""
        return {
            "type": type(self).__name__,
            "config": self._config(),
            "residuals": {k: v.clone() for k, v in self._residuals.items()},
            "calls": dict(self._calls),
            "wire_total": (self.wire_total.sent, self.wire_total.received, self.wire_total.dense),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned (of a compressor of the same type and config)."""
        if state.get("type") != type(self).__name__:
            raise ValueError(f"state is of a {state.get('type')}, not of a {type(self).__name__}")
        if state.get("config") != self._config():
            raise ValueError(
                f"state was saved with config {state.get('config')}, this compressor has {self._config()}"
            )
        self._residuals = {k: v.detach().to(torch.float32).clone() for k, v in state["residuals"].items()}
        self._calls = dict(state["calls"])
        self.wire_total = WireStats(*state["wire_total"])

    def __getstate__(self) -> dict:
        return self.state_dict()

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state["config"])
        self.load_state_dict(state)

    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        """The error-feedback residual of ``key`` (None before its first compressed call)."""
        return self._residuals.get(key)

    def take_residual(self, key: Hashable) -> Optional[torch.Tensor]:
        """Removes and returns the residual of ``key`` (None if it has none): for a caller that moves
        a tensor's error feedback to another compressor (comm/compression/adaptive/)."""
        return self._residuals.pop(key, None)

    def put_residual(self, key: Hashable, residual: torch.Tensor) -> None:
        """Makes ``residual`` the error-feedback residual of ``key`` (what :meth:`take_residual`
        took from another compressor of the same key's tensor)."""
        self._residuals[key] = residual

    def residual_for(self, key: Hashable, numel: int, device: torch.device = _CPU) -> Optional[torch.Tensor]:
        """The float32 error-feedback residual of ``key`` for a tensor of ``numel`` elements on
        ``device``: zeros for a new key or a new size, moved to ``device`` if it was loaded
        elsewhere; None without error feedback."""
        if not self.error_feedback:
            return None
        r = self._residuals.get(key)
        if r is None or r.numel() != numel:  # new key, or the bucket changed shape
            r = torch.zeros(numel, dtype=torch.float32, device=device)
            self._residuals[key] = r
        elif r.device != device:  # loaded from a checkpoint mapped to another device
            r = self._residuals[key] = r.to(device)
        return r

    def seed_for(self, rank: int, key: Hashable, call: int) -> int:
        """The stochastic rounding seed of ``rank``'s ``call``-th compression of ``key``."""
        return _mix64(self.seed, rank, _key_hash(key), call)

    def _take_scratch(self, key: Hashable, make: Callable[[], list], fits: Callable[[list], bool]) -> list:
        """Buffers owned by one call until it finishes (a second call in flight with the same key
        gets its own)."""
        bufs = self._scratch.pop(key, None)
        return bufs if bufs is not None and fits(bufs) else make()

    # -- the all-reduce --------------------------------------------------------------------
    def all_reduce(
        self,
        comm: Union[CompressionHost, "torch.distributed.ProcessGroup", HostGroups, None],
        tensor: torch.Tensor,
        op: Op = "avg",
        *,
        key: Hashable = "default",
        async_op: bool = False,
        step: Optional[int] = None,
    ) -> Optional[Union[CompressedWork, GroupWork]]:
        """Compressed all-reduce of ``tensor`` in place (``op`` "sum" or "avg", or torch's
        ReduceOp.SUM / AVG). ``step`` overrides the per-key call count that the warm-up compares
        with (the DDP hook passes its iteration). Sets ``last_wire_bytes`` here (and on a braid
        communicator).

        ``comm`` carries the compressed bytes: a braid :class:`Communicator` (CPU tensors; the
        communicator runs the call, see :meth:`all_reduce_on`), a torch ProcessGroup (None: the
        default group; CPU or CUDA tensors, quantized on their device and summed in rank order in
        float32, the group moving the bytes), or a :class:`~braid.comm.core.group_carrier.HostGroups`
        (exact inside a host, compressed across hosts). Async calls return a
        :class:`CompressedWork` (braid) or a :class:`~braid.comm.core.group.GroupWork`
        (process groups)."""
        if COMPRESSED_ALL_REDUCE in getattr(comm, "capabilities", ()):  # a group with a fused call runs it
            return comm.all_reduce(tensor, op, async_op, compression=self, key=key, step=step)
        code = compressed_op_code(op)
        check_tensor(tensor)
        carrier = group_carrier.carrier_of(comm, "comm")
        kernels_for(tensor.device)  # a device without kernels fails here, before any state changes
        self._check_numel(tensor.numel())  # before any state changes: a refused call leaves none
        calls, step = self._next_call(key, step)
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        return self._all_reduce_on_group(carrier, tensor, flat, code, key, calls, step, async_op)

    def all_reduce_on(self, comm: BraidCollectives, tensor: torch.Tensor, op: Op = "avg", *,
                      key: Hashable = "default", async_op: bool = False,
                      step: Optional[int] = None) -> tuple[Optional[CompressedWork], WireStats]:
        """The compressed all-reduce of the CPU ``tensor`` in place over a braid communicator's
        collectives ``comm`` (``op``, ``key`` and ``step`` as in :meth:`all_reduce`). Returns its
        work (None unless ``async_op``) and its wire statistics, which the communicator records."""
        if not self.fused:
            raise TypeError(f"{type(self).__name__} has no fused call in braid's communicator: reduce with "
                            "Communicator.all_reduce(t, compression=q) or q.all_reduce(c, t)")
        op_code = compressed_op_code(op)
        check_tensor(tensor)
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor must be a CPU tensor to travel through a braid Communicator, "
                             f"got a tensor on {tensor.device} (reduce CUDA tensors over a torch "
                             "process group)")
        self._check_numel(tensor.numel())  # before any state changes: a refused call leaves none
        calls, step = self._next_call(key, step)
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        n, es = comm.world_size, flat.element_size()
        path = self.last_path = choose_path(self, comm, flat.numel(), step)
        if path == EXACT:
            work = comm.all_reduce(flat, op_code, async_op)
            stats = self.exact_wire_stats(flat.numel() * es, n)
            finish = None
        else:
            seed = self.seed_for(comm.rank, key, calls)
            run = getattr(self, {FLAT: "_compressed", BETWEEN_HOSTS: "_compressed_between_hosts",
                                 PIPELINED: "_compressed_pipelined"}[path])
            work, finish = run(comm, flat, op_code, key, seed, async_op)
            if path == BETWEEN_HOSTS:  # exact inside each host, compressed across
                stats = self.wire_stats(flat.numel(), es, comm.num_hosts, comm.local_world_size,
                                        float32_fallback=True)
            else:
                stats = self.wire_stats(flat.numel(), es, n)
        self._count(stats)

        def done() -> None:
            if finish is not None:
                finish()
            copy_back(flat, tensor)

        if not async_op:
            done()
            return None, stats
        return CompressedWork(work, done, tensor), stats

    def all_reduce_on_communicator(self, communicator: Any, tensor: torch.Tensor, op: Op = "avg", *,
                                   key: Hashable = "default", async_op: bool = False,
                                   step: Optional[int] = None) -> tuple[Optional[Any], Optional[WireStats]]:
        """``Communicator.all_reduce(tensor, compression=self)``: the fused one-call path on the
        communicator's extension object where this compressor has one, else :meth:`all_reduce` over
        the communicator's collectives. Returns the work (None unless ``async_op``) and the wire
        statistics the communicator records as ``last_wire_bytes``."""
        if not (self.fused and COMPRESSED_ALL_REDUCE in communicator.capabilities):
            work = self.all_reduce(group_carrier.GroupCarrier(communicator), tensor, op, key=key,
                                   async_op=async_op, step=step)
            return work, self.last_wire_bytes
        return self.all_reduce_on(communicator._c, tensor, op, key=key, async_op=async_op, step=step)

    def next_call(self, key: Hashable) -> int:
        """Counts a call of ``key`` and returns its number among the key's calls (0 first): what a
        caller compressing on its own (the sharded wrapper's reduce-scatters) compares with
        ``warmup_steps`` and seeds its rounding with. The count is part of the state dict."""
        return self._next_call(key, None)[0]

    def _next_call(self, key: Hashable, step: Optional[int]) -> tuple:
        """Counts a call of ``key``: (its number among the key's calls, the warm-up's step)."""
        calls = self._calls.get(key, 0)
        self._calls[key] = calls + 1
        return calls, calls if step is None else step

    def _count(self, stats: WireStats) -> None:
        self.last_wire_bytes = stats
        self.wire_total = self.wire_total + stats

    def _all_reduce_on_group(self, carrier, tensor, flat, op_code, key, calls, step, async_op):
        """The all-reduce over a process group carrier: the warm-up's exact reduction or the
        compressed one, as one job (comm/core/group_carrier.py's issue: in order on CPU, on the
        current stream on CUDA)."""
        n, es = carrier.size, flat.element_size()
        path = self.last_path = choose_path(self, carrier, flat.numel(), step)
        if path == EXACT:
            stats = self.exact_wire_stats(flat.numel() * es, n)

            def run() -> None:
                carrier.reduce_exact(flat, op_code == AVG, n)
        else:
            seed = self.seed_for(carrier.rank, key, calls)
            if path == HOSTS:
                run = self._on_hosts(carrier, flat, op_code, key, seed)
                stats = self.wire_stats(flat.numel(), es, carrier.inter.size, carrier.intra.size)
            else:
                run = self._on_group(carrier, flat, op_code, key, seed, n)
                stats = self.wire_stats(flat.numel(), es, n)
        self._count(stats)

        def job() -> None:
            run()
            copy_back(flat, tensor)

        inline = (carrier.group if isinstance(carrier, HostGroups) else carrier).inline
        work = GroupWork(group_carrier.issue(job, [tensor], tensor.device, inline))
        if async_op:
            return work
        work.wait()
        return None

    def _on_group(
        self, c: GroupCarrier, flat: torch.Tensor, op_code: int, key: Hashable, seed: int, divisor: int
    ) -> Callable[[], None]:
        """The compressed all-reduce of the 1-D ``flat`` over ``c`` (avg divides by ``divisor``):
        returns the function that runs it. Kernels of flat's device."""
        raise NotImplementedError

    # -- wire statistics: what each path moves, computed here only ---------------------------
    @staticmethod
    def exact_wire_stats(nbytes: int, world_size: int) -> WireStats:
        """The uncompressed all-reduce of ``nbytes`` (warm-up steps, a group of one)."""
        dense = dense_wire_bytes(nbytes, world_size)
        return WireStats(dense, dense, dense)

    def wire_stats(self, numel: int, elem_size: int, peers: int, local: int = 1, *,
                   float32_fallback: bool = False) -> WireStats:
        """Bytes one rank moves in a compressed all-reduce of ``numel`` elements of ``elem_size``
        bytes: compressed among ``peers`` ranks (or hosts, when each host's ``local`` ranks first
        reduce exactly among themselves: a reduce-scatter and an all-gather of the host's slices),
        against the uncompressed all-reduce over every rank. ``float32_fallback``: a top-k's dense
        fallback travels as float32 (the communicator's hierarchical path), not in the tensor's dtype."""
        per = -(-numel // local)
        moved = self._compressed_bytes(per, peers, elem_size, float32_fallback) if peers > 1 else 0
        moved += 2 * (local - 1) * per * elem_size
        return WireStats(moved, moved, dense_wire_bytes(numel * elem_size, peers * local))

    def _compressed_bytes(self, count: int, peers: int, elem_size: int, float32_fallback: bool) -> int:
        """Bytes one rank sends compressing ``count`` elements among ``peers`` ranks."""
        raise NotImplementedError

    def _on_hosts(self, hosts: HostGroups, flat: torch.Tensor, op_code: int, key: Hashable, seed: int
                  ) -> Callable[[], None]:
        """Exact inside the host, compressed across hosts: the host reduce-scatters ``flat`` (sum
        in local rank order, rounded once to its dtype), this rank's slice is compressed once (its
        own residual) and all-reduced among the ranks of its local index on every host (avg
        divides by every rank), and the host all-gathers the slices."""
        per = -(-flat.numel() // hosts.intra.size)
        mine = torch.empty(per, dtype=flat.dtype, device=flat.device)
        average = op_code == AVG
        if hosts.inter.size == 1:  # one host: nothing is compressed

            def run_across() -> None:
                hosts.inter.reduce_exact(mine, average, hosts.size)
        else:
            run_across = self._on_group(hosts.inter, mine, op_code, key, seed, hosts.size)

        def run() -> None:
            mine.copy_(hosts.intra.sum_slices(flat, per))
            run_across()
            hosts.intra.gather_slices(mine, flat)

        return run

    def _check_numel(self, numel: int) -> None:
        """Raises ValueError for a tensor size this compressor cannot carry (none by default)."""

    # Settings that may differ between ranks without changing what travels.
    _LOCAL_SETTINGS = ("seed", "error_feedback", "warmup_steps", "stochastic")

    def _call_tag(self, op_code: int, flat: torch.Tensor) -> int:
        """32 bits the ranks' collectives compare (with sequence, kind, dtype and byte count):
        a hash of the compressor's type and wire settings, the op, the dtype and the element
        count, so ranks that disagree on any of them raise CollectiveMismatch instead of
        mixing payloads that merely have the same size."""
        wire = sorted((k, v) for k, v in self._config().items() if k not in self._LOCAL_SETTINGS)
        what = zlib.crc32(repr((type(self).__name__, wire, str(flat.dtype))).encode())
        return (_mix64(what, op_code, flat.numel()) & 0xFFFFFFFF) or 1

    def _compressed(self, comm: BraidCollectives, flat: torch.Tensor, op_code: int, key: Hashable, seed: int,
                    async_op: bool) -> tuple:
        """Issues the compressed collective; returns (work or None, finish)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"


class BlockQuantizer(Compressor):
    """Block quantization with one float32 scale per block (absmax / qmax)."""

    bits = 8
    pipelines = True

    def __init__(self, block: int, stochastic: bool = True, **kwargs: Any):
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_QUANT_BLOCK:
            raise ValueError(f"block must be an int in [1, {MAX_QUANT_BLOCK}], got {block!r}")
        if self.bits == 4 and block % 2:
            raise ValueError(f"block must be even for 4-bit quantization (two values per byte), got {block}")
        super().__init__(**kwargs)
        self.block = block
        if not isinstance(stochastic, bool):
            raise TypeError(f"stochastic must be a bool, got {stochastic!r}")
        self.stochastic = stochastic

    def _config(self) -> dict:
        return {"block": self.block, "stochastic": self.stochastic, **super()._config()}

    def wire_bytes(self, count: int) -> int:
        """Size of ``count`` quantized elements: values, padding to 4 bytes, scales."""
        return _C.quantized_bytes(count, self.bits, self.block)

    # -- the format, on any device: what every path outside the communicator's fused calls uses --
    def encode(self, x: torch.Tensor, residual: Optional[torch.Tensor], seed: int, index_base: int,
               chunk: int, nchunks: int, out: Optional[torch.Tensor] = None, *,
               stochastic: Optional[bool] = None) -> torch.Tensor:
        """``nchunks`` chunks of ``chunk`` elements of ``x`` (+ ``residual``, which then keeps what
        the rounding dropped) as payloads of ``wire_bytes(chunk)`` bytes each, into ``out`` (or a
        new uint8 tensor), which is returned. ``stochastic`` overrides the quantizer's rounding
        (weights are always rounded to nearest)."""
        rounding = self.stochastic if stochastic is None else stochastic
        return kernels_for(x.device).quantize(x, residual, self.bits, self.block, rounding, seed, index_base,
                                              chunk, nchunks, out=out)

    def decode(self, payload: torch.Tensor, out: torch.Tensor, chunk: int) -> None:
        """``out`` (its first elements, any float dtype) = the chunks of ``chunk`` elements in
        ``payload``, one after the other."""
        kernels_for(out.device).dequantize(payload, self.bits, self.block, out, chunk)

    def decode_accumulate(self, payload: torch.Tensor, accumulator: torch.Tensor) -> None:
        """``accumulator`` (float32) += the one chunk in ``payload``."""
        kernels_for(accumulator.device).dequantize_accumulate(payload, self.bits, self.block, accumulator)

    def decode_sum(self, payloads: torch.Tensor, n: int, accumulator: torch.Tensor) -> torch.Tensor:
        """``accumulator`` (float32) += the ``n`` equal chunks in ``payloads``, one after the other
        (in rank order where they came from n ranks: the same sum on every rank, every run);
        returns ``accumulator``."""
        cb = payloads.numel() // n
        for r in range(n):
            self.decode_accumulate(payloads[r * cb:(r + 1) * cb], accumulator)
        return accumulator

    def _compressed_bytes(self, count: int, peers: int, elem_size: int, float32_fallback: bool) -> int:
        return 2 * (peers - 1) * self.wire_bytes(self.chunk_elems(count, peers))  # all-to-all + all-gather

    def chunk_elems(self, numel: int, world_size: int) -> int:
        """Elements of each rank's chunk: numel / world_size rounded up to whole blocks."""
        per = -(-numel // world_size)
        return max(self.block, -(-per // self.block) * self.block)

    def _compressed(self, comm, flat, op_code, key, seed, async_op):
        n, numel = comm.world_size, flat.numel()
        chunk = self.chunk_elems(numel, n)
        cb = self.wire_bytes(chunk)
        bufs = self._chunk_buffers(key, n, chunk, cb, flat.device)
        send, recv, acc, gathered = bufs
        residual = self.residual_for(key, numel)
        _C.quantize(flat, residual, self.bits, self.block, self.stochastic, seed, 0, chunk, n, out=send)
        work = comm.quantized_all_reduce(
            send,
            recv,
            acc,
            gathered,
            self.bits,
            self.block,
            chunk,
            op_code == AVG,
            self.stochastic,
            _mix64(seed, 1),
            async_op,
            self._call_tag(op_code, flat),
        )

        def finish() -> None:
            _C.dequantize(gathered, self.bits, self.block, flat, chunk)
            self._scratch[key] = bufs

        return work, finish

    def _chunk_buffers(self, key: Hashable, n: int, chunk: int, cb: int, device: torch.device) -> list:
        """send, recv, accumulator, gathered of a quantized all-reduce among ``n`` ranks: kept per
        key between calls (fresh memory would cost its page faults every call)."""

        def make() -> list:
            return [torch.empty(n * cb, dtype=torch.uint8, device=device),
                    torch.empty(n * cb, dtype=torch.uint8, device=device),
                    torch.empty(chunk, dtype=torch.float32, device=device),
                    torch.empty(n * cb, dtype=torch.uint8, device=device)]

        return self._take_scratch(key, make, lambda b: b[0].numel() == n * cb and b[2].numel() == chunk
                                  and b[0].device == device)

    def _on_group(self, c, flat, op_code, key, seed, divisor):
        """Quantize once on flat's device, all-to-all of the chunks, every chunk decoded and summed
        once in rank order in float32 by its owner, re-quantized once, all-gathered, decoded: the
        steps (and bits) of the communicator's quantized all-reduce (quantized_all_reduce.cc)."""
        n, numel = c.size, flat.numel()
        chunk = self.chunk_elems(numel, n)
        cb = self.wire_bytes(chunk)
        kernels_for(flat.device)  # a device without kernels fails here

        def run() -> None:
            bufs = self._chunk_buffers(key, n, chunk, cb, flat.device)
            send, recv, acc, gathered = bufs
            residual = self.residual_for(key, numel, flat.device)
            self.encode(flat, residual, seed, 0, chunk, n, out=send)
            c.all_to_all(recv, send)
            self.decode_sum(recv, n, acc.zero_())
            if op_code == AVG:
                acc.div_(divisor)
            mine = send[:cb]  # free again once the all-to-all is done
            self.encode(acc, None, _mix64(seed, 1), c.rank * chunk, chunk, 1, out=mine)
            c.all_gather(gathered, mine)
            self.decode(gathered, flat, chunk)
            self._scratch[key] = bufs

        return run

    def _compressed_between_hosts(self, comm, flat, op_code, key, seed, async_op):
        """Exact on each host, quantized between hosts: the host reduce-scatters the tensor (local
        rank i keeps slice i), slice i is quantized once (its own error-feedback residual) and
        all-reduced with the ranks of local index i on the other hosts, pipelined in pieces, and
        the host all-gathers the slices. One unit of work on the communicator (in issue order,
        async or not)."""
        local, hosts, numel = comm.local_world_size, comm.num_hosts, flat.numel()
        per = -(-numel // local)
        chunk = self.chunk_elems(per, hosts)
        padded, mine = self._take_scratch(key, lambda: list(_slice_buffers(flat, local)),
                                          lambda b: b[1].numel() == per and b[1].dtype == flat.dtype)
        work = comm.host_quantized_all_reduce(
            flat, self.residual_for(key, per), padded, mine, self.bits, self.block, chunk, op_code == AVG,
            self.stochastic, _mix64(seed, 1), seed, async_op, self._call_tag(op_code, flat))

        def finish() -> None:
            self._scratch[key] = [padded, mine]

        return work, finish

    def _compressed_pipelined(self, comm, flat, op_code, key, seed, async_op):
        """Every rank on a host of its own: the quantized all-reduce between hosts pipelined in
        pieces (quantize, send, reduce, re-quantize, send back, decode overlapped), with the bits
        of the one-call layout. One unit of work on the communicator."""
        n, numel = comm.world_size, flat.numel()
        chunk = self.chunk_elems(numel, n)
        work = comm.pipelined_quantized_all_reduce(
            flat, self.residual_for(key, numel), self.bits, self.block, chunk, op_code == AVG,
            self.stochastic,
            seed, _mix64(seed, 1), async_op, self._call_tag(op_code, flat))
        return work, None


class Int8Quantizer(BlockQuantizer):
    """int8 values with one float32 scale per ``block`` elements (3.94x smaller than float32 at
    block 256). ``stochastic`` rounding is unbiased; otherwise round to nearest."""

    bits = 8

    def __init__(
        self,
        block: int = 256,
        stochastic: bool = True,
        *,
        error_feedback: bool = True,
        warmup_steps: int = 2,
        seed: int = 0,
    ):
        super().__init__(
            block, stochastic, error_feedback=error_feedback, warmup_steps=warmup_steps, seed=seed
        )


class Int4Quantizer(BlockQuantizer):
    """int4 values (two per byte, range -7..7) with one float32 scale per ``block`` elements
    (7.5x smaller than float32 at block 128)."""

    bits = 4

    def __init__(
        self,
        block: int = 128,
        stochastic: bool = True,
        *,
        error_feedback: bool = True,
        warmup_steps: int = 2,
        seed: int = 0,
    ):
        super().__init__(
            block, stochastic, error_feedback=error_feedback, warmup_steps=warmup_steps, seed=seed
        )


class FP8Quantizer(BlockQuantizer):
    """float8 e4m3 values with one float32 scale per ``block`` elements (absmax / 448), rounded to
    nearest even: the bytes of int8 (3.94x smaller than float32 at block 256), with a relative grid
    (3 mantissa bits) that keeps small values of a block that int8's uniform grid rounds to 0.

    It has no fused path in braid's C++ core: over a braid Communicator it runs the compressors'
    one algorithm through the communicator's collectives (comm/core/group_carrier.py), as over any
    process group; its format is written with torch operations, so it runs on any device torch
    has float8 for. Always rounds to nearest (``stochastic`` is not available)."""

    bits = 8
    fused = False
    pipelines = False
    FP8_MAX = 448.0  # the largest finite float8 e4m3fn

    def __init__(self, block: int = 256, *, error_feedback: bool = True, warmup_steps: int = 2,
                 seed: int = 0):
        super().__init__(block, False, error_feedback=error_feedback, warmup_steps=warmup_steps, seed=seed)

    def _config(self) -> dict:
        config = super()._config()
        del config["stochastic"]
        return config

    def _layout(self, chunk: int) -> tuple:
        """(blocks per chunk, bytes of the values with their padding to 4, bytes per chunk)."""
        nb = -(-chunk // self.block)
        values = chunk + (-chunk) % 4
        return nb, values, values + 4 * nb

    def encode(self, x, residual, seed, index_base, chunk, nchunks, out=None, *, stochastic=None):
        nb, values, cb = self._layout(chunk)
        numel = x.numel()
        padded = torch.zeros(nchunks * chunk, dtype=torch.float32, device=x.device)  # zero padded
        padded[:numel] = x.reshape(-1)
        if residual is not None:
            padded[:numel] += residual
        blocks = torch.zeros(nchunks, nb * self.block, dtype=torch.float32, device=x.device)
        blocks[:, :chunk] = padded.view(nchunks, chunk)
        blocks = blocks.view(nchunks, nb, self.block)
        scale = blocks.abs().amax(-1) / self.FP8_MAX
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (blocks / safe.unsqueeze(-1)).clamp(-self.FP8_MAX, self.FP8_MAX).to(torch.float8_e4m3fn)
        if residual is not None:  # what the rounding dropped, for the next call
            decoded = (q.to(torch.float32) * scale.unsqueeze(-1)).view(nchunks, -1)[:, :chunk].reshape(-1)
            residual.copy_(padded[:numel] - decoded[:numel])
        payload = out if out is not None else torch.empty(nchunks * cb, dtype=torch.uint8, device=x.device)
        rows = payload.view(nchunks, cb)
        rows[:, :chunk] = q.view(nchunks, -1)[:, :chunk].view(torch.uint8)
        rows[:, chunk:values] = 0
        rows[:, values:] = scale.contiguous().view(torch.uint8).view(nchunks, 4 * nb)
        return payload

    def _decoded(self, payload: torch.Tensor, chunk: int) -> torch.Tensor:
        """The float32 values of the chunks in ``payload``, as (chunks, chunk)."""
        nb, values, cb = self._layout(chunk)
        rows = payload.view(-1, cb)
        q = rows[:, :chunk].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        scale = rows[:, values:].contiguous().view(torch.float32)
        n = rows.shape[0]
        padded = torch.zeros(n, nb * self.block, dtype=torch.float32, device=payload.device)
        padded[:, :chunk] = q
        return (padded.view(n, nb, self.block) * scale.unsqueeze(-1)).view(n, -1)[:, :chunk]

    def decode(self, payload, out, chunk):
        flat = out.view(-1)
        flat.copy_(self._decoded(payload, chunk).reshape(-1)[:flat.numel()])

    def decode_accumulate(self, payload, accumulator):
        accumulator.add_(self._decoded(payload, accumulator.numel()).view(-1))


class TopK(Compressor):
    """Keeps the ``ratio`` fraction of elements with the largest magnitudes (at least one), sent
    as float32 values and int32 indices through an all-gather and summed in rank order. When
    k * world_size * 8 bytes would exceed the dense tensor, the dense all-reduce is cheaper and
    is used instead."""

    def __init__(
        self, ratio: float = 0.01, *, error_feedback: bool = True, warmup_steps: int = 2, seed: int = 0
    ):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        super().__init__(error_feedback=error_feedback, warmup_steps=warmup_steps, seed=seed)
        self.ratio = float(ratio)

    def _config(self) -> dict:
        return {"ratio": self.ratio, **super()._config()}

    def k(self, numel: int) -> int:
        """Elements kept of a tensor of ``numel``."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def _compressed_bytes(self, count: int, peers: int, elem_size: int, float32_fallback: bool) -> int:
        if self.sparse(count, peers, elem_size):
            return (peers - 1) * 8 * self.k(count)  # (value, index) pairs through an all-gather
        # The dense fallback sends input + residual: float32 with error feedback (and on the
        # communicator's hierarchical path), the tensor's dtype without.
        fallback = 4 if self.error_feedback or float32_fallback else elem_size
        return dense_wire_bytes(count * fallback, peers)

    def sparse(self, numel: int, world_size: int, elem_size: int = 4) -> bool:
        """Whether the (values, indices) all-gather is smaller than the dense tensor."""
        return self.k(numel) * world_size * 8 <= numel * elem_size

    def _check_numel(self, numel: int) -> None:
        if numel > _INT32_MAX:
            raise ValueError(f"TopK: tensor has {numel} elements, but top-k indices travel as int32: "
                             f"at most {_INT32_MAX} elements per call")

    def _compressed(self, comm, flat, op_code, key, seed, async_op):
        n, numel, es = comm.world_size, flat.numel(), flat.element_size()
        residual = self.residual_for(key, numel)
        if residual is not None:
            _C.error_feedback(flat, residual, None)  # residual = input + residual
        if not self.sparse(numel, n, es):
            dense = _send_everything(flat, residual)
            work = comm.all_reduce(dense, op_code, async_op)

            def finish_dense() -> None:
                if dense is not flat:
                    flat.copy_(dense)

            return work, finish_dense
        k = self.k(numel)
        send = self._select(CpuKernels, flat, residual, k)
        gathered = torch.empty(n * 8 * k, dtype=torch.uint8, device=flat.device)
        work = comm.all_gather(gathered, send, async_op, self._call_tag(op_code, flat))

        def finish() -> None:
            self._sum_gathered(CpuKernels, gathered, n, k, flat, op_code == AVG, n)

        return work, finish

    @staticmethod
    def _select(kern, flat: torch.Tensor, residual: Optional[torch.Tensor], k: int) -> torch.Tensor:
        """The ``k`` largest magnitudes of ``residual`` (input + residual already) or of ``flat``
        (no error feedback), packed as 8 k bytes: float32 values, then int32 indices."""
        values, indices = kern.top_k(residual if residual is not None else flat, k)
        if residual is not None:
            # The sent entries leave the residual: x - x = 0. An inf or NaN would leave NaN there:
            # non-finite values rank above every number, so when one was sent, every non-finite
            # entry of the residual is reset to 0 (the others' fate in the other compressors).
            kern.scatter_add(residual, indices, values.neg())
            if residual.device.type == "cpu":  # the flag is in host memory: reading it costs nothing
                if not bool(torch.isfinite(values).all()):
                    residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            else:  # on a device the reset is masked by the flag there: no host wait per call
                sent_nonfinite = torch.isfinite(values).all().logical_not()
                nonfinite = torch.isfinite(residual).logical_not_()
                residual.masked_fill_(nonfinite.logical_and_(sent_nonfinite), 0.0)
        send = torch.empty(8 * k, dtype=torch.uint8, device=flat.device)
        send[: 4 * k].view(torch.float32).copy_(values)
        send[4 * k :].view(torch.int32).copy_(indices)
        return send

    @staticmethod
    def _sum_gathered(kern, gathered: torch.Tensor, n: int, k: int, flat: torch.Tensor, average: bool,
                      divisor: int) -> None:
        """flat = the sum of every rank's (values, indices) in ``gathered``, in rank order."""
        if flat.dtype == torch.float32:  # summed in place: no dense temporary
            acc = flat.zero_()
        else:
            acc = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        for r in range(n):  # rank order: every rank sums the same pairs in the same order
            part = gathered[r * 8 * k : (r + 1) * 8 * k]
            kern.scatter_add(acc, part[4 * k :].view(torch.int32), part[: 4 * k].view(torch.float32))
        if average:
            acc.div_(divisor)
        if acc is not flat:
            flat.copy_(acc)

    def _on_group(self, c, flat, op_code, key, seed, divisor):
        """Top-k of flat + residual on its device, (values, indices) all-gathered and summed in
        rank order; the exact all-reduce of flat + residual where that sends fewer bytes."""
        n, numel, es = c.size, flat.numel(), flat.element_size()
        k, sparse = self.k(numel), self.sparse(numel, n, es)
        kern = kernels_for(flat.device)
        average = op_code == AVG

        def run() -> None:
            residual = self.residual_for(key, numel, flat.device)
            if residual is not None:
                kern.error_feedback(flat, residual, None)  # residual = input + residual
            if not sparse:
                dense = _send_everything(flat, residual)
                c.reduce_exact(dense, average, divisor)
                if dense is not flat:
                    flat.copy_(dense)
                return
            send = self._select(kern, flat, residual, k)
            gathered = torch.empty(n * 8 * k, dtype=torch.uint8, device=flat.device)
            c.all_gather(gathered, send)
            self._sum_gathered(kern, gathered, n, k, flat, average, divisor)

        return run

    def _compressed_between_hosts(self, comm, flat, op_code, key, seed, async_op):
        """Exact on each host, top-k between hosts: the host reduce-scatters the tensor, this
        rank's slice (+ its residual) keeps its top k of the slice, all-gathered among the ranks
        of the same local index on the other hosts and summed in host order, and the host
        all-gathers the slices. One unit of work on the communicator."""
        local, hosts, numel, es = comm.local_world_size, comm.num_hosts, flat.numel(), flat.element_size()
        per = -(-numel // local)
        k = self.k(per)
        sparse = self.sparse(per, hosts, es)

        def make() -> list:  # padded, slice, values, indices, send, gathered, accumulator
            on = flat.device
            return [*_slice_buffers(flat, local), torch.empty(k, device=on),
                    torch.empty(k, dtype=torch.int32, device=on),
                    torch.empty(8 * k, dtype=torch.uint8, device=on),
                    torch.empty(hosts * 8 * k, dtype=torch.uint8, device=on), torch.empty(per, device=on)]

        bufs = self._take_scratch(key, make, lambda b: b[1].numel() == per and b[1].dtype == flat.dtype
                                  and b[2].numel() == k)
        work = comm.host_top_k_all_reduce(flat, self.residual_for(key, per), *bufs, k, sparse,
                                             op_code == AVG, async_op, self._call_tag(op_code, flat))

        def finish() -> None:
            self._scratch[key] = bufs

        return work, finish


class Cast(Compressor):
    """Sends the tensor as ``dtype`` (torch.bfloat16 or torch.float16, rounded to nearest even):
    braid accumulates the 16-bit values in float32 and rounds once. With error feedback the
    rounding error of the cast is carried to the next call; rounding and the residual update are
    one C++ pass over the tensor, into a send buffer kept per key. Values beyond float16's range
    become infinities (bfloat16 has float32's range)."""

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        *,
        error_feedback: bool = True,
        warmup_steps: int = 2,
        seed: int = 0,
    ):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype!r}")
        super().__init__(error_feedback=error_feedback, warmup_steps=warmup_steps, seed=seed)
        self.dtype = dtype

    def _config(self) -> dict:
        return {"dtype": self.dtype, **super()._config()}

    def _compressed_bytes(self, count: int, peers: int, elem_size: int, float32_fallback: bool) -> int:
        return dense_wire_bytes(count * torch.finfo(self.dtype).bits // 8, peers)  # 16-bit values

    def _compressed(self, comm, flat, op_code, key, seed, async_op):
        numel = flat.numel()
        residual = self.residual_for(key, numel)
        bufs = self._sent_buffer(key, numel, flat.device)
        sent = bufs[0]
        # One pass: sent = round(input + residual), residual = what the rounding dropped.
        _C.cast(flat, residual, sent)
        work = comm.all_reduce(sent, op_code, async_op)

        def finish() -> None:
            flat.copy_(sent)
            self._scratch[key] = bufs

        return work, finish

    def _sent_buffer(self, key: Hashable, numel: int, device: torch.device) -> list:
        """[the 16-bit copy that travels], kept per key between calls."""
        return self._take_scratch(key, lambda: [torch.empty(numel, dtype=self.dtype, device=device)],
                                  lambda b: b[0].numel() == numel and b[0].device == device)

    def _on_group(self, c, flat, op_code, key, seed, divisor):
        """flat + residual rounded once to ``dtype`` on its device, all-reduced exactly in rank
        order (16-bit values on the wire, float32 sums, one rounding)."""
        numel = flat.numel()
        kern = kernels_for(flat.device)

        def run() -> None:
            bufs = self._sent_buffer(key, numel, flat.device)
            sent = bufs[0]
            kern.cast(flat, self.residual_for(key, numel, flat.device), sent)
            c.reduce_exact(sent, op_code == AVG, divisor)
            flat.copy_(sent)
            self._scratch[key] = bufs

        return run

    def _compressed_between_hosts(self, comm, flat, op_code, key, seed, async_op):
        """Exact on each host, cast between hosts: the host reduce-scatters the tensor, this
        rank's slice (+ its residual) is rounded once to ``dtype`` and all-reduced among the ranks
        of the same local index on the other hosts, and the host all-gathers the slices."""
        local = comm.local_world_size
        per = -(-flat.numel() // local)

        def make() -> list:  # padded, slice, sent, accumulator
            return [*_slice_buffers(flat, local), torch.empty(per, dtype=self.dtype, device=flat.device),
                    torch.empty(per, device=flat.device)]

        bufs = self._take_scratch(key, make, lambda b: b[1].numel() == per and b[1].dtype == flat.dtype)
        work = comm.host_cast_all_reduce(flat, self.residual_for(key, per), *bufs, op_code == AVG,
                                            async_op)

        def finish() -> None:
            self._scratch[key] = bufs

        return work, finish


COMPRESSOR_NAMES = ("int8", "int4", "fp8", "topk", "bf16", "fp16")


def compressor(name: str) -> Compressor:
    """A compressor with its defaults by name: "int8", "int4", "fp8", "topk" (1%), "bf16" or "fp16"
    (casts); ValueError naming ``compression`` for another name."""
    makers = {"int8": Int8Quantizer, "int4": Int4Quantizer, "fp8": FP8Quantizer, "topk": TopK,
              "bf16": lambda: Cast(torch.bfloat16), "fp16": lambda: Cast(torch.float16)}
    if name not in makers:
        raise ValueError(f"compression must be one of {', '.join(map(repr, COMPRESSOR_NAMES))}, a braid.comm "
                         f"compressor or None, got {name!r}")
    return makers[name]()
