"""Failure handling (DESIGN section 5): dead peers, mismatched collectives, deadlines, poisoning and
shared-memory leaks. Ranks that die or get killed run in fresh processes; the rest use the pool.

Each failing rank reports what it saw (exception type, message, seconds until it was raised) and
the test process checks it, so a rank that hangs or succeeds shows up as a failure, not a hang.
"""
import os
import time
from datetime import timedelta

import pytest
import torch
from braid import comm
from helpers import braid_segments, make_input, outcome
from helpers.ranks import FreshRanks, make_comm, new_store_path, open_store, run_ranks

# Tiny slots: the messages below take the pipelined paths with several rounds.
TINY = {"slot_bytes": 1024, "oneshot_max_bytes": 256, "nslots": 2}
# A dead or departed peer must be noticed "within about a second", long before any deadline.
DETECTION_LIMIT_S = 2.0
# Deadline for tests where the error must come from something else than the deadline.
LONG_TIMEOUT_S = 30.0
# Deadline for tests that wait for it to pass: short, yet far above scheduling noise on 2 cores.
SHORT_TIMEOUT_S = 1.0


def _poisoned(c) -> dict:
    """After an error every call must fail at once: a sync call, an async call, a barrier."""
    t = torch.ones(4)
    return {"sync": outcome(c.all_reduce, t), "async": outcome(c.all_reduce, t, async_op=True),
            "barrier": outcome(c.barrier)}


def _assert_raised(seen: dict, error: type, limit_s: float, *fragments: str) -> None:
    assert seen["type"] == error.__name__, seen
    assert seen["elapsed"] < limit_s, seen
    for fragment in fragments:
        assert fragment in seen["message"], (fragment, seen)


def _assert_poisoned(poisoned: dict, error: type) -> None:
    for what, seen in poisoned.items():
        # "At once": no communication happens, so well under the detection limit.
        _assert_raised(seen, error, DETECTION_LIMIT_S)
        assert "unusable after an earlier error" in seen["message"], (what, seen)


# ----------------------------------------------------------------------------------------------
# Rank functions.

def peer_exits(rank, n, store_path, victim):
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S, **TINY)
    t = make_input(0, rank, 1000, torch.float32)
    c.all_reduce(t)  # every rank is up and has finished one collective
    if rank == victim:
        os._exit(3)  # no close(): nothing tells the peers but the process ending
    seen = outcome(c.all_reduce, t)
    return {"seen": seen, "poisoned": _poisoned(c), "leaked": braid_segments([os.getpid()])}


def killed_while_waiting(rank, n, store_path, victim):
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S, **TINY)
    store = open_store(store_path)
    c.all_reduce(make_input(0, rank, 1000, torch.float32))
    if rank == victim:
        store.set("victim_ready", str(os.getpid()))
        store.wait(["never_set"])  # blocks until the test process SIGKILLs this rank
        raise AssertionError("the victim was not killed")
    return {"seen": outcome(c.all_reduce, make_input(0, rank, 1000, torch.float32))}


def all_killed_in_collective(rank, n, store_path):
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S, **TINY)
    c.all_reduce(make_input(0, rank, 1000, torch.float32))
    store = open_store(store_path)
    store.set(f"ready{rank}", "1")
    if rank == n - 1:
        store.wait(["never_set"])  # the others wait for this rank inside the all_reduce
    c.all_reduce(make_input(0, rank, 1000, torch.float32))
    raise AssertionError("the all_reduce finished without the last rank")


def _mismatched_call(c, case, rank, n):
    """The collective ``case`` makes each rank issue; the last rank deviates."""
    odd = rank == n - 1
    x = torch.ones(1000)
    if case == "count":
        return lambda: c.all_reduce(torch.ones(11 if odd else 10))
    if case == "count_pipelined":
        return lambda: c.all_reduce(torch.ones(1001 if odd else 1000))
    if case == "dtype":
        return lambda: c.all_reduce(torch.ones(10, dtype=torch.int32 if odd else torch.float32))
    if case == "op":
        return lambda: c.all_reduce(x, op="max" if odd else "sum")
    if case == "kind":
        if odd:
            return lambda: c.all_gather(torch.empty(n * 10), torch.ones(10))
        return lambda: c.all_reduce(torch.ones(10))
    if case == "barrier_vs_all_reduce":
        return c.barrier if odd else (lambda: c.all_reduce(x))
    if case == "src":
        return lambda: c.broadcast(x, src=1 if odd else 0)
    if case == "algo":
        return lambda: c.all_reduce(x)  # the communicators differ (see collective_mismatch)
    raise ValueError(case)


