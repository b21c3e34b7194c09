"""The flight recorder (DESIGN section 15) on real communicators: what each call records, the
dumps every rank writes when one fails (a rank that stops issuing collectives, a size mismatch, a
killed rank), on one host and across simulated hosts, and what the analyzer makes of them.

Each scenario runs its ranks with BRAID_TRACE_DIR set to a fresh directory; the test process
then reads the dumps with braid.trace as a user would.
"""
import json
import os
import signal
import tempfile
import time

import pytest
import torch
from braid import comm, trace
from helpers import outcome
from helpers.ranks import RankFailure, environment, make_comm, run_ranks
from test_multihost import hosts_comm

SHORT_TIMEOUT_S = 4.0  # the stuck ranks' deadline (and their bootstrap's): far above scheduling noise
DUMP_WAIT_S = 10.0  # how long a test waits for every rank's dump to appear


def _comm(rank, n, store_path, layout, **kwargs):
    if layout is None:
        return make_comm(rank, n, store_path, **kwargs)
    return hosts_comm(rank, n, store_path, layout, tiny=False, **kwargs)


def _wait_for_dumps(directory, count, deadline_s=DUMP_WAIT_S):
    """The dump files in ``directory`` once there are ``count`` (or what is there at the deadline)."""
    end = time.monotonic() + deadline_s
    while True:
        names = os.listdir(directory) if os.path.isdir(directory) else []
        files = sorted(f for f in names if f.startswith("braid-trace-") and f.endswith(".json"))
        if len(files) >= count or time.monotonic() > end:
            return files
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------
# Rank functions.

def records_calls(rank, n, store_path):
    """A few calls of each kind; the recorder's view of them, and of a 3-call buffer."""
    with make_comm(rank, n, store_path) as c:
        t = torch.ones(1000)
        c.all_reduce(t)
        c.all_reduce(t, async_op=True).wait()
        out = torch.empty(1000 * n)
        c.all_gather(out, t)
        c.broadcast(t, src=1)
        c.reduce_scatter(torch.empty(10), torch.ones(10 * n))
        c.all_to_all(torch.empty(4 * n), torch.ones(4 * n),
                     output_split_sizes=[4] * n, input_split_sizes=[4] * n)
        if rank == 0:
            c.send(torch.ones(3, dtype=torch.float64), dst=1)
        elif rank == 1:
            c.recv(torch.empty(3, dtype=torch.float64), src=0)
        c.barrier()
        full = c.trace()
        c.all_reduce(torch.randn(4096), compression=comm.Int8Quantizer(), step=5)  # past its warm-up
        compressed = [e for e in c.trace()["entries"] if e["id"] > full["recorded"]]
    with make_comm(rank, n, store_path, trace_buffer=3) as c:
        for _ in range(5):
            c.all_reduce(torch.ones(8))
        c.trace_enabled = False  # paused: two calls leave no entry but advance the sequence
        paused = c.trace_enabled
        for _ in range(2):
            c.all_reduce(torch.ones(8))
        c.trace_enabled = True
        c.all_reduce(torch.ones(8))
        small = c.trace()
    with make_comm(rank, n, store_path, trace_buffer=0) as c:
        c.trace_enabled = True  # no ring: stays off
        c.all_reduce(torch.ones(8))
        off = c.trace()
        off_enabled = c.trace_enabled
    return {"full": full, "compressed": compressed, "small": small, "off": off, "paused": paused,
            "off_enabled": off_enabled}


def exchange_behind_queued_work(rank, n, store_path):
    """A blocking all_to_all with split sizes issued while an async all_reduce is still queued or
    running: it goes through the progress thread, its transfers with it. Entries of every call."""
    with make_comm(rank, n, store_path) as c:
        kinds = []
        for _ in range(5):
            w = c.all_reduce(torch.ones(1 << 20), async_op=True)  # 4 MiB: the next call queues behind
            c.all_to_all(torch.empty(4 * n), torch.ones(4 * n), output_split_sizes=[4] * n,
                         input_split_sizes=[4] * n)
            w.wait()
            kinds.append([e["kind"] for e in c.trace()["entries"]][-2:])
        return kinds


