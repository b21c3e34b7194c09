"""Communicator.shrink: the ranks that go on after a peer died (or that leave ranks out on
purpose) agree through the store and get a new communicator over themselves, exact, on one host
and across simulated hosts; a rank that arrives after the agreement is left out with an error."""
import os
import time
from datetime import timedelta

import pytest
import torch
from helpers import braid_segments, make_input, outcome
from helpers.ranks import FreshRanks, make_comm, open_store, run_ranks

LONG_TIMEOUT_S = 30.0


def _check_new(c2, rank, members, seed=5) -> dict:
    """An all_reduce over the new communicator against the sum of the members' inputs (integral
    values: exact in any order)."""
    inputs = {r: make_input(seed, r, 3001, torch.float32, integral=True) for r in members}
    t = inputs[rank].clone()
    c2.all_reduce(t)
    return {"rank": c2.rank, "world": c2.world_size, "exact": torch.equal(t, sum(inputs.values())),
            "hosts": c2.num_hosts}


def survivors_go_on(rank, n, store_path, victim, host_of):
    if host_of is not None:
        os.environ["BRAID_HOST_ID"] = f"host{host_of[rank]}"  # a fresh process: nothing to restore
    c = make_comm(rank, n, store_path, timeout=LONG_TIMEOUT_S)
    store = open_store(store_path)
    c.all_reduce(torch.ones(1000))
    if rank == victim:
        store.set("victim_ready", "1")
        store.wait(["never_set"], timedelta(seconds=120))  # until the test SIGKILLs this rank
        raise AssertionError("the victim was not killed")
    seen = outcome(c.all_reduce, torch.ones(100_000))
    start = time.monotonic()
    c2 = c.shrink(wait=2.0)
    took = time.monotonic() - start
    with c2:
        result = _check_new(c2, rank, [r for r in range(n) if r != victim])
    return dict(result, seen=seen["type"], took=took, old_closed=c.closed)


@pytest.mark.parametrize("host_of", [None, [0, 0, 1, 1]], ids=["one-host", "2x2-hosts"])
def test_survivors_of_a_killed_rank_go_on_in_a_smaller_communicator(host_of):
    """A rank SIGKILLed inside an all_reduce: the others raise PeerError, shrink() (waiting up to
    2 s for the dead rank, which never comes) gives them a communicator of n - 1 ranks, numbered in
    their old order, whose all_reduce is exact; the old one is closed; no segment is left."""
    n, victim = 4, 2
    with FreshRanks(n) as ranks:
        ranks.start(survivors_go_on, victim, host_of)
        open_store(ranks.store_path).wait(["victim_ready"], timedelta(seconds=60))
        ranks.kill(victim)
        outcomes = ranks.outcomes()
        survivors = [r for r in range(n) if r != victim]
        for new_rank, r in enumerate(survivors):
            kind, result = outcomes[r]
            assert kind == "ok", result
            assert result["seen"] == "PeerError", result
            assert (result["rank"], result["world"], result["exact"]) == (new_rank, n - 1, True), result
            assert result["hosts"] == (1 if host_of is None else 2), result
            assert result["old_closed"], result
            assert result["took"] < 2.0 + 10.0, result  # the wait, plus building the new one
        assert braid_segments([ranks.pids[r] for r in survivors]) == []


def leave_out(rank, n, store_path, late_rank):
    """Ranks 0..n-2 leave the last rank out on purpose (no wait); with ``late_rank`` instead every
    rank calls shrink(wait=0.5), that one 3 s late."""
    c = make_comm(rank, n, store_path)
    c.all_reduce(torch.ones(10))
    if late_rank is None:
        if rank == n - 1:
            c.close()
            return {"excluded": True}
        start = time.monotonic()
        with c.shrink(exclude=[n - 1], wait=60.0) as c2:
            return dict(_check_new(c2, rank, list(range(n - 1))), took=time.monotonic() - start)
    if rank == late_rank:
        time.sleep(3.0)  # after the others agreed (they wait 0.5 s at most): left out
        return {"late": outcome(c.shrink, wait=0.5)}
    with c.shrink(wait=0.5) as c2:
        return _check_new(c2, rank, [r for r in range(n) if r != late_rank])


def test_ranks_left_out_on_purpose_are_not_waited_for():
    n = 3
    results = run_ranks(leave_out, n, None)
    assert results[n - 1] == {"excluded": True}
    for r in range(n - 1):
        assert (results[r]["rank"], results[r]["world"], results[r]["exact"]) == (r, n - 1, True), results[r]
        assert results[r]["took"] < 10.0, results[r]  # no 60 s wait for the excluded rank


def test_a_rank_arriving_after_the_agreement_is_left_out_with_an_error():
    n = 3
    results = run_ranks(leave_out, n, 1)
    late = results[1]["late"]
    assert late["type"] == "CommError" and "left out" in late["message"], late
    assert (results[0]["rank"], results[0]["world"], results[0]["exact"]) == (0, 2, True), results[0]
    assert (results[2]["rank"], results[2]["world"], results[2]["exact"]) == (1, 2, True), results[2]


def bad_shrink_arguments(rank, n, store_path):
    c = make_comm(rank, n, store_path)
    seen = {"self": outcome(c.shrink, exclude=[rank]), "range": outcome(c.shrink, exclude=[n]),
            "wait": outcome(c.shrink, wait=-1)}
    c.close()
    return seen


def test_bad_arguments_are_named_and_leave_the_communicator_open():
    seen = run_ranks(bad_shrink_arguments, 2)[0]
    assert seen["self"]["type"] == "ValueError" and "exclude holds this rank" in seen["self"]["message"]
    assert seen["range"]["type"] == "ValueError" and "exclude must hold ranks" in seen["range"]["message"]
    assert seen["wait"]["type"] == "ValueError" and "wait must be" in seen["wait"]["message"]
