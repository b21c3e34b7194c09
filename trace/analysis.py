"""The analyzer: where the ranks of one communicator diverged, which ranks arrive late, what the calls cost.

Every result is a plain dict that ``json.dumps`` writes as it is (``python -m braid.trace analyze
--json`` prints it); maps keyed by rank use the rank as a string, as JSON does. docs/trace.md states
the rules."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Optional

from .dump import Dump, Entry, communicators

# The fields every rank must agree on for the same collective (the descriptor braid compares at
# every arrival). all_to_all_v's count is what this rank sends, which legitimately differs.
COMPARED_FIELDS = ("kind", "dtype", "count", "op", "root")
# Bytes per element of braid's dtypes (csrc/core/dtype.h); calls of another dtype get no bandwidth.
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint8": 1}
# Kinds whose recorded count is one rank's chunk (reduce_scatter: output elements, all_gather: input
# elements, all_to_all: elements per peer) while NCCL's convention sizes the call by its full buffer,
# world_size chunks.
CHUNK_COUNTED = ("reduce_scatter", "all_gather", "all_to_all")
DEFAULT_RECENT = 100
P2P_KINDS = ("send", "recv")


def bus_factor(kind: str, world_size: int) -> Optional[float]:
    """NCCL's bus-bandwidth factor (nccl-tests' PERFORMANCE.md): busbw = algbw * factor is the
    bandwidth each rank's link carries under a bandwidth-optimal algorithm, comparable across world
    sizes and with the hardware's peak. None for kinds that move no data (barrier) or unknown kinds."""
    n = world_size
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in CHUNK_COUNTED or kind == "all_to_all_v":
        return (n - 1) / n
    if kind == "broadcast" or kind in P2P_KINDS:
        return 1.0
    return None


def call_size(entry: Entry, world_size: int) -> Optional[int]:
    """S, the bytes that size a call for algbw = S / time (the full buffer, as in NCCL's tests), or
    None where the dtype is unknown or the kind has no bandwidth."""
    itemsize = ITEMSIZE.get(entry.dtype)
    if itemsize is None or bus_factor(entry.kind, world_size) is None:
        return None
    chunks = world_size if entry.kind in CHUNK_COUNTED else 1
    return entry.count * itemsize * chunks


def analyze(dumps: Sequence[Dump], recent: int = DEFAULT_RECENT,
            unreadable: Mapping[int, str] | None = None) -> dict:
    """Analyzes the dumps of one communicator (``communicators()`` splits a directory's dumps).

    Returns {"comm_id", "world_size", "hosts", "ranks" (those with a dump), "missing_dumps",
    "unreadable_dumps", "dumps" (per rank: reason, dump time, buffer, last call), "window" (what
    eviction left to compare), "first_divergence", "stuck", "slowest", "slowest_rank",
    "slowest_window", "stats"}. ``recent``: how many of the last collectives every rank recorded
    are used to find slow ranks. ``unreadable``: {rank: why} for ranks whose dump file exists but
    could not be read (``load``'s ``bad``); those of the missing ranks are in "unreadable_dumps"."""
    groups = communicators(dumps)
    if len(groups) != 1:
        raise ValueError(f"analyze() takes the dumps of one communicator, got {len(groups)}: "
                         f"{', '.join(groups) or 'none'}")
    if recent < 1:
        raise ValueError(f"recent must be >= 1, got {recent}")
    (comm_id, group), = groups.items()
    views = [_RankView(d) for d in group]
    world_size = group[0].world_size
    dumped = [v.rank for v in views]
    missing = [r for r in range(world_size) if r not in dumped]
    unreadable = unreadable or {}
    slowest, slowest_window = _slowest(views, recent)
    return {
        "comm_id": comm_id,
        "world_size": world_size,
        "hosts": list(group[0].hosts),
        "ranks": dumped,
        "missing_dumps": missing,
        "unreadable_dumps": {str(r): unreadable[r] for r in missing if r in unreadable},
        "dumps": [_dump_summary(v) for v in views],
        "window": _window(views),
        "first_divergence": _first_divergence(views),
        "stuck": _stuck(views),
        "slowest": slowest,
        "slowest_rank": slowest[0]["rank"] if slowest and slowest[0]["times_last"] > 0 else None,
        "slowest_window": slowest_window,
        "stats": _stats(group, world_size),
    }


