"""Timing and correctness protocol of the collectives benchmark, shared by every implementation.

numpy only: it needs nothing of torch (the Open MPI backend, ``mpi_peer.py``, works on numpy
buffers). An implementation is a :class:`Backend`; :func:`run_suite` measures backends over ops
and sizes and returns records.

Timing, for each (op, size), on zero-filled buffers: ``warmup`` calls, the slowest rank's median
warm-up call sets ``k`` (calls per batch) so that ``batches`` batches fill about ``time_budget``
seconds; then ``batches`` times: barrier, ``k`` back-to-back calls timed with
``time.perf_counter``. A rank's time per call is batch time / k; the batch's time is the slowest
rank's; the result is the median over batches. Timings cross ranks only after the timed region.
Several implementations in one process alternate batch by batch.

Correctness: fresh buffers filled with small integers every rank can regenerate for every rank
(rank r's element i is ``r + 1 + i % 13``), one call, and a count of the output elements that
differ from the exactly computed expectation (``#wrong``, summed over ranks).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
# Measured on request (--ops): all_to_all with equal splits, and with the fixed skew of
# split_counts() (an expert-parallel token exchange is rarely balanced); send_recv, point to point
# around a ring (each rank sends its S bytes to the next rank and receives S from the previous
# one, both posted together, as a pipeline stage or a ring-attention step does).
EXTRA_OPS = ("all_to_all", "all_to_allv", "send_recv")
ALL_OPS = OPS + EXTRA_OPS
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum", "all_gather": "none", "broadcast": "none",
         "all_to_all": "none", "all_to_allv": "none", "send_recv": "none"}
ROOT = 0  # broadcast source
PERIOD = 13  # of the check pattern: values stay small, so every dtype holds every sum exactly
# Integers up to 2**(mantissa bits + 1) are exact; float32 and wider types reach 2**24 or more.
_EXACT_INT_LIMIT = {"float16": 2**11, "bfloat16": 2**8}
# At ~5 us per call 1000 calls make a 5 ms batch: far above timer resolution and barrier skew.
MAX_ITERS_PER_BATCH = 1000


@dataclass(frozen=True)
class Timing:
    warmup: int = 3
    batches: int = 5
    time_budget: float = 0.5  # seconds of timed calls per (impl, op, size)
    iters: int | None = None  # fixed calls per batch instead of the budget


def add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """The timing options of the collectives benchmarks."""
    d = Timing()
    parser.add_argument("--warmup", type=int, default=d.warmup, help=f"warm-up calls (default {d.warmup})")
    parser.add_argument("--batches", type=int, default=d.batches,
                        help=f"timed batches; the median is reported (default {d.batches})")
    parser.add_argument("--time-budget", type=float, default=d.time_budget, metavar="SECONDS",
                        help="timed seconds per impl, op and size, which sets the calls per batch: "
                        f"many for small sizes, one for large (default {d.time_budget})")
    parser.add_argument("--iters", type=int, default=None,
                        help="fixed calls per batch (overrides --time-budget)")


def timing_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Timing:
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (warm-up calls set the calls per batch)")
    if args.batches < 1:
        parser.error("--batches must be at least 1")
    if not args.time_budget > 0:
        parser.error("--time-budget must be positive")
    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be at least 1")
    return Timing(args.warmup, args.batches, args.time_budget, args.iters)


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw: the share of S that crosses the busiest link, as in nccl-tests."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all", "all_to_allv"):
        return (n - 1) / n
    return 1.0


def message_count(op: str, nbytes: int, dtype: str, world_size: int) -> int:
    """Elements of the whole message S (reduce_scatter input, all_gather output) for a size,
    rounded down to a multiple of world_size where the op splits it over the ranks."""
    count = nbytes // ITEMSIZE[dtype]
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        count -= count % world_size
    if op == "all_to_allv":
        count -= count % _skew_total(world_size)
    return count


def _skew_total(n: int) -> int:
    return n * (n + 1) // 2


@functools.lru_cache(maxsize=64)
def split_counts(op: str, rank: int, world_size: int, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(elements ``rank`` sends to each rank, elements it receives from each) for all_to_all and
    all_to_allv, whose S (``count`` elements) is what every rank sends and receives. all_to_allv:
    rank i sends rank j a share proportional to 1 + (i + j) % n, so every row and every column
    of the split matrix holds the same total and the pieces range from S / (n(n+1)/2) to n times
    that."""
    n = world_size
    if op == "all_to_all":
        equal = (count // n,) * n
        return equal, equal
    unit = count // _skew_total(n)
    return (tuple(unit * (1 + (rank + j) % n) for j in range(n)),
            tuple(unit * (1 + (i + rank) % n) for i in range(n)))


def check_is_exact(dtype: str, world_size: int) -> bool:
    """Whether every partial sum of the check pattern is exact in ``dtype``."""
    largest = world_size * (world_size + 1) // 2 + world_size * (PERIOD - 1)
    return largest <= _EXACT_INT_LIMIT.get(dtype, 2**24)


def numpy_dtype(dtype: str) -> np.dtype:
    # numpy has no bfloat16: its pattern is built in float32 (exact) and converted by the backend.
    return np.dtype("float32" if dtype == "bfloat16" else dtype)


def periodic(count: int, dtype: str, shift: int, scale: int = 1, offset: int = 0) -> np.ndarray:
    """``shift + scale * ((offset + i) % PERIOD)`` for i < count, built by tiling one period."""
    one = shift + scale * ((offset + np.arange(PERIOD)) % PERIOD)
    return np.tile(one.astype(numpy_dtype(dtype)), -(-count // PERIOD))[:count]


def send_count(op: str, world_size: int, count: int) -> int:
    """Elements a rank contributes (count: elements of the whole message)."""
    return count // world_size if op == "all_gather" else count


def send_buffer(op: str, rank: int, world_size: int, count: int, dtype: str) -> np.ndarray:
    """What ``rank`` contributes to the check."""
    return periodic(send_count(op, world_size, count), dtype, rank + 1)


def output_count(op: str, world_size: int, count: int) -> int | None:
    """Elements of the separate output buffer; None for the in-place ops."""
    return {"reduce_scatter": count // world_size, "all_gather": count, "all_to_all": count,
            "all_to_allv": count, "send_recv": count}.get(op)


def expected_output(op: str, rank: int, world_size: int, count: int, dtype: str) -> np.ndarray:
    n = world_size
    rank_sum = n * (n + 1) // 2  # sum over ranks q of (q + 1)
    if op == "all_reduce":
        return periodic(count, dtype, rank_sum, scale=n)
    if op == "reduce_scatter":
        m = count // n
        return periodic(m, dtype, rank_sum, scale=n, offset=rank * m)
    if op == "all_gather":
        return np.concatenate([periodic(count // n, dtype, q + 1) for q in range(n)])
    if op in ("all_to_all", "all_to_allv"):  # from rank q, the piece of q's buffer meant for rank
        pieces = []
        for q in range(n):
            sends = split_counts(op, q, n, count)[0]
            pieces.append(periodic(sends[rank], dtype, q + 1, offset=sum(sends[:rank])))
        return np.concatenate(pieces)
    if op == "send_recv":  # the previous rank's buffer
        return periodic(count, dtype, (rank - 1) % n + 1)
    return periodic(count, dtype, ROOT + 1)


class Backend(Protocol):
    """One implementation of the collectives, on one rank."""

    name: str

    def bind(self, op: str, send: np.ndarray, out_count: int | None
             ) -> tuple[Callable[[], None], Callable[[], np.ndarray]]:
        """Buffers for ``op`` holding ``send``, plus an output buffer of ``out_count`` elements
        unless the op is in place. Returns (one call of the op, the output as numpy)."""

    def barrier(self) -> None:
        ...

    def reduce(self, values: Sequence[float], how: str) -> list[float]:
        """Element-wise "max" or "sum" of ``values`` over ranks, outside any timed region."""


def time_collectives(calls: Sequence[Callable[[], None]], backends: Sequence[Backend],
                     timing: Timing) -> list[tuple[float, int]]:
    """Per backend, seconds per call (median over batches of the slowest rank) and calls per
    batch. Warm-up first, backend by backend; then batch b of every backend before batch b + 1
    of any, so that the backends' batches interleave in time."""
    ks = []
    for call, backend in zip(calls, backends):
        warm = []
        for _ in range(timing.warmup):
            start = time.perf_counter()
            call()
            warm.append(time.perf_counter() - start)
        # Every rank must issue the same number of calls: k comes from a value all ranks agree on.
        slowest = backend.reduce([statistics.median(warm)], "max")[0]
        if timing.iters:
            ks.append(timing.iters)
        else:
            ks.append(max(1, min(MAX_ITERS_PER_BATCH, int(timing.time_budget / (timing.batches * slowest)))))
    per_call: list[list[float]] = [[] for _ in backends]
    for _ in range(timing.batches):
        for call, backend, k, times in zip(calls, backends, ks, per_call):
            backend.barrier()
            start = time.perf_counter()
            for _ in range(k):
                call()
            times.append((time.perf_counter() - start) / k)
    return [(statistics.median(backend.reduce(times, "max")), k)
            for backend, k, times in zip(backends, ks, per_call)]


def count_wrong(op: str, count: int, dtype: str, backend: Backend, rank: int, world_size: int) -> int:
    """Elements differing from the exact expectation after one call on fresh buffers, all ranks."""
    call, output = backend.bind(op, send_buffer(op, rank, world_size, count, dtype),
                                output_count(op, world_size, count))
    call()
    wrong = np.count_nonzero(output() != expected_output(op, rank, world_size, count, dtype))
    return int(backend.reduce([float(wrong)], "sum")[0])


def record(impl: str, op: str, world_size: int, count: int, dtype: str, seconds: float,
           iters: int, wrong: int, size: int | None = None) -> dict:
    """One measurement. ``size``: the size asked for, which ``bytes`` (what was moved) may round
    down (to whole chunks per rank); the tables line ops up by it."""
    nbytes = count * ITEMSIZE[dtype]
    algbw = nbytes / seconds / 1e9
    return {"impl": impl, "op": op, "world_size": world_size, "size": nbytes if size is None else size,
            "bytes": nbytes, "count": count,
            "dtype": dtype, "time_us": _round(seconds * 1e6), "algbw_gbps": _round(algbw),
            "busbw_gbps": _round(algbw * bus_factor(op, world_size)), "wrong": wrong, "iters": iters}


def _round(x: float) -> float:
    return float(f"{x:.6g}")  # timing noise is far above 6 significant digits


def run_suite(backends: Sequence[Backend], ops: Sequence[str], sizes: Sequence[int], dtype: str, rank: int,
              world_size: int, timing: Timing, progress: Callable[[str, str, int], None],
              stop_at: float | None = None) -> list[dict]:
    """Measures every backend on every op it implements (its ``ops`` attribute, all of ``ops``
    when it has none) and size; ``progress(impl, op, bytes)`` precedes each (op, size) with the
    names of the backends measured there.

    The backends share each (op, size): their timed batches alternate (time_collectives), so a
    slow phase of the machine (another tenant, a frequency change) falls on all of them alike
    instead of on whichever ran during it, which keeps the side-by-side ratios meaningful on a
    noisy host.

    ``stop_at`` (a time.time()): once any rank is past it, every rank stops before the next
    measurement (the ranks agree through the first backend) and the records so far are returned,
    so that a run cut short by its deadline still reports what it measured."""
    records = []
    for op in ops:
        here = [b for b in backends if op in _ops_of(b, ops)]
        for nbytes in sizes:
            if stop_at is not None and here and here[0].reduce([float(time.time() > stop_at)], "max")[0]:
                return records
            count = message_count(op, nbytes, dtype, world_size)
            for backend in here:
                progress(backend.name, op, nbytes)
            if count == 0 or not here:
                continue
            # Timed calls run on zeros, which repeated in-place sums keep finite (anything else
            # overflows: inf, or signed-integer overflow in C++). np.full writes every page: an
            # untouched calloc'd input would be read from the one shared zero page, in cache.
            calls = [b.bind(op, np.full(send_count(op, world_size, count), 0, numpy_dtype(dtype)),
                            output_count(op, world_size, count))[0] for b in here]
            timed = time_collectives(calls, here, timing)
            del calls  # frees the timing buffers before the checks allocate their own
            for backend, (seconds, k) in zip(here, timed):
                wrong = count_wrong(op, count, dtype, backend, rank, world_size)
                records.append(record(backend.name, op, world_size, count, dtype, seconds, k, wrong, nbytes))
    return records


def planned(backends: Sequence[Backend], ops: Sequence[str], sizes: Sequence[int]) -> int:
    """How many measurements run_suite makes (for the progress bar)."""
    return len(sizes) * sum(len(_ops_of(b, ops)) for b in backends)


def _ops_of(backend: Backend, ops: Sequence[str]) -> list[str]:
    """The ops of ``ops`` that ``backend`` implements (its ``ops`` attribute; all without one)."""
    return [op for op in ops if op in getattr(backend, "ops", ops)]