def one_rank_stops(rank, n, store_path, directory, layout, quiet):
    """Rank ``quiet`` stops issuing collectives after two (it sleeps, as a rank busy elsewhere
    would); the others time out on the third. Every rank should dump, the quiet one included."""
    with environment({"BRAID_TRACE_DIR": directory}):
        c = _comm(rank, n, store_path, layout, timeout=SHORT_TIMEOUT_S)
    t = torch.ones(256)
    c.all_reduce(t)
    c.barrier()
    if rank == quiet:
        end = time.monotonic() + DUMP_WAIT_S
        mine = f"rank{rank}.json"
        while time.monotonic() < end and not any(f.endswith(mine) for f in _wait_for_dumps(directory, 0)):
            time.sleep(0.05)  # busy elsewhere: its watcher thread must write the dump
        seen = {"type": None}
    else:
        seen = outcome(c.all_reduce, t)
    c.close()
    return seen


def sizes_differ(rank, n, store_path, directory, layout):
    """Rank 1 all-reduces 300 elements where the others reduce 256."""
    with environment({"BRAID_TRACE_DIR": directory}):
        c = _comm(rank, n, store_path, layout, timeout=10.0)
    c.all_reduce(torch.ones(4))
    seen = outcome(c.all_reduce, torch.ones(300 if rank == 1 else 256))
    c.close()
    return seen


def rank_killed(rank, n, store_path, directory, layout):
    """Rank 2 dies (no close) after one collective; the survivors' next one fails."""
    with environment({"BRAID_TRACE_DIR": directory}):
        c = _comm(rank, n, store_path, layout, timeout=10.0)
    c.all_reduce(torch.ones(64))
    if rank == 2:
        os._exit(3)
    seen = outcome(c.all_reduce, torch.ones(64))
    c.close()
    return seen


def dumps_on_request(rank, n, store_path, directory):
    """dump_trace() into a directory, the stack of each call with BRAID_TRACE_STACK=1, and a dump
    on the signal BRAID_TRACE_SIGNAL names."""
    from braid.comm import _C

    env = {"BRAID_TRACE_DIR": os.path.join(directory, "signal"), "BRAID_TRACE_SIGNAL": "USR2"}
    with environment(env):
        c = make_comm(rank, n, store_path)
    _C.set_trace_stack(True)
    try:
        c.all_reduce(torch.ones(16))
    finally:
        _C.set_trace_stack(False)
    path = c.dump_trace(os.path.join(directory, "asked"))
    os.kill(os.getpid(), signal.SIGUSR2)
    signalled = _wait_for_dumps(os.path.join(directory, "signal"), 1, 5.0) if rank == 0 else None
    c.barrier()  # rank 1 keeps its communicator until rank 0 has seen its own dump
    entries = c.trace()["entries"]
    c.close()
    return {"path": path, "stack": entries[0]["stack"], "signalled": signalled}


# ----------------------------------------------------------------------------------------------
# Tests.

def test_an_exchange_run_by_the_progress_thread_is_one_entry():
    """The transfers of an all_to_all with split sizes are part of its entry, run on the calling
    thread or queued behind other work (each used to leave a send and a recv entry of its own when
    queued, so that the trace depended on timing)."""
    for kinds in run_ranks(exchange_behind_queued_work, 2):
        assert kinds == [["all_reduce", "all_to_all_v"]] * 5, kinds


def test_the_recorder_keeps_each_call():
    """Kinds, sizes, op, root, peer, algorithm, bytes, states and times as the calls made them;
    sequence numbers equal on every rank; a small buffer keeps the last calls; paused, none is
    recorded; 0 keeps none."""
    results = run_ranks(records_calls, 2)
    for rank, r in enumerate(results):
        full = r["full"]
        assert full["format"] == "braid-trace" and full["rank"] == rank and full["world_size"] == 2
        kinds = [e["kind"] for e in full["entries"]]
        p2p = ["send"] if rank == 0 else ["recv"]
        assert kinds == ["all_reduce", "all_reduce", "all_gather", "broadcast", "reduce_scatter",
                         "all_to_all_v", *p2p, "barrier"], kinds
        e = full["entries"]
        assert all(x["state"] == "completed" for x in e), e
        assert [x["seq"] for x in e if x["seq"] is not None] == [1, 2, 3, 4, 5, 6, 7]
        assert e[0]["dtype"] == "float32" and e[0]["count"] == 1000 and e[0]["op"] == "sum"
        assert e[0]["algorithm"] in ("oneshot", "twoshot", "ring") and e[0]["bytes"]["shm"] == 4000
        assert e[3]["root"] == 1 and e[3]["op"] is None
        assert e[6]["peer"] == 1 - rank and e[6]["seq"] is None and e[6]["dtype"] == "float64"
        assert all(x["issued_us"] <= x["started_us"] <= x["completed_us"] for x in e), e
        assert e[0]["thread"] == e[1]["thread"]  # both issued by the caller's thread
        assert full["comm_id"] == results[0]["full"]["comm_id"]
        # A compressed all_reduce: one entry for the call (its wire ratio), and its collectives.
        whole, *steps = r["compressed"]
        assert whole["kind"] == "compressed_all_reduce" and whole["count"] == 4096, whole
        assert 0.2 < whole["wire_ratio"] < 0.3, whole  # int8 and a scale per block of 256
        assert whole["state"] == "completed" and whole["seq"] is None, whole
        assert steps and all(x["seq"] is not None and x["dtype"] == "uint8" for x in steps), steps
        small = r["small"]
        assert small["recorded"] == 6 and [x["id"] for x in small["entries"]] == [4, 5, 6]
        assert [x["seq"] for x in small["entries"]] == [4, 5, 8] and r["paused"] is False
        assert r["off"]["buffer"] == 0 and r["off"]["entries"] == [] and r["off_enabled"] is False


