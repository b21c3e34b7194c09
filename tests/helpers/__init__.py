"""Pure-torch references for braid's reductions, seeded inputs, exact comparison, segment lookup.

Every collective test regenerates every rank's input from (seed, rank) and compares braid's result
with a reference computed here in the order braid promises (rank 0, 1, ..., n-1, half types
accumulated in float32 and rounded once). Comparisons are bitwise: the promise is exactness.
"""
from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Iterable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
OPS = ("sum", "avg", "max", "min", "prod")
BITWISE_OPS = ("band", "bor", "bxor")  # integer dtypes only

_BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def make_input(seed: int, rank: int, count: int, dtype: torch.dtype, *,
               integral: bool = False) -> torch.Tensor:
    """Rank ``rank``'s input of one case, reproducible on every rank.

    Floats are normal samples (sums round, so the order matters) unless ``integral``; integers
    and integral floats lie in [-8, 8]: integer products over 4 ranks cannot overflow, and sums
    are exact in every dtype in any order (for comparisons with another order, such as gloo's).
    """
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point and not integral:
        return (torch.randn(count, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-8, 9, (count,), generator=g, dtype=torch.int64).to(dtype)


def outcome(fn, *args, **kwargs) -> dict:
    """Runs a call that a test expects to raise (or not) and reports what happened, for a rank to
    send back: the exception's type name and message (type None: it returned), the seconds it
    took, and the monotonic time it ended. Any exception counts, KeyboardInterrupt included."""
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
        kind, message = None, "returned normally"
    except BaseException as e:  # noqa: BLE001 - the test judges the type
        kind, message = type(e).__name__, str(e)
    end = time.monotonic()
    return {"type": kind, "message": message, "elapsed": end - start, "at": end}


def ops_for(dtype: torch.dtype) -> tuple:
    """The reduce ops braid offers for ``dtype``: the bitwise ones on integers only."""
    return OPS if dtype.is_floating_point else OPS + BITWISE_OPS


def reduce_reference(inputs: Sequence[torch.Tensor], op: str, world_size: int) -> torch.Tensor:
    """``inputs[0] (op) inputs[1] (op) ...`` left to right, as braid promises; half types in float32
    rounded once at the end; avg divides the sum by ``world_size`` (truncating for integers)."""
    dtype = inputs[0].dtype
    acc_dtype = torch.float32 if dtype in HALF_DTYPES else dtype
    combine = {"sum": torch.add, "avg": torch.add, "prod": torch.mul,
               "max": torch.maximum, "min": torch.minimum, "band": torch.bitwise_and,
               "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    acc = inputs[0].to(acc_dtype)
    for x in inputs[1:]:
        acc = combine(acc, x.to(acc_dtype))
    if op == "avg":
        if dtype.is_floating_point:
            acc = acc / world_size
        else:
            acc = torch.div(acc, world_size, rounding_mode="trunc")
    return acc.to(dtype)


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal dtype, shape and bits; NaN equals NaN whatever its payload (NaN bits are no promise)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    a, e = actual.contiguous(), expected.contiguous()
    if not a.dtype.is_floating_point:
        return bool(torch.equal(a, e))
    if torch.equal(a.view(_BITS[a.dtype]), e.view(_BITS[e.dtype])):
        return True
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        return False
    keep = ~nan_a
    return bool(torch.equal(a.view(_BITS[a.dtype])[keep], e.view(_BITS[e.dtype])[keep]))


def mismatch_summary(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Short description of where two tensors differ, for assertion messages."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"dtype/shape {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    a, e = actual.flatten(), expected.flatten()
    wrong = [i for i in range(a.numel()) if not same_bits(a[i:i + 1], e[i:i + 1])]
    head = ", ".join(f"[{i}] {a[i].item()!r} != {e[i].item()!r}" for i in wrong[:5])
    return f"{len(wrong)} of {a.numel()} elements differ: {head}"


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """Hash of the raw bytes of ``tensors``: ranks return it so the test process can check that
    every rank holds the same bits without shipping the tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(t.dtype).encode())
        dense = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # stride 1 even for 1 element
        h.update(dense.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# braid's SegmentHeader (csrc/core/transport/shm/group.cc) starts with u64 magic, u64 total_bytes,
# u64 oneshot_bytes, u64 slot_bytes, u32 nslots, i32 rank, i32 world_size, i32 pid.
_HEADER = struct.Struct("<QQQQIiii")
_MAGIC = 0x6272616964736D35  # "braidsm5"


def braid_segments(pids: Iterable[int]) -> list[str]:
    """Names of /dev/shm/braid-* segments still present that were created by one of ``pids``.

    Looking up the creator keeps the check exact while other braid processes run on the machine.
    """
    pids = set(pids)
    found = []
    for name in os.listdir("/dev/shm"):
        if not name.startswith("braid-"):
            continue
        try:
            with open(os.path.join("/dev/shm", name), "rb") as f:
                raw = f.read(_HEADER.size)
        except (FileNotFoundError, PermissionError):
            continue  # unlinked meanwhile, or another user's
        if len(raw) < _HEADER.size:
            continue  # being created: ftruncate not done yet
        magic, *_, pid = _HEADER.unpack(raw)
        if magic == 0:
            continue  # being created: header not written yet
        assert magic == _MAGIC, f"/dev/shm/{name}: unknown header layout (update tests/helpers)"
        if pid in pids:
            found.append(name)
    return found


class CaseLog:
    """What one rank checked: the number of cases, the failures, a digest of every result.

    A rank function returns ``log.summary()``; ``assert_ranks_agree`` then checks on the test
    side that nothing failed and that every rank produced the same bits.
    """

    def __init__(self) -> None:
        self.cases = 0
        self.failures: list[str] = []
        self._hash = hashlib.sha256()

    def check(self, what: str, actual: torch.Tensor, expected: torch.Tensor, *,
              rank_specific: bool = False) -> None:
        """Bitwise comparison with the reference. Results that legitimately differ between ranks
        (a reduce_scatter's slice) stay out of the cross-rank digest."""
        self.cases += 1
        if not rank_specific:
            self._hash.update(digest([actual]).encode())
        if not same_bits(actual, expected):
            self.failures.append(f"{what}: {mismatch_summary(actual, expected)}")

    def expect(self, what: str, ok: bool, detail: str = "") -> None:
        """A non-tensor check (a property, an identity)."""
        self.cases += 1
        if not ok:
            self.failures.append(f"{what}: {detail}" if detail else what)

    def summary(self) -> dict:
        return {"cases": self.cases, "failures": self.failures, "digest": self._hash.hexdigest()}


def assert_ranks_agree(summaries: Sequence[dict], min_cases: int = 1) -> None:
    """Every rank ran the same non-trivial number of cases, none failed, all hold the same bits."""
    failures = [f"rank {r}: {f}" for r, s in enumerate(summaries) for f in s["failures"]]
    assert not failures, f"{len(failures)} failed checks, first ones:\n" + "\n".join(failures[:20])
    cases = [s["cases"] for s in summaries]
    assert len(set(cases)) == 1 and cases[0] >= min_cases, f"cases per rank: {cases}"
    digests = [s["digest"] for s in summaries]
    assert len(set(digests)) == 1, f"ranks hold different result bits: {digests}"


class MatmulRecorder(TorchDispatchMode):
    """Appends ``entry`` to ``log`` for every matrix product torch runs inside the ``with`` block
    (the autograd engine runs backward on this thread, so its products count): tests interleave
    it with a communicator's events to check what overlaps what."""

    def __init__(self, log: list, entry: object = "mm"):
        super().__init__()
        self.log, self.entry = log, entry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "bmm", "addmm"):
            self.log.append(self.entry)
        return func(*args, **(kwargs or {}))


class SmallMLP(torch.nn.Module):
    """12 -> 24 -> 6 with a GELU: the model of the training tests on the c10d backend."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(12, 24)
        self.down = torch.nn.Linear(24, 6)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))
