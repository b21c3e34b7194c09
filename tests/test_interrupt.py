"""Ctrl-C (SIGINT) and other Python signal handlers during a collective that waits for an absent
peer. Python runs handlers only on its main thread; braid's waits run them every few tens of
milliseconds, so KeyboardInterrupt ends a blocking call in well under a second instead of at the
deadline. An interrupted collective is abandoned half way: the communicator is poisoned and the
peers are told (PeerError). Waiting for an async work only stops the wait: the work goes on.
A handler that does not raise changes nothing.
"""
import os
import signal
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from helpers import outcome
from helpers.ranks import make_comm, open_store, process_group, run_ranks

# Far below the deadline (LONG_TIMEOUT_S) and far above the 50 ms polling plus scheduling noise.
INTERRUPT_LIMIT_S = 1.5
LONG_TIMEOUT_S = 60.0
SIGNAL_AFTER_S = 0.3


@contextmanager
def _signal_soon(signum=signal.SIGINT, handler=signal.default_int_handler):
    """Installs `handler` for `signum` and sends the signal to this process SIGNAL_AFTER_S later
    (from another thread, as a terminal's Ctrl-C arrives asynchronously)."""
    old = signal.signal(signum, handler)
    timer = threading.Timer(SIGNAL_AFTER_S, os.kill, (os.getpid(), signum))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signum, old)


# ----------------------------------------------------------------------------------------------
# Rank functions. Rank 1 holds back until rank 0 says so through the store.

def blocking_call_interrupted(rank, n, store_path, size):
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S)
    store = open_store(store_path)
    c.all_reduce(torch.ones(8))
    if rank == 0:
        with _signal_soon():
            seen = outcome(c.all_reduce, torch.ones(size))
        store.set("interrupted", "1")
        after = outcome(c.all_reduce, torch.ones(8))
    else:
        store.wait(["interrupted"])
        seen = outcome(c.all_reduce, torch.ones(size))
        after = None
    c.close()
    return {"seen": seen, "after": after}


def work_wait_interrupted(rank, n, store_path):
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S)
    store = open_store(store_path)
    t = torch.full((300_000,), float(rank + 1))
    if rank == 0:
        work = c.all_reduce(t, async_op=True)
        with _signal_soon():
            seen = outcome(work.wait)
        store.set("interrupted", "1")
        work.wait()  # the work itself went on
    else:
        store.wait(["interrupted"])
        seen = None
        c.all_reduce(t)
    exact = torch.equal(t, torch.full((300_000,), 3.0))
    again = torch.ones(1000)
    c.all_reduce(again)
    c.close()
    return {"seen": seen, "exact": exact and torch.equal(again, torch.full((1000,), 2.0))}


def queued_blocking_call_interrupted(rank, n, store_path):
    """A blocking call behind an async one: the caller's tensor is in the queued request, so the
    call returns only once the executing thread has abandoned it."""
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S)
    store = open_store(store_path)
    if rank == 0:
        first = c.all_reduce(torch.ones(1000), async_op=True)
        with _signal_soon():
            seen = outcome(c.all_reduce, torch.ones(300_000))
        store.set("interrupted", "1")
        first_outcome = outcome(first.wait)
        after = outcome(c.barrier)
    else:
        store.wait(["interrupted"])
        seen = outcome(c.all_reduce, torch.ones(1000))
        first_outcome = after = None
    c.close()
    return {"seen": seen, "first": first_outcome, "after": after}


def quiet_handler_changes_nothing(rank, n, store_path):
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S)
    store = open_store(store_path)
    calls = []
    t = torch.full((300_000,), float(rank + 1))
    if rank == 0:
        def handler(signum, frame):
            calls.append(signum)
            store.set("handled", "1")  # releases rank 1 only after the handler ran

        with _signal_soon(signal.SIGUSR1, handler):
            seen = outcome(c.all_reduce, t)
    else:
        store.wait(["handled"])
        # Arrive once rank 0's handler has likely returned into its wait (nothing observable marks
        # that; arriving earlier must give the same outcome, so no correctness rests on it).
        time.sleep(0.2)
        seen = outcome(c.all_reduce, t)
    exact = torch.equal(t, torch.full((300_000,), 3.0))
    c.close()
    return {"seen": seen, "handled": len(calls), "exact": exact}


