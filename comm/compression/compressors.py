"""Gradient compressors for braid's all_reduce and DDP hook.

Block quantization to int8 / int4 (one float32 scale per block), top-k sparsification and casts
to 16-bit floats, each with error feedback (what compression dropped is added to the next call's
input, per key) and a warm-up of exact reductions. A compressor's state is explicit:
``state_dict()`` / ``load_state_dict()`` and pickling carry the residuals and call counts.

    q = comm.Int8Quantizer()
    c.all_reduce(grad, op="avg", compression=q, key="layer1")
    c.last_wire_bytes            # WireStats(sent=..., received=..., dense=...)

A compressor is a format with its state (encode, decode, wire bytes, residuals, call counts);
driver.py runs the all-reduce for all of them, choosing its algorithm in one function.
The same compressors run over any torch process group (gloo, NCCL, braid's c10d backend) and on
CUDA tensors: ``q.all_reduce(group, grad)`` quantizes on the tensor's device and lets the group
carry the packed bytes (comm/core/group_carrier.py).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Hashable, Optional, Union

import torch

import braid.comm._C as _C  # the extension module itself (not the package)

from ..core.device_kernels import kernels_for
from ..core.group import GroupWork
from ..core.group_carrier import HostGroups
from ..core.vocabulary import Op
from ..core.wire import BraidCollectives, CompressionHost, WireStats, dense_wire_bytes
from . import driver
from .driver import GATHER, NATIVE, REQUANTIZE, CompressedWork, mix64 as _mix64

# Largest quantization block: csrc/core/compression/quantize.h's kMaxQuantBlock (the kernels hold a
# block in a stack buffer of float32).
MAX_QUANT_BLOCK = _C.MAX_QUANT_BLOCK
_INT32_MAX = 2**31 - 1
_CPU = torch.device("cpu")


def _key_hash(key: Hashable) -> int:
    """Stable across processes (Python's hash() of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


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

    #: How payloads of this format combine (driver.py): REQUANTIZE, GATHER or NATIVE.
    reduction = REQUANTIZE
    #: Whether braid's C++ core has this format, so that a braid Communicator runs it in its own
    #: calls (its compressed_all_reduce capability); without it a Communicator carries the
    #: driver's algorithm through its collectives, as a process group does.
    fused = True

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

    def residuals(self) -> list:
        """Every key's error-feedback residual, the tensors themselves (not copies): what the
        compressor holds besides its configuration."""
        return list(self._residuals.values())

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

    # -- what the driver (driver.py) uses ---------------------------------------------------
    def take_scratch(self, key: Hashable, make: Callable[[], list], fits: Callable[[list], bool]) -> list:
        """Buffers of ``key``'s call, kept since its last call if they ``fits``, else ``make()``: owned
        by one call until it gives them back (a second call in flight with the same key gets its
        own). Not state: never saved."""
        bufs = self._scratch.pop(key, None)
        return bufs if bufs is not None and fits(bufs) else make()

    def keep_scratch(self, key: Hashable, bufs: list) -> None:
        """Gives a call's buffers back for ``key``'s next call."""
        self._scratch[key] = bufs

    def count_call(self, key: Hashable, step: Optional[int]) -> tuple:
        """Counts a call of ``key``: (its number among the key's calls, the step the warm-up
        compares with: ``step`` where given, else that number)."""
        calls = self._calls.get(key, 0)
        self._calls[key] = calls + 1
        return calls, calls if step is None else step

    def count_wire(self, stats: WireStats) -> None:
        """Records a call's wire statistics (``last_wire_bytes``, ``wire_total``)."""
        self.last_wire_bytes = stats
        self.wire_total = self.wire_total + stats

    def check_numel(self, numel: int) -> None:
        """Raises ValueError for a tensor size this format cannot carry (none by default)."""

    def sends_less(self, numel: int, peers: int, elem_size: int) -> bool:
        """Whether this format's payloads for ``numel`` elements among ``peers`` ranks weigh less
        than the dense tensor (else the driver sends it dense). Always, but for top-k."""
        return True

    # Settings that may differ between ranks without changing what travels.
    _LOCAL_SETTINGS = ("seed", "error_feedback", "warmup_steps", "stochastic")

    def call_tag(self, op_code: int, flat: torch.Tensor) -> int:
        """32 bits the ranks' collectives compare (with sequence, kind, dtype and byte count):
        a hash of the compressor's type and wire settings, the op, the dtype and the element
        count, so ranks that disagree on any of them raise CollectiveMismatch instead of
        mixing payloads that merely have the same size."""
        wire = sorted((k, v) for k, v in self._config().items() if k not in self._LOCAL_SETTINGS)
        what = zlib.crc32(repr((type(self).__name__, wire, str(flat.dtype))).encode())
        return (_mix64(what, op_code, flat.numel()) & 0xFFFFFFFF) or 1

    # -- the all-reduce (driver.py runs it) -----------------------------------------------------
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
        with (the DDP hook passes its iteration). Sets ``last_wire_bytes`` and ``last_path`` here
        (and ``last_wire_bytes`` on a braid communicator).

        ``comm`` carries the compressed bytes: a braid :class:`Communicator` (CPU tensors; the
        communicator runs the call, see :meth:`all_reduce_on`), a torch ProcessGroup (None: the
        default group; CPU or CUDA tensors, encoded on their device and summed in rank order in
        float32, the group moving the bytes), or a :class:`~braid.comm.core.group_carrier.HostGroups`
        (exact inside a host, compressed across hosts). Async calls return a
        :class:`CompressedWork` (braid) or a :class:`~braid.comm.core.group.GroupWork`
        (process groups)."""
        return driver.all_reduce(self, comm, tensor, op, key, async_op, step)

    def all_reduce_on(self, comm: BraidCollectives, tensor: torch.Tensor, op: Op = "avg", *,
                      key: Hashable = "default", async_op: bool = False,
                      step: Optional[int] = None) -> tuple[Optional[CompressedWork], WireStats]:
        """The compressed all-reduce of the CPU ``tensor`` in place over a braid communicator's
        collectives ``comm`` (``op``, ``key`` and ``step`` as in :meth:`all_reduce`). Returns its
        work (None unless ``async_op``) and its wire statistics, which the communicator records."""
        return driver.all_reduce_on(self, comm, tensor, op, key, async_op, step)

    def all_reduce_on_communicator(self, communicator: Any, tensor: torch.Tensor, op: Op = "avg", *,
                                   key: Hashable = "default", async_op: bool = False,
                                   step: Optional[int] = None) -> tuple[Optional[Any], Optional[WireStats]]:
        """``Communicator.all_reduce(tensor, compression=self)``: the fused one-call path on the
        communicator's extension object where this compressor has one, else :meth:`all_reduce` over
        the communicator's collectives. Returns the work (None unless ``async_op``) and the wire
        statistics the communicator records as ``last_wire_bytes``."""
        return driver.all_reduce_on_communicator(self, communicator, tensor, op, key, async_op, step)

    def next_call(self, key: Hashable) -> int:
        """Counts a call of ``key`` and returns its number among the key's calls (0 first): what a
        caller compressing on its own (the sharded wrapper's reduce-scatters) compares with
        ``warmup_steps`` and seeds its rounding with. The count is part of the state dict."""
        return self.count_call(key, None)[0]

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

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"


class BlockQuantizer(Compressor):
    """Block quantization with one float32 scale per block (absmax / qmax). Payloads of chunks
    are decoded, summed and encoded again (``reduction`` REQUANTIZE)."""

    bits = 8
    reduction = REQUANTIZE

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
    is used instead (the driver's DENSE path). Payloads are all-gathered (``reduction`` GATHER)."""

    reduction = GATHER

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

    def sends_less(self, numel: int, peers: int, elem_size: int) -> bool:
        return self.sparse(numel, peers, elem_size)

    def check_numel(self, numel: int) -> None:
        if numel > _INT32_MAX:
            raise ValueError(f"TopK: tensor has {numel} elements, but top-k indices travel as int32: "
                             f"at most {_INT32_MAX} elements per call")

    def encode(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """The payload of the 1-D ``x``: the ``k(x.numel())`` largest magnitudes of ``x`` +
        ``residual`` (summed into the residual, which then keeps what was not sent) or of ``x``
        alone without error feedback, packed as 8 k bytes: float32 values, then int32 indices."""
        kern = kernels_for(x.device)
        k = self.k(x.numel())
        if residual is not None:
            kern.error_feedback(x, residual, None)  # residual = input + residual
        values, indices = kern.top_k(residual if residual is not None else x, k)
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
        payload = torch.empty(8 * k, dtype=torch.uint8, device=x.device)
        payload[: 4 * k].view(torch.float32).copy_(values)
        payload[4 * k :].view(torch.int32).copy_(indices)
        return payload

    def decode_sum(self, payloads: torch.Tensor, n: int, out: torch.Tensor, divisor: int = 1) -> None:
        """``out`` (1-D) = the sum of the ``n`` equal payloads in ``payloads`` (one per rank,
        summed in rank order: the same sum on every rank) divided by ``divisor``."""
        kern = kernels_for(out.device)
        k = payloads.numel() // (8 * n)
        if out.dtype == torch.float32:  # summed in place: no dense temporary
            acc = out.zero_()
        else:
            acc = torch.zeros(out.numel(), dtype=torch.float32, device=out.device)
        for r in range(n):
            part = payloads[r * 8 * k : (r + 1) * 8 * k]
            kern.scatter_add(acc, part[4 * k :].view(torch.int32), part[: 4 * k].view(torch.float32))
        if divisor != 1:
            acc.div_(divisor)
        if acc is not out:
            out.copy_(acc)


class Cast(Compressor):
    """Sends the tensor as ``dtype`` (torch.bfloat16 or torch.float16, rounded to nearest even):
    braid accumulates the 16-bit values in float32 and rounds once. With error feedback the
    rounding error of the cast is carried to the next call; rounding and the residual update are
    one C++ pass over the tensor, into a send buffer kept per key. Values beyond float16's range
    become infinities (bfloat16 has float32's range). The 16-bit values are summed by the
    group's exact all-reduce (``reduction`` NATIVE)."""

    reduction = NATIVE

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

    def encode(self, x: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out`` (of ``dtype``) = ``x`` + ``residual`` rounded to nearest even, the residual
        keeping what the rounding dropped: one pass over the tensor. Returns ``out``."""
        kernels_for(x.device).cast(x, residual, out)
        return out

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = the values of ``payload``."""
        out.copy_(payload)


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