def collective_mismatch(rank, n, store_path, case):
    algo = ("ring" if rank == n - 1 else "twoshot") if case == "algo" else None
    c = make_comm(rank, n, store_path, algo=algo, **TINY)
    c.barrier()  # a matching collective first (a barrier: the communicators may differ in algo)
    seen = outcome(_mismatched_call(c, case, rank, n))
    return {"seen": seen, "poisoned": _poisoned(c), "leaked": braid_segments([os.getpid()])}


def absent_rank(rank, n, store_path, absent, async_op):
    c = make_comm(rank, n, store_path, timeout=SHORT_TIMEOUT_S, **TINY)
    store = open_store(store_path)
    c.barrier()
    if rank == absent:
        # Stays alive and in the group (closing would be a PeerError for the others) until the
        # others have seen their deadline pass.
        store.wait(["others_done"], timedelta(seconds=30))
        c.close()
        return {"pid": os.getpid()}
    t = make_input(0, rank, 1000, torch.float32)
    result = {}
    if async_op:
        start = time.monotonic()
        work = c.all_reduce(t, async_op=True)
        fut = work.get_future()
        result["early_poll"] = work.wait(0)  # a poll: the deadline is 1 s away
        result["early_wait"] = work.wait(timeout=0.2)  # still running
        result["early_completed"] = work.is_completed()
        result["early_repr"] = repr(work)
        seen = outcome(work.wait)
        seen["elapsed"] = time.monotonic() - start
        result["completed"], result["success"] = work.is_completed(), work.is_success()
        result["late_poll"] = outcome(work.wait, timedelta(0))  # a poll of a failed work raises
        result["late_repr"] = repr(work)
        result["future"] = outcome(fut.wait)
    else:
        seen = outcome(c.all_reduce, t)
    result.update(seen=seen, poisoned=_poisoned(c), leaked=braid_segments([os.getpid()]))
    if store.add("others_failed", 1) == n - 1:
        store.set("others_done", "1")
    return result


def peer_closes(rank, n, store_path):
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S, **TINY)
    c.barrier()
    # Every rank returns from the barrier before one leaves. Otherwise a rank that is slow to see
    # the barrier complete (3 ranks share 2 cores) may still be waiting in it when another rank
    # reports the departure from the next collective: the group is aborted, so it raises in the
    # barrier instead, which is not the case under test.
    store = open_store(store_path)
    store.set(f"past_barrier{rank}", "1")
    store.wait([f"past_barrier{r}" for r in range(n)], timedelta(seconds=60))
    if rank == n - 1:
        c.close()  # leaves while the others start a collective
        return None
    return {"seen": outcome(c.all_reduce, torch.ones(1000)), "poisoned": _poisoned(c)}


def no_segments_after_setup(rank, n, store_path):
    before = braid_segments([os.getpid()])
    c = make_comm(rank, n, store_path, **TINY)
    after_init = braid_segments([os.getpid()])
    c.all_reduce(torch.ones(1000))
    c.close()
    return {"before": before, "after_init": after_init, "after_close": braid_segments([os.getpid()])}


# ----------------------------------------------------------------------------------------------
# Tests

@pytest.mark.parametrize("n", (2, 3))
def test_peer_exit_raises_peer_error_on_every_survivor(n):
    """A rank that exits without close() while the others wait in all_reduce: every survivor raises
    PeerError naming it (rank and pid) within 2 s, not at the 30 s deadline; the communicator is
    poisoned and no segment is left."""
    victim = n // 2
    with FreshRanks(n) as ranks:
        ranks.start(peer_exits, victim)
        outcomes = ranks.outcomes()
        assert outcomes[victim] == ("died", 3), outcomes[victim]
        for r in range(n):
            if r == victim:
                continue
            kind, result = outcomes[r]
            assert kind == "ok", result
            _assert_raised(result["seen"], comm.PeerError, DETECTION_LIMIT_S,
                           f"rank {victim} (pid {ranks.pids[victim]}")
            _assert_poisoned(result["poisoned"], comm.PeerError)
            assert result["leaked"] == []
        assert braid_segments(ranks.pids) == []