@pytest.mark.parametrize("layout,quiet", [(None, 1), ([0, 0, 1], 2)], ids=["one-host", "2+1-hosts"])
def test_a_rank_that_stops_is_named(layout, quiet):
    """Rank ``quiet`` stops issuing collectives: the others time out, and every rank dumps (the
    quiet rank's watcher writes its own while it is busy elsewhere: on one host from the shared
    memory's failure flags, alone on its host from the failure notice its acceptor takes); the
    analyzer names the quiet rank and the call it never issued."""
    with tempfile.TemporaryDirectory() as d:
        results = run_ranks(one_rank_stops, 3, d, layout, quiet)
        others = [r for i, r in enumerate(results) if i != quiet]
        assert all(r["type"] in ("CommTimeout", "PeerError") for r in others), results
        assert any(r["type"] == "CommTimeout" for r in others), results
        files = _wait_for_dumps(d, 3)
        assert len(files) == 3, files
        report = trace.analyze(trace.load(d))
        div = report["first_divergence"]
        assert div is not None and div["missing_ranks"] == [quiet], report
        assert div["kind"] == "all_reduce", div
        assert sorted(div["issued_by"]) == sorted(set(range(3)) - {quiet}), div
        assert report["missing_dumps"] == []
        assert f"rank {quiet}" in trace.render(report)


HOSTS = pytest.mark.parametrize("layout", [None, [0, 0, 1]], ids=["one-host", "2+1-hosts"])


@HOSTS
def test_a_size_mismatch_names_the_field(layout):
    """The field and every rank's value; the Chrome export of the same dumps has one slice per
    recorded call."""
    with tempfile.TemporaryDirectory() as d:
        results = run_ranks(sizes_differ, 3, d, layout)
        assert all(r["type"] == "CollectiveMismatch" for r in results), results
        assert len(_wait_for_dumps(d, 3)) == 3
        dumps = trace.load(d)
        div = trace.analyze(dumps)["first_divergence"]
        assert div["mismatch"]["field"] == "count", div
        assert {int(k): v for k, v in div["mismatch"]["values"].items()} == {0: 256, 1: 300, 2: 256}, div
        chrome = json.loads(json.dumps(trace.to_chrome(dumps)))
        slices = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
        assert len(slices) == sum(len(x.entries) for x in dumps), chrome
        assert {e["pid"] for e in slices} == {1, 2, 3}


@HOSTS
def test_a_killed_rank_leaves_no_dump_and_is_said(layout):
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(RankFailure, match="rank 2"):  # its process exited
            run_ranks(rank_killed, 3, d, layout)
        files = _wait_for_dumps(d, 2)
        assert len(files) == 2 and not any(f.endswith("rank2.json") for f in files), files
        report = trace.analyze(trace.load(d))
        assert report["missing_dumps"] == [2], report
        assert "rank 2" in trace.render(report)


def test_dumps_on_request_with_stacks_and_on_a_signal():
    with tempfile.TemporaryDirectory() as d:
        results = run_ranks(dumps_on_request, 2, d)
        for rank, r in enumerate(results):
            assert r["path"].endswith(f"rank{rank}.json") and os.path.exists(r["path"]), r
            assert "dumps_on_request" in r["stack"], r["stack"]
        assert results[0]["signalled"], results[0]
        asked = trace.load(os.path.join(d, "asked"))
        assert sorted(x.rank for x in asked) == [0, 1] and all(x.reason == "dump_trace" for x in asked)
