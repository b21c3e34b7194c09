"""Export of dumps as a Chrome trace (chrome://tracing, ui.perfetto.dev): a slice per recorded call."""
from __future__ import annotations

from collections.abc import Sequence

from .dump import Dump, Entry, communicators


def to_chrome(dumps: Sequence[Dump]) -> dict:
    """The dumps as a Chrome trace-event document (the JSON object format).

    One process per rank (named "rank R (host H: hostname)", with the communicator's id when the
    dumps hold several), one track per thread that issued calls, and each call a complete event
    ("ph": "X") from its issue to its completion or failure, with its fields as arguments. A call
    not finished at the dump is drawn up to the dump, its state in its name ("all_reduce (started)").
    Calls of one thread that overlap (async calls) go on extra tracks of that thread, since a
    track's slices must nest. Times are microseconds from the earliest time in the dumps
    (``otherData.time_origin_us``, wall clock), so ranks line up as far as their clocks agree."""
    if not dumps:
        raise ValueError("to_chrome() needs at least one dump")
    groups = communicators(dumps)
    origin = min([e.issued_us for d in dumps for e in d.entries] + [d.dumped_us for d in dumps])
    events: list = []
    pid = 0
    for comm_id, group in groups.items():
        for dump in group:
            pid += 1  # pid 0 is the idle process to some viewers: start at 1
            name = f"rank {dump.rank} (host {dump.hosts[dump.rank]}: {dump.hostname})"
            if len(groups) > 1:
                name += f" comm {comm_id}"
            events.append(_metadata("process_name", pid, 0, {"name": name}))
            events.append(_metadata("process_sort_index", pid, 0, {"sort_index": pid}))
            events.extend(_rank_events(dump, pid, origin))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "braid.trace", "comm_ids": list(groups), "time_origin_us": origin},
    }


def _metadata(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def _rank_events(dump: Dump, pid: int, origin: int) -> list:
    """One rank's tracks and slices, and an instant event at its dump saying why it dumped."""
    events = [{"ph": "i", "s": "p", "name": f"dump: {dump.reason}", "cat": "braid", "pid": pid, "tid": 0,
               "ts": dump.dumped_us - origin}]
    # Track assignment: per thread, lanes of non-overlapping calls; a call goes on the first lane
    # free at its start. tids are small numbers per rank (OS thread ids need not be numbers).
    lanes: dict = {}     # thread -> [end time of each lane's last call]
    tids: dict = {}      # (thread, lane) -> tid
    for e in sorted(dump.entries, key=lambda e: (e.issued_us, e.id)):
        start, end = e.issued_us, max(_end(e, dump), e.issued_us)
        ends = lanes.setdefault(e.thread, [])
        lane = next((i for i, lane_end in enumerate(ends) if lane_end <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
            tid = tids[(e.thread, lane)] = len(tids) + 1
            label = f"thread {e.thread}" + (f" (overlapping calls {lane + 1})" if lane else "")
            events.append(_metadata("thread_name", pid, tid, {"name": label}))
            events.append(_metadata("thread_sort_index", pid, tid, {"sort_index": tid}))
        ends[lane] = end
        events.append({
            "ph": "X", "cat": "braid", "name": e.kind if e.state == "completed" else f"{e.kind} ({e.state})",
            "pid": pid, "tid": tids[(e.thread, lane)], "ts": start - origin, "dur": end - start,
            "args": _args(e),
        })
    return events


def _end(e: Entry, dump: Dump) -> int:
    """Where a call's slice ends: its completion or failure, else the dump."""
    return e.completed_us if e.completed_us is not None else dump.dumped_us


def _args(e: Entry) -> dict:
    args = {"id": e.id, "seq": e.seq, "kind": e.kind, "dtype": e.dtype, "count": e.count, "op": e.op,
            "root": e.root, "peer": e.peer, "algorithm": e.algorithm, "bytes": e.bytes,
            "wire_ratio": e.wire_ratio, "state": e.state, "error": e.error, "thread": e.thread,
            "queued_us": e.started_us - e.issued_us if e.started_us is not None else None}
    if e.stack:
        args["stack"] = e.stack
    return args