def test_sigkill_while_peers_wait_raises_peer_error():
    """A rank SIGKILLed while the others are blocked in all_reduce: they raise PeerError within 2 s of
    the kill."""
    n, victim = 3, 1
    with FreshRanks(n) as ranks:
        ranks.start(killed_while_waiting, victim)
        store = open_store(ranks.store_path)
        store.wait(["victim_ready"], timedelta(seconds=60))
        killed_at = time.monotonic()
        ranks.kill(victim)
        outcomes = ranks.outcomes()
    assert outcomes[victim][0] == "died", outcomes[victim]
    for r in (0, 2):
        kind, result = outcomes[r]
        assert kind == "ok", result
        seen = result["seen"]
        assert seen["type"] == "PeerError", seen
        assert f"rank {victim} (pid {ranks.pids[victim]}" in seen["message"], seen
        # CLOCK_MONOTONIC is one clock for every process of the machine.
        assert seen["at"] - killed_at < DETECTION_LIMIT_S, seen


def test_sigkill_of_every_rank_leaves_no_segment():
    """SIGKILL of all ranks in the middle of a collective leaves nothing in /dev/shm: the segments
    were unlinked as soon as every rank had mapped them."""
    n = 3
    with FreshRanks(n) as ranks:
        ranks.start(all_killed_in_collective)
        open_store(ranks.store_path).wait([f"ready{r}" for r in range(n)], timedelta(seconds=60))
        assert braid_segments(ranks.pids) == []
        for r in range(n):
            ranks.kill(r)
        outcomes = ranks.outcomes()
    assert all(kind == "died" for kind, _ in outcomes.values()), outcomes
    assert braid_segments(ranks.pids) == []


MISMATCHES = ("count", "count_pipelined", "dtype", "op", "kind", "barrier_vs_all_reduce", "src", "algo")


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("case", MISMATCHES)
def test_mismatched_collectives_raise_on_every_rank(case, n):
    """The last rank issues a different collective (count, dtype, op, kind, broadcast source or
    algorithm): every rank, including those that agree with each other, raises CollectiveMismatch at
    once and stays poisoned; no data is reduced with the wrong partner."""
    for r, result in enumerate(run_ranks(collective_mismatch, n, case)):
        _assert_raised(result["seen"], comm.CollectiveMismatch, DETECTION_LIMIT_S)
        if case == "algo":  # both descriptions name their algorithm
            assert "algo twoshot" in result["seen"]["message"], result["seen"]
            assert "algo ring" in result["seen"]["message"], result["seen"]
        _assert_poisoned(result["poisoned"], comm.CollectiveMismatch)
        assert result["leaked"] == [], r


@pytest.mark.parametrize("async_op", (False, True), ids=("sync", "async"))
def test_absent_rank_times_out_naming_it(async_op):
    """A rank that never calls all_reduce: the others raise CommTimeout after their 1 s deadline (not
    before, not long after) naming that rank and its pid, and only it. Async: wait(timeout) reports
    False while it runs (and a poll, wait(0), too), the future fails with the error, the Work reports
    failure, a poll then raises the error, and the Work's repr says running, then failed and why."""
    n, absent = 3, 1
    results = run_ranks(absent_rank, n, absent, async_op)
    pid = results[absent]["pid"]
    for r in (0, 2):
        result = results[r]
        seen = result["seen"]
        _assert_raised(seen, comm.CommTimeout, SHORT_TIMEOUT_S + DETECTION_LIMIT_S,
                       f"rank {absent} (pid {pid}")
        # A rank may learn of the timeout from the other one, but never before a deadline passed.
        assert seen["elapsed"] > SHORT_TIMEOUT_S / 2, seen
        assert "rank 0 (pid" not in seen["message"] and "rank 2 (pid" not in seen["message"], seen
        _assert_poisoned(result["poisoned"], comm.CommTimeout)
        assert result["leaked"] == []
        if async_op:
            assert result["early_wait"] is False and result["early_completed"] is False, result
            assert result["early_poll"] is False, result
            assert result["early_repr"] == "<braid.comm.Work all_reduce running>", result
            assert result["completed"] is True and result["success"] is False, result
            _assert_raised(result["late_poll"], comm.CommTimeout, DETECTION_LIMIT_S,
                           f"rank {absent} (pid {pid}")
            assert result["late_repr"].startswith("<braid.comm.Work all_reduce failed: "), result
            assert f"rank {absent} (pid {pid}" in result["late_repr"], result
            fut = result["future"]
            assert fut["type"] is not None and "CommTimeout" in fut["message"], fut
            assert f"rank {absent} (pid {pid}" in fut["message"], fut


