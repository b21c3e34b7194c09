"""A process forked from a rank (a data-loader worker, a helper that forks and exits normally)
shares the rank's memory but not its threads. Whatever the child does with the communicator it
inherited, the parent and its peers must go on as if the child did not exist: the child's calls
raise at once instead of acting as the parent's rank, and its exit (which closes the communicator
through the interpreter's exit hooks) neither announces a departure to the peers, nor unlinks
shared memory, nor hangs joining a progress thread that exists only in the parent.
"""
import atexit
import gc
import json
import os
import select
import signal
import time

import pytest
import torch
import torch.distributed as dist
from braid import comm
from helpers import outcome
from helpers.ranks import make_comm, open_store, process_group, run_ranks

# A forked child reports within this (its calls raise without communicating; its exit hooks
# must not block). Far above the few milliseconds they take, far below the test deadline.
CHILD_LIMIT_S = 10.0
SIZES = (1, 1000, 300_000)  # one-shot and two-shot paths


def _in_child(body) -> dict:
    """Forks; the child runs ``body()`` (a dict of findings), then exits the way an interpreter
    does (exit hooks, which close every communicator still open, then the garbage collector) and
    reports. Returns the child's report, or says that it hung or died."""
    # Garbage left by earlier work in this process (a DDP model in a reference cycle, whose gloo
    # group would join threads that a child does not have) is collected here, not in the child:
    # the child's own collection below must only meet what the child made or braid holds.
    gc.collect()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller
        os.close(r)
        report = {}
        try:
            report = body()
            start = time.monotonic()
            atexit._run_exitfuncs()
            gc.collect()
            report["exit_hooks_s"] = time.monotonic() - start
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            report["error"] = f"{type(e).__name__}: {e}"
        os.write(w, json.dumps(report).encode())
        os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], CHILD_LIMIT_S)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return {"error": f"child hung for {CHILD_LIMIT_S} s"}
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    report = json.loads(data) if data else {"error": f"child died (status {status})"}
    return report


def _exact_rounds(c, rank, n, rounds=4) -> bool:
    """Collectives of every size on both paths, checked against their exact results."""
    for i in range(rounds):
        for size in SIZES:
            t = torch.full((size,), float(rank + 1 + i))
            c.all_reduce(t)
            if not torch.equal(t, torch.full((size,), float(n * (n + 1) // 2 + n * i))):
                return False
            out = torch.empty(size * n)
            c.all_gather(out, torch.full((size,), float(rank)))
            if not torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(size)):
                return False
    return True


# ----------------------------------------------------------------------------------------------
# Rank functions.

def child_exits(rank, n, store_path):
    """Rank 0 forks a child that does nothing with the communicator and exits normally."""
    c = make_comm(rank, n, store_path)
    assert _exact_rounds(c, rank, n, rounds=1)
    report = _in_child(lambda: {}) if rank == 0 else None
    ok = _exact_rounds(c, rank, n)
    c.close()
    return {"child": report, "exact_after": ok}


def child_uses(rank, n, store_path):
    """Rank 0 forks while an async all-reduce of its own is still waiting for rank 1; the child
    tries every kind of call and waits for the inherited work."""
    c = make_comm(rank, n, store_path, slot_bytes=4096, nslots=2)
    big = torch.full((200_000,), float(rank + 1))
    if rank == 0:
        work = c.all_reduce(big, async_op=True)  # rank 1 joins after the fork: still in flight

        def body():
            t = torch.ones(8)
            return {"pending_at_fork": not work.is_completed(),
                    "all_reduce": outcome(c.all_reduce, t),
                    "async": outcome(c.all_reduce, t, async_op=True),
                    "compressed": outcome(c.all_reduce, torch.ones(4096),
                                           compression=comm.Int8Quantizer(warmup_steps=2)),
                    "broadcast": outcome(c.broadcast, t),
                    "barrier": outcome(c.barrier),
                    "wait": outcome(work.wait),
                    "future": outcome(work.get_future),  # once a future nothing would complete
                    "close": outcome(c.close)}

        report = _in_child(body)
        store = open_store(store_path)
        store.set("forked", "1")
        work.wait()
    else:
        open_store(store_path).wait(["forked"])
        report = None
        c.all_reduce(big)
    first = torch.equal(big, torch.full((200_000,), float(n * (n + 1) // 2)))
    ok = _exact_rounds(c, rank, n)
    c.close()
    return {"child": report, "exact_after": first and ok}


def backend_child(rank, n, store_path):
    """The same through torch.distributed with braid as the backend."""
    with process_group(rank, n, store_path, backend="braid"):
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t)
        report = None
        if rank == 0:
            report = _in_child(lambda: {"all_reduce": outcome(dist.all_reduce, torch.ones(4)),
                                        "barrier": outcome(dist.barrier)})
        ok = True
        for size in SIZES:
            x = torch.full((size,), float(rank + 1))
            dist.all_reduce(x)
            ok = ok and torch.equal(x, torch.full((size,), float(n * (n + 1) // 2)))
        return {"child": report, "exact_after": ok}


# ----------------------------------------------------------------------------------------------
# Tests.

def _child_ok(report: dict) -> None:
    assert "error" not in report, report
    assert report["exit_hooks_s"] < CHILD_LIMIT_S, report


def _parents_exact(results: list) -> None:
    """Every rank's collectives after the fork gave their exact results."""
    for r, result in enumerate(results):
        assert result["exact_after"], (r, result)


@pytest.mark.parametrize("n", [2, 3])
def test_forked_child_exit_leaves_the_group_untouched(n):
    results = run_ranks(child_exits, n)
    _child_ok(results[0]["child"])
    _parents_exact(results)


def test_forked_child_cannot_act_as_its_parents_rank():
    results = run_ranks(child_uses, 2)
    report = results[0]["child"]
    _child_ok(report)
    assert report.pop("pending_at_fork"), "the inherited work should still have been in flight"
    assert report.pop("close")["type"] is None, "close() in the child returns normally"
    report.pop("exit_hooks_s")
    for call, seen in report.items():
        assert seen["type"] == "CommClosed", (call, seen)
        assert "forked" in seen["message"], (call, seen)
    _parents_exact(results)


def test_forked_child_of_a_braid_backend_rank():
    results = run_ranks(backend_child, 2)
    report = results[0]["child"]
    _child_ok(report)
    for call in ("all_reduce", "barrier"):
        assert report[call]["type"] is not None, (call, report)
        assert "forked" in report[call]["message"], (call, report)
    _parents_exact(results)