class _RankView:
    """One rank's dump indexed by collective sequence number, with the seqs its buffer answers for."""

    def __init__(self, dump: Dump):
        self.dump = dump
        self.rank = dump.rank
        self.by_seq = {e.seq: e for e in dump.entries if e.seq is not None}
        # A rank's seqs count its collectives in order, so a buffer whose oldest seq is o also tells
        # that every seq below o was issued (and evicted), and that one from o on that it does not
        # hold was never issued (by the dump). Nothing evicted: the buffer answers for every seq
        # (from 0); evicted with no collective left (point-to-point calls filled the ring): for none.
        if not dump.evicted:
            self.covered_from: Optional[int] = 0
        else:
            self.covered_from = min(self.by_seq) if self.by_seq else None

    def covers(self, seq: int) -> bool:
        """Whether the buffer shows if this rank issued ``seq``."""
        return self.covered_from is not None and seq >= self.covered_from

    @property
    def last_seq(self) -> Optional[int]:
        return max(self.by_seq) if self.by_seq else None

    @property
    def queued_collectives(self) -> int:
        """Collectives issued but not started that carry no seq yet (a writer may number a
        collective only when it starts)."""
        return sum(e.seq is None and e.state == "issued" and e.kind not in P2P_KINDS
                   for e in self.dump.entries)

    @property
    def last_call(self) -> Optional[dict]:
        """The rank's last recorded call of any kind: what it was doing when it dumped."""
        return _call(self.dump.entries[-1], self.dump) if self.dump.entries else None


def _call(entry: Entry, dump: Dump) -> dict:
    """A call as the report shows it, its times relative to its own rank's dump (so that clocks of
    different hosts are never compared)."""
    return {
        "id": entry.id, "seq": entry.seq, "kind": entry.kind, "dtype": entry.dtype, "count": entry.count,
        "peer": entry.peer, "algorithm": entry.algorithm, "state": entry.state, "thread": entry.thread,
        "issued_before_dump_s": (dump.dumped_us - entry.issued_us) / 1e6,
        "finished_before_dump_s": (dump.dumped_us - entry.completed_us) / 1e6 if entry.finished else None,
        "error": entry.error, "stack": entry.stack,
    }


def _dump_summary(view: _RankView) -> dict:
    d = view.dump
    return {
        "rank": d.rank, "host": d.hosts[d.rank], "hostname": d.hostname, "pid": d.pid, "file": d.path,
        "reason": d.reason, "dumped_us": d.dumped_us, "braid_version": d.braid_version, "buffer": d.buffer,
        "recorded": d.recorded, "entries": len(d.entries), "evicted": d.evicted,
        "first_seq": min(view.by_seq) if view.by_seq else None, "last_seq": view.last_seq,
        "last_call": view.last_call,
    }


def _window(views: list) -> dict:
    """The seqs every dumped rank's buffer answers for: from the latest start of coverage on."""
    starts = [v.covered_from for v in views]
    seqs = [s for v in views for s in v.by_seq]
    return {
        "first_seq": None if None in starts or not seqs else max(max(starts), min(seqs)),
        "last_seq": max(seqs) if seqs else None,
        "limited_by_eviction": any(v.dump.evicted for v in views),
        "evicted_before": {str(v.rank): v.covered_from for v in views if v.dump.evicted},
    }


def _all_seqs(views: list) -> list:
    return sorted({s for v in views for s in v.by_seq})


def _holders(views: list, seq: int) -> dict:
    """{rank: its entry} for the ranks that recorded ``seq``, by rank."""
    return {v.rank: v.by_seq[seq] for v in views if seq in v.by_seq}


def _majority_kind(holders: dict) -> str:
    """The kind most ranks recorded (ties: the lowest rank's)."""
    return Counter(e.kind for e in holders.values()).most_common(1)[0][0]


def _mismatch(holders: dict) -> Optional[dict]:
    """The first field of COMPARED_FIELDS on which the ranks' entries differ, with every rank's value."""
    differ = []
    for field in COMPARED_FIELDS:
        if field == "count" and any(e.kind == "all_to_all_v" for e in holders.values()):
            continue
        if len({getattr(e, field) for e in holders.values()}) > 1:
            differ.append(field)
    if not differ:
        return None
    return {"field": differ[0], "values": {str(r): getattr(e, differ[0]) for r, e in holders.items()},
            "also_differ": differ[1:]}


def _errors(holders: dict) -> dict:
    return {str(r): e.error for r, e in holders.items() if e.error is not None}


def _first_divergence(views: list) -> Optional[dict]:
    """The smallest seq that some rank recorded and another, whose buffer answers for it, did not
    (missing ranks), or that ranks recorded with different kind, dtype, count, op or root."""
    for seq in _all_seqs(views):
        holders = _holders(views, seq)
        missing = [v for v in views if seq not in v.by_seq and v.covers(seq)]
        mismatch = _mismatch(holders)
        if not missing and mismatch is None:
            continue
        return {
            "seq": seq,
            "kind": _majority_kind(holders),
            "issued_by": list(holders),
            "missing_ranks": [v.rank for v in missing],
            "missing": [{"rank": v.rank, "last_seq": v.last_seq, "last_call": v.last_call,
                         "queued_collectives": v.queued_collectives} for v in missing],
            "evicted_ranks": [v.rank for v in views if seq not in v.by_seq and not v.covers(seq)],
            "mismatch": mismatch,
            "states": {str(r): e.state for r, e in holders.items()},
            "errors": _errors(holders),
        }
    return None