def test_bootstrap_timeout_names_missing_rank_and_leaks_nothing():
    """A communicator whose peer never joins raises CommTimeout naming the missing rank after the
    timeout, and its freshly created segment is removed."""
    store = open_store(new_store_path())
    start = time.monotonic()
    with pytest.raises(comm.CommTimeout, match=r"ranks \[1\]"):
        comm.Communicator(store, 0, 2, timeout=0.5, prefix="alone/")
    assert time.monotonic() - start < 0.5 + DETECTION_LIMIT_S
    assert braid_segments([os.getpid()]) == []


@pytest.mark.parametrize("n", (2, 3))
def test_peer_close_raises_peer_error(n):
    """A rank that closes its communicator while the others start a collective: they raise PeerError
    ("closed its communicator") within 2 s instead of waiting for the deadline."""
    for result in run_ranks(peer_closes, n)[:-1]:
        _assert_raised(result["seen"], comm.PeerError, DETECTION_LIMIT_S, "closed its communicator")
        _assert_poisoned(result["poisoned"], comm.PeerError)


@pytest.mark.parametrize("n", (2, 4))
def test_segments_unlinked_once_all_ranks_attached(n):
    """Right after the constructor returns, no rank's segment has a name in /dev/shm any more (a crash
    from then on cannot leak it), and nothing appears after collectives and close()."""
    for r, result in enumerate(run_ranks(no_segments_after_setup, n)):
        assert result == {"before": [], "after_init": [], "after_close": []}, (r, result)


def two_hosts(rank, n, store_path):
    """Rank n-1 announces another host identity, as a process on a second machine would."""
    from braid.comm.core import bootstrap

    real = bootstrap.host_identity
    if rank == n - 1:
        bootstrap.host_identity = lambda: "other-host|boot|shm"
    try:
        c = make_comm(rank, n, store_path)
    finally:
        bootstrap.host_identity = real  # pooled worker: later tests need the real one
    t = torch.full((1000,), float(rank + 1))
    c.all_reduce(t)
    layout = (c.num_hosts, c.local_world_size)
    c.close()
    return {"layout": layout, "sum": t[0].item(), "leftover": braid_segments([os.getpid()])}


@pytest.mark.parametrize("n", (2, 3))
def test_ranks_on_several_hosts_are_told_apart_by_identity(n):
    """Which ranks share a host comes from the identities they publish: a rank with another
    identity is on another host (reached over TCP), the others share memory, and nothing is left
    in /dev/shm."""
    for r, result in enumerate(run_ranks(two_hosts, n)):
        assert result["layout"] == (2, 1 if r == n - 1 else n - 1), (r, result)
        assert result["sum"] == n * (n + 1) / 2, (r, result)
        assert result["leftover"] == [], result


def calls_in_callback(rank, n, store_path):
    """Future callbacks run on the progress thread. A collective issued there runs at once, on
    that thread, right after the work whose completion runs the callback and before the works
    queued behind it: a blocking one, and an async one waited for inside the callback (as torch's
    PowerSGD hook does), both complete (queued, they would wait for the thread they block). A
    wait for a work queued behind it would wait for that thread itself: it raises. Rank 0 attaches
    the callbacks while its first all-reduce waits for rank 1; rank 1 calls the collectives in
    the order rank 0 runs them."""
    c = make_comm(rank, n, store_path)
    store = open_store(store_path)
    seen = {}
    t1, t2, t3 = (torch.full((100,), float(rank + k)) for k in (1, 2, 3))
    u = torch.ones(3)
    if rank == 0:
        a = c.all_reduce(t1, async_op=True)  # pending: rank 1 has not called yet
        b = c.all_reduce(t2, async_op=True)
        fut = a.get_future()
        blocking = fut.then(lambda _: outcome(c.all_reduce, u))
        waiting = fut.then(lambda _: outcome(b.wait))
        nested = fut.then(lambda _: c.all_reduce(t3, async_op=True).get_future().wait()[0][0].item())
        store.set("attached", "1")
        seen["blocking"], seen["wait"], seen["nested"] = blocking.wait(), waiting.wait(), nested.wait()
        b.wait()
    else:
        store.wait(["attached"])
        for t in (t1, u, t3, t2):
            c.all_reduce(t)
    seen["results"] = [t[0].item() for t in (t1, t2, t3, u)]
    t = torch.full((5,), float(rank))
    c.all_reduce(t)
    seen["after"] = t.tolist()
    c.close()
    return seen


