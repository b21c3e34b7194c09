"""Communicator.shrink and grow: the ranks that go on after a peer died (or that leave ranks out on
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
@pytest.mark.slow
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
    rank calls shrink(wait=0.5), that one once every other rank's shrink has returned (the
    membership agreed without it)."""
    c = make_comm(rank, n, store_path)
    c.all_reduce(torch.ones(10))
    if late_rank is None:
        if rank == n - 1:
            c.close()
            return {"excluded": True}
        start = time.monotonic()
        with c.shrink(exclude=[n - 1], wait=60.0) as c2:
            return dict(_check_new(c2, rank, list(range(n - 1))), took=time.monotonic() - start)
    store = open_store(store_path)
    others = [r for r in range(n) if r != late_rank]
    if rank == late_rank:
        store.wait([f"shrunk/{r}" for r in others], timedelta(seconds=60))
        return {"late": outcome(c.shrink, wait=0.5)}
    with c.shrink(wait=0.5) as c2:
        store.set(f"shrunk/{rank}", "1")
        return _check_new(c2, rank, others)


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


# -- grow: processes that ask to join are taken in at a point the members agree on ------------


def grow_and_join(rank, n, store_path, members):
    """Ranks below ``members`` form a communicator and grow it twice (to take in one joiner, then
    another); the others join, one by one: rank ``members`` at the first grow, the next at the
    second. Every communicator's all_reduce is checked exactly."""
    if rank < members:
        c = make_comm(rank, members, store_path, prefix="grow-root/")
        open_store(store_path).set(f"ready/{rank}", "1")
        out = {"first": _check_new(c, rank, list(range(members)))}
        c = c.grow(expect=1, wait=60.0)
        out["second"] = _check_new(c, rank, list(range(members + 1)))
        c = c.grow(expect=1, wait=60.0)
        out["third"] = _check_new(c, rank, list(range(members + 2)))
        out["prefix"] = c.prefix
        c.close()
        return out
    from braid import comm

    store = open_store(store_path)
    store.wait([f"ready/{r}" for r in range(members)])
    if rank == members + 1:  # the second joiner asks once the first was taken in
        store.wait(["grow-root/joined/1"])
    c = comm.Communicator.join(store, "grow-root/", timeout=60.0)
    out = {"joined_as": c.rank}
    if rank == members:
        out["second"] = _check_new(c, rank, list(range(members + 1)))
    c2 = c.grow(expect=1, wait=60.0) if rank == members else c
    out["third"] = _check_new(c2, rank, list(range(members + 2)))
    c2.close()
    return out


def test_members_take_in_joiners_in_the_order_they_asked():
    """2 members grow to 3 (a joiner that asked before), then to 4 (a joiner that asked once the
    first was in); members keep their ranks, joiners follow in the order they asked; every new
    communicator's all_reduce is exact over its ranks; the prefix joiners use stays the first's."""
    members = 2
    results = run_ranks(grow_and_join, members + 2, members)
    for r in range(members):
        stages = [results[r][k] for k in ("first", "second", "third")]
        assert [s["world"] for s in stages] == [2, 3, 4], stages
        assert all(s["exact"] and s["rank"] == r for s in stages), stages
        assert results[r]["prefix"] == "grow-root/"
    assert results[2]["joined_as"] == 2 and results[2]["second"]["exact"] and results[2]["third"]["rank"] == 2
    assert results[3]["joined_as"] == 3 and results[3]["third"]["exact"] and results[3]["third"]["world"] == 4


def grow_without_joiners(rank, n, store_path):
    c = make_comm(rank, n, store_path, prefix="lonely/")
    c2 = c.grow()  # nobody asked: the same ranks, a new communicator
    out = dict(_check_new(c2, rank, list(range(n))), old_closed=c.closed)
    c2.close()
    return out


def test_a_grow_that_nobody_asked_to_join_keeps_the_ranks():
    results = run_ranks(grow_without_joiners, 2)
    assert all(r["world"] == 2 and r["exact"] and r["old_closed"] for r in results), results


def join_nobody_grows(rank, n, store_path):
    from braid import comm

    return {"join": outcome(comm.Communicator.join, open_store(store_path), "nobody/", timeout=1.0),
            "args": outcome(comm.Communicator.join, open_store(store_path), "", timeout=1.0)}


def test_a_join_no_grow_answers_times_out_and_names_the_prefix():
    seen = run_ranks(join_nobody_grows, 1)[0]
    assert seen["join"]["type"] == "CommTimeout" and "'nobody/'" in seen["join"]["message"], seen
    assert seen["args"]["type"] == "ValueError" and "prefix must be" in seen["args"]["message"], seen


def bad_grow_arguments(rank, n, store_path):
    c = make_comm(rank, n, store_path)
    seen = {"expect": outcome(c.grow, expect=-1), "wait": outcome(c.grow, wait="5")}
    c.close()
    return seen


def test_bad_grow_arguments_are_named():
    seen = run_ranks(bad_grow_arguments, 1)[0]
    assert seen["expect"]["type"] == "ValueError" and "expect must be" in seen["expect"]["message"]
    assert seen["wait"]["type"] == "ValueError" and "wait must be" in seen["wait"]["message"]