def _stuck(views: list) -> Optional[dict]:
    """The smallest seq that some rank recorded and did not complete: the collective the ranks are
    stuck in (issued or started), or that failed, and which ranks finished it."""
    dumped_us = {v.rank: v.dump.dumped_us for v in views}
    for seq in _all_seqs(views):
        holders = _holders(views, seq)
        if all(e.state == "completed" for e in holders.values()):
            continue
        return {
            "seq": seq,
            "kind": _majority_kind(holders),
            "states": {str(r): e.state for r, e in holders.items()},
            "completed_by": [r for r, e in holders.items() if e.state == "completed"],
            "waiting": [r for r, e in holders.items() if not e.finished],
            "failed": [r for r, e in holders.items() if e.state == "failed"],
            "waiting_s": {str(r): (dumped_us[r] - e.issued_us) / 1e6
                          for r, e in holders.items() if not e.finished},
            "errors": _errors(holders),
        }
    return None


def _slowest(views: list, recent: int) -> tuple:
    """Per rank, how often it was the last to issue one of the last ``recent`` collectives every
    rank recorded, and how late it was: lateness = its issued_us - the earliest rank's issued_us."""
    if len(views) < 2:
        return [], None
    common = sorted(set.intersection(*(set(v.by_seq) for v in views)))[-recent:]
    if not common:
        return [], None
    times_last = Counter()
    lateness: dict = {v.rank: [] for v in views}
    for seq in common:
        issued = {v.rank: v.by_seq[seq].issued_us for v in views}
        first, last = min(issued.values()), max(issued.values())
        for rank, t in issued.items():
            lateness[rank].append(t - first)
            if t == last and last > first:
                times_last[rank] += 1
    rows = [{"rank": r, "times_last": times_last[r], "mean_lateness_us": sum(late) / len(late),
             "max_lateness_us": max(late)} for r, late in lateness.items()]
    rows.sort(key=lambda row: (-row["times_last"], -row["mean_lateness_us"], row["rank"]))
    hosts = views[0].dump.hosts
    window = {"collectives": len(common), "first_seq": common[0], "last_seq": common[-1],
              "across_hosts": len({hosts[v.rank] for v in views}) > 1}
    return rows, window


def _stats(group: list, world_size: int) -> list:
    """Per kind and algorithm over every rank's entries: calls, bytes sent, time of the completed
    calls, and their bandwidth (sum of sizes / sum of times; bus bandwidth by NCCL's factors)."""
    rows: dict = {}
    for dump in group:
        for e in dump.entries:
            key = (e.kind, e.algorithm or "")
            rows.setdefault(key, _KindStats(e.kind, e.algorithm, world_size)).add(e)
    return [rows[key].result() for key in sorted(rows)]


class _KindStats:
    """Running totals of one row of the statistics: the calls of one kind and algorithm."""

    def __init__(self, kind: str, algorithm: Optional[str], world_size: int):
        self.kind, self.algorithm, self.world_size = kind, algorithm, world_size
        self.calls = self.completed = self.failed = self.bytes = 0
        self.times: list = []      # microseconds of each completed call
        self.sized_bytes = 0       # S of the completed calls whose size is known...
        self.sized_us = 0          # ...and their time
        self.ratios: list = []

    def add(self, e: Entry) -> None:
        self.calls += 1
        self.bytes += e.total_bytes
        self.failed += e.state == "failed"
        if e.wire_ratio is not None:
            self.ratios.append(e.wire_ratio)
        if e.state != "completed":
            return
        self.completed += 1
        t = e.completed_us - (e.started_us if e.started_us is not None else e.issued_us)
        if t < 0:  # the wall clock stepped back during the call: no usable time
            return
        self.times.append(t)
        size = call_size(e, self.world_size)
        if size is not None:
            self.sized_bytes += size
            self.sized_us += t

    def result(self) -> dict:
        t = self.times
        algbw = self.sized_bytes / self.sized_us / 1e3 if self.sized_us > 0 else None  # bytes/us / 1e3 = GB/s
        return {
            "kind": self.kind, "algorithm": self.algorithm, "calls": self.calls, "completed": self.completed,
            "failed": self.failed, "bytes": self.bytes,
            "time_us": {"total": sum(t), "mean": sum(t) / len(t), "max": max(t)} if t else None,
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * bus_factor(self.kind, self.world_size) if algbw is not None else None,
            "wire_ratio_mean": sum(self.ratios) / len(self.ratios) if self.ratios else None,
        }