def test_calls_from_a_callback_run_on_the_progress_thread():
    n = 2
    results = run_ranks(calls_in_callback, n)
    assert results[0]["blocking"]["type"] is None, results[0]["blocking"]
    assert results[0]["nested"] == 7.0, results[0]
    _assert_raised(results[0]["wait"], comm.CommError, DETECTION_LIMIT_S, "progress thread")
    for seen in results:
        assert seen["results"] == [3.0, 5.0, 7.0, 2.0], seen
        assert seen["after"] == [float(sum(range(n)))] * 5, seen


def close_in_callback(rank, n, store_path):
    """close() in a future's callback (on the progress thread, which close() would have to join)
    raises CommError; abort() there fails the communicator and leaves closing to the caller; a
    communicator whose last reference dies in a callback is closed on another thread. None of them
    may end the process ("terminate called").

    A callback attached to a future that is already complete runs at once on the caller's thread,
    so rank 0 attaches its callback before rank 1 enters the barrier (told through the store): the
    barrier cannot complete before that, and the callback runs on rank 0's progress thread."""
    import gc
    import threading

    store = open_store(store_path)
    seen = {}

    def in_callback(fn):
        def run(_):
            result = outcome(fn)
            result["thread"] = "main" if threading.current_thread() is threading.main_thread() else "other"
            return result
        return run

    c1 = make_comm(rank, n, store_path)
    if rank == 0:
        fut = c1.barrier(async_op=True).get_future().then(in_callback(c1.close))
        store.set("close attached", "1")
        seen["close"] = fut.wait()
    else:
        store.wait(["close attached"], timedelta(seconds=60))
        c1.barrier()
    c1.close()
    c2 = make_comm(rank, n, store_path)
    if rank == 0:
        fut = c2.barrier(async_op=True).get_future().then(in_callback(c2.abort))
        store.set("abort attached", "1")
        seen["abort"] = fut.wait()
        seen["after abort"] = outcome(c2.barrier)
    else:
        store.wait(["abort attached"], timedelta(seconds=60))
        c2.barrier()
    c2.close()
    seen["closed"] = c2.closed
    box = [make_comm(rank, n, store_path)]
    fut = box[0].barrier(async_op=True).get_future()
    done = fut.then(lambda _: box.clear())  # drops the last reference (on whichever thread runs it)
    done.wait()
    gc.collect()
    deadline = time.monotonic() + 30  # the finalizer's closing thread ends (daemon: not joined at exit)
    while any(t.name == "braid-close" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["close thread ended"] = not any(t.name == "braid-close" for t in threading.enumerate())
    return rank, seen


def test_close_and_abort_from_a_callback_do_not_end_the_process():
    for rank, seen in run_ranks(close_in_callback, 2):
        assert seen["closed"] and seen["close thread ended"], seen
        if rank != 0:
            continue
        assert seen["close"]["thread"] == "other" and seen["abort"]["thread"] == "other", seen
        assert seen["close"]["type"] == "CommError" and "progress thread" in seen["close"]["message"], seen
        assert seen["abort"]["type"] is None, seen
        assert seen["after abort"]["type"] == "CommClosed", seen


def drop_with_callbacks_in_flight(rank, n, store_path):
    """The last reference to a c10d backend (or a communicator) dropped while its works are queued
    with Python callbacks chained on their futures: closing it waits for the progress thread, which
    needs the GIL to run those callbacks, so the close must not hold it. Every queued work still
    completes, and every callback sees its result. Then a backend dropped inside such a callback."""
    from braid.comm import _C

    seen = []
    backend = _C.Backend(make_comm(rank, n, store_path)._release_core())
    t = torch.full((1 << 16,), float(rank + 1))
    futures = [backend.allreduce([t.clone()]).get_future().then(lambda f: seen.append(f.value()[0][0].item()))
               for _ in range(16)]
    del backend  # the deallocation closes it, here, with the GIL held
    torch.futures.wait_all(futures)
    c = make_comm(rank, n, store_path)
    futures = [c.all_reduce(t.clone(), async_op=True).get_future()
               .then(lambda f: seen.append(f.value()[0][0].item())) for _ in range(16)]
    del c
    torch.futures.wait_all(futures)
    # The last reference to a backend dropped in a callback on its own progress thread (rank 0
    # attaches it before rank 1 joins the call): the thread cannot join itself, and the process
    # once ended there ("terminate called").
    store = open_store(store_path)
    box = [_C.Backend(make_comm(rank, n, store_path)._release_core())]
    if rank == 0:
        done = box[0].allreduce([t.clone()]).get_future().then(lambda _: box.clear())
        store.set("drop attached", "1")
        done.wait()
    else:
        store.wait(["drop attached"], timedelta(seconds=60))
        box[0].allreduce([t.clone()]).wait()
        box.clear()
    seen.append(len(box))
    return seen


def test_dropping_the_last_reference_with_callbacks_in_flight_does_not_hang():
    want = float(sum(range(1, 3)))
    for seen in run_ranks(drop_with_callbacks_in_flight, 2, deadline_s=60):
        assert seen == [want] * 32 + [0], seen


def late_peer_with_huge_timeouts(rank, n, store_path):
    """Timeouts past an int64 of nanoseconds (1e12 s, inf) mean "for ever": a peer 0.5 s late is
    waited for (1e12 s once overflowed into a deadline in the past), and Work.wait takes the same
    values and timedeltas."""
    c = make_comm(rank, n, store_path, timeout=1e12 if rank == 0 else float("inf"))
    if rank == 1:
        time.sleep(0.5)
    t = torch.ones(4)
    w = c.all_reduce(t, async_op=True)
    waited = [w.wait(timeout=float("inf")), w.wait(timeout=1e300), w.wait(timeout=timedelta(seconds=5))]
    c.close()
    return waited, t.tolist()


def test_huge_timeouts_wait_instead_of_expiring():
    for waited, t in run_ranks(late_peer_with_huge_timeouts, 2):
        assert waited == [True, True, True] and t == [2.0] * 4


def abort_while_waiting(rank, n, store_path):
    """Rank 0 aborts while its async all-reduce waits for rank 1 and another is queued behind
    it: abort returns at once, both works fail, and rank 1 is told when it arrives."""
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S)
    store = open_store(store_path)
    if rank == 0:
        running = c.all_reduce(torch.ones(300_000), async_op=True)
        queued = c.all_reduce(torch.ones(10), async_op=True)
        # Aims at the case under test, abort while the progress thread waits for rank 1 (no
        # synchronization rests on it: an abort before that wait must give the same outcomes).
        time.sleep(0.3)
        start = time.monotonic()
        c.abort()
        took = time.monotonic() - start
        store.set("aborted", "1")
        return {"took": took, "running": outcome(running.wait), "queued": outcome(queued.wait),
                "closed": c.closed, "after": outcome(c.barrier)}
    store.wait(["aborted"])
    seen = outcome(c.all_reduce, torch.ones(300_000))
    c.close()
    return {"seen": seen}


def test_abort_fails_running_and_queued_work_at_once():
    r0, r1 = run_ranks(abort_while_waiting, 2)
    assert r0["took"] < DETECTION_LIMIT_S, r0
    for what in ("running", "queued"):
        assert r0[what]["type"] == "CommClosed", (what, r0)  # the running one once said CommError
        assert "rank 0 aborted the communicator" in r0[what]["message"], (what, r0)
    assert r0["closed"] and r0["after"]["type"] == "CommClosed", r0
    _assert_raised(r1["seen"], comm.PeerError, DETECTION_LIMIT_S, "rank 0 aborted the communicator")