def handler_calls_back_in(rank, n, store_path):
    """A handler that runs while its thread waits inside a collective and calls the same
    communicator: blocking calls and close() raise (they would wait for the collective they
    interrupted, which waits for them), an async call is queued behind it, and the collective
    itself completes normally once the peer arrives."""
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S)
    store = open_store(store_path)
    t = torch.full((300_000,), float(rank + 1))
    seen = {}
    if rank == 0:
        later = []

        def handler(signum, frame):
            seen["barrier"] = outcome(c.barrier)
            seen["close"] = outcome(c.close)
            later.append(c.all_reduce(torch.ones(4), async_op=True))
            store.set("handled", "1")

        with _signal_soon(signal.SIGUSR1, handler):
            seen["outer"] = outcome(c.all_reduce, t)
        later[0].wait()
    else:
        store.wait(["handled"])
        time.sleep(0.2)  # as in quiet_handler_changes_nothing: aims at the handler's return
        seen["outer"] = outcome(c.all_reduce, t)
        c.all_reduce(torch.ones(4))  # rank 0's async one from the handler
    seen["exact"] = torch.equal(t, torch.full((300_000,), 3.0))
    c.close()
    seen["closed"] = c.closed
    return seen


def backend_call_interrupted(rank, n, store_path):
    with process_group(rank, n, store_path, backend="braid"):
        store = open_store(store_path)
        dist.all_reduce(torch.ones(8))
        if rank == 0:
            with _signal_soon():
                seen = outcome(dist.all_reduce, torch.ones(1000))
            store.set("interrupted", "1")
        else:
            store.wait(["interrupted"])
            seen = outcome(dist.all_reduce, torch.ones(1000))
        return seen


# ----------------------------------------------------------------------------------------------
# Tests.

def _interrupted(seen: dict) -> None:
    assert seen["type"] == "KeyboardInterrupt", seen
    assert seen["elapsed"] < SIGNAL_AFTER_S + INTERRUPT_LIMIT_S, seen


def _told(seen: dict) -> None:
    assert seen["type"] == "PeerError", seen
    assert "rank 0 was interrupted by a signal" in seen["message"], seen
    assert seen["elapsed"] < INTERRUPT_LIMIT_S, seen


def test_ctrl_c_ends_a_blocking_collective_and_tells_the_peers():
    for size in (1000, 300_000):  # one-shot and pipelined
        r0, r1 = run_ranks(blocking_call_interrupted, 2, size)
        _interrupted(r0["seen"])
        assert r0["after"]["type"] == "CommError", r0
        assert "unusable after an earlier error" in r0["after"]["message"], r0
        _told(r1["seen"])


def test_ctrl_c_stops_waiting_for_an_async_work_which_goes_on():
    r0, r1 = run_ranks(work_wait_interrupted, 2)
    _interrupted(r0["seen"])
    assert r0["exact"] and r1["exact"], (r0, r1)


def test_ctrl_c_ends_a_blocking_call_queued_behind_async_work():
    r0, r1 = run_ranks(queued_blocking_call_interrupted, 2)
    _interrupted(r0["seen"])
    # The async work ahead of it was what waited for rank 1: it was abandoned with it.
    assert r0["first"]["type"] == "CommError", r0
    assert "was interrupted by a signal" in r0["first"]["message"], r0
    assert "unusable after an earlier error" in r0["after"]["message"], r0
    _told(r1["seen"])


def test_a_signal_handler_that_does_not_raise_changes_nothing():
    r0, r1 = run_ranks(quiet_handler_changes_nothing, 2)
    assert r0["handled"] == 1, r0
    for r in (r0, r1):
        assert r["seen"]["type"] is None, r
        assert r["exact"], r


def test_a_handler_that_calls_the_communicator_it_interrupted_gets_an_error_not_a_hang():
    r0, r1 = run_ranks(handler_calls_back_in, 2)
    for call in ("barrier", "close"):
        assert r0[call]["type"] == "CommError" and "re-entrant call" in r0[call]["message"], (call, r0)
    for r in (r0, r1):
        assert r["outer"]["type"] is None and r["exact"] and r["closed"], r


def test_ctrl_c_ends_a_blocking_call_of_the_braid_backend():
    r0, r1 = run_ranks(backend_call_interrupted, 2)
    _interrupted(r0)
    _told(r1)
