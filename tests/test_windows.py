"""Registered buffers (``Communicator.empty`` / ``zeros``): collectives on tensors that every rank
of the host can read run the window algorithms (csrc/core/algorithms/window_collectives.cc), and
give the bits of the slot algorithms on private tensors, either side of the one-shot limit, with
odd counts, every dtype, views at offsets, and mixed (one rank registered, the other not).

Every rank checks its results against exact local references and against the same collective on
private copies of the same inputs (the slot path), bit for bit."""
import glob
import os
import time
from datetime import timedelta

import pytest
import torch
from helpers import braid_segments, make_input, outcome, reduce_reference
from braid.comm import P2POp
from helpers.ranks import FreshRanks, environment, make_comm, open_store, run_ranks

ONESHOT_MAX_BYTES = 256  # small: most sizes below take the pipelined (and window) path
TINY = {"oneshot_max_bytes": ONESHOT_MAX_BYTES, "slot_bytes": 1024, "nslots": 2}
TUNABLES = TINY
# (tunables, counts): tiny slots, where all but the smallest counts are pipelined; and the defaults,
# where 9000 elements of 4 bytes and more take the one-shot algorithms on registered buffers
# (past their 32 KiB threshold: oneshot_sources.h; 5000 below it, but for the calls that publish
# every rank's share) and 70000 the pipelined ones.
SETTINGS = {"tiny": (TINY, (1, 13, 64, 1000, 4097)), "default": ({}, (1, 5000, 9000, 70000))}
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.uint8)


def _inputs(n, count, dtype, seed):
    return [make_input(seed, r, count, dtype) for r in range(n)]


def _check_collectives(rank, n, store_path, setting):
    tunables, counts = SETTINGS[setting]
    c = make_comm(rank, n, store_path, **tunables)
    seen = []
    try:
        for dtype in DTYPES:
            for count in counts:
                seed = count * 31 + len(seen)
                xs = _inputs(n, count, dtype, seed)
                mine = xs[rank]
                # all_gather: the input in a window (at an offset: a view into a larger one)
                win = c.empty(count + 5, dtype=dtype)
                win[5:].copy_(mine)
                out = torch.empty(n * count, dtype=dtype)
                c.all_gather(out, win[5:])
                assert torch.equal(out, torch.cat(xs)), ("all_gather", dtype, count)
                # broadcast from every root, in a window
                for root in range(n):
                    b = c.empty(count, dtype=dtype)
                    b.copy_(xs[root] if rank == root else torch.zeros_like(mine))
                    c.broadcast(b, root)
                    assert torch.equal(b, xs[root]), ("broadcast", dtype, count, root)
                # all_to_all: n chunks of count
                a_in = c.empty(n * count, dtype=dtype)
                a_in.copy_(make_input(seed + 1, rank, n * count, dtype))
                a_out = torch.empty(n * count, dtype=dtype)
                c.all_to_all(a_out, a_in)
                want = torch.cat([make_input(seed + 1, j, n * count, dtype)[rank * count:(rank + 1) * count]
                                  for j in range(n)])
                assert torch.equal(a_out, want), ("all_to_all", dtype, count)
                for op in ("sum", "avg", "max") if dtype != torch.uint8 else ("max",):
                    # reduce_scatter: the input in a window; against the same call on private memory
                    rs_in = c.empty(n * count, dtype=dtype)
                    full = make_input(seed + 2, rank, n * count, dtype)
                    rs_in.copy_(full)
                    got = torch.empty(count, dtype=dtype)
                    c.reduce_scatter(got, rs_in, op)
                    slot = torch.empty(count, dtype=dtype)
                    c.reduce_scatter(slot, full.clone(), op)
                    assert torch.equal(got, slot), ("reduce_scatter", dtype, count, op)
                    every = [make_input(seed + 2, r, n * count, dtype) for r in range(n)]
                    ref = reduce_reference([e[rank * count:(rank + 1) * count] for e in every], op, n)
                    assert torch.equal(got, ref), ("reduce_scatter reference", dtype, count, op)
                    # all_reduce in place on a window, against private memory and the reference
                    t = c.empty(count, dtype=dtype)
                    t.copy_(mine)
                    c.all_reduce(t, op)
                    private = mine.clone()
                    c.all_reduce(private, op)
                    assert torch.equal(t, private), ("all_reduce", dtype, count, op)
                    want = reduce_reference(xs, op, n)
                    assert torch.equal(t, want), ("all_reduce reference", dtype, count, op)
                seen.append((str(dtype), count))
        # One rank registered, the others not: the usual paths (the registered rank publishing its
        # data after the arrival at one-shot sizes), the same results.
        for size in (3000, 8000, 300000):
            x = torch.arange(size, dtype=torch.float32) + rank
            registered = c.empty(size)  # collective: every rank makes it
            y = registered if rank == 0 else torch.empty(size)
            y.copy_(x)
            c.all_reduce(y)
            assert torch.equal(y, sum(torch.arange(size, dtype=torch.float32) + r for r in range(n))), size
            out = torch.empty(n * size)
            c.all_gather(out, y)
            assert torch.equal(out[rank * size:(rank + 1) * size], y), size
        # zeros, shapes and a freed window's id not reused
        z = c.zeros(4, 5, dtype=torch.float64)
        assert z.shape == (4, 5) and z.dtype == torch.float64 and not z.any()
        del z, win, b, a_in, rs_in, t, y, registered
        z2 = c.zeros((2, 3))
        assert z2.shape == (2, 3)
        c.barrier()
    finally:
        c.close()
    return rank, seen


# Three ranks with tiny slots; the default tunables at two ranks, where their one-shot limit (1 MiB)
# leaves room for the one-shot collectives on registered buffers (at three it is 32 KiB).
@pytest.mark.parametrize("n,setting", [(2, "tiny"), (3, "tiny"), (2, "default")])
def test_collectives_on_registered_buffers_are_exact(n, setting):
    results = run_ranks(_check_collectives, n, setting)
    assert len({tuple(seen) for _, seen in results}) == 1
    assert len(results[0][1]) == len(DTYPES) * len(SETTINGS[setting][1])


def _alone(rank, n, store_path):
    c = make_comm(rank, n, store_path)
    try:
        t = c.zeros(7)
        return type(t).__name__, t.shape, bool(t.any())
    finally:
        c.close()


def test_a_rank_alone_gets_a_plain_tensor():
    assert run_ranks(_alone, 1) == [("Tensor", torch.Size([7]), False)]


def _bad_arguments(rank, n, store_path):
    c = make_comm(rank, n, store_path)
    try:
        errors = []
        for call in (lambda: c.empty(-1), lambda: c.empty(2.5), lambda: c.empty(3, dtype="float32"),
                     lambda: c.empty(True), lambda: c.empty(3 + rank)):
            try:
                call()
                errors.append(None)
            except (ValueError, TypeError) as e:
                errors.append(type(e).__name__ + ": " + str(e).split(",")[0])
        after = c.zeros(5)  # the next buffer is registered as usual
        c.all_reduce(after)
        c.barrier()
        return errors
    finally:
        c.close()


def test_bad_arguments_name_themselves():
    for errors in run_ranks(_bad_arguments, 2):
        size, dtype = "ValueError: size must be", "TypeError: dtype must be"
        differ = ("ValueError: empty/zeros must ask for the same number of bytes on every rank of a host: "
                  "rank 0")
        wants = (size, size, dtype, size, differ)
        assert [e.startswith(want) for e, want in zip(errors, wants)] == [True] * 5, errors


def _segments_go(rank, n, store_path):
    c = make_comm(rank, n, store_path)
    try:
        t = c.zeros(1 << 16)
        c.all_reduce(t)
        c.barrier()
        return sorted(os.path.basename(p) for p in glob.glob("/dev/shm/*"))
    finally:
        c.close()


def test_no_window_name_is_left_in_dev_shm():
    before = set(os.listdir("/dev/shm"))
    run_ranks(_segments_go, 2)
    assert set(os.listdir("/dev/shm")) <= before


def _algorithms(rank, n, store_path):
    """The flight recorder names each call's algorithm: "window" where the data was read in place."""
    c = make_comm(rank, n, store_path, **TUNABLES)
    try:
        count = 1000
        win = c.empty(n * count)
        win.fill_(rank)
        private = torch.full((n * count,), float(rank))
        out = torch.empty(n * n * count)
        for data in (win, private):
            c.all_reduce(data)
            c.reduce_scatter(torch.empty(count), data)
            c.all_gather(out[: n * count], data[:count])
            c.all_to_all(out[: n * count], data)
            c.broadcast(data, 0)
        tiny = c.empty(4)  # within the one-shot limit: one-shot, registered or not
        c.all_reduce(tiny)
        calls = [(e["kind"], e["algorithm"]) for e in c.trace()["entries"] if e["kind"] != "barrier"]
        return calls[-11:]
    finally:
        c.close()


def _oneshot_algorithms(rank, n, store_path):
    """At one-shot sizes (default tunables, 2 ranks: up to 1 MiB) past 32 KiB, registered buffers
    are read in place too; below 32 KiB, and on private memory, the one-shot buffers carry the data."""
    c = make_comm(rank, n, store_path)
    try:
        names = []
        for count in (1000, 9000):  # 4 KB, 36 KB per part
            win = c.empty(n * count)
            win.fill_(rank)
            out = torch.empty(n * n * count)
            for data in (win, win.clone()):
                c.all_reduce(data)
                c.all_reduce(data)  # in place again: its result is the input of the next call
                c.reduce_scatter(torch.empty(count), data)
                c.all_gather(out[: n * count], data[:count])
                c.all_to_all(out[: n * count], data)
                c.broadcast(data, 0)
                calls = [e for e in c.trace()["entries"] if e["kind"] != "barrier"][-6:]
                names.append([e["algorithm"] for e in calls])
        return names
    finally:
        c.close()


def test_registered_buffers_at_one_shot_sizes():
    for names in run_ranks(_oneshot_algorithms, 2):
        small_registered, small_private, registered, private = names
        assert small_registered == small_private == private == ["oneshot"] * 6, names
        assert registered == ["window"] * 6, names


def test_the_recorder_names_the_window_path():
    for names in run_ranks(_algorithms, 2):
        kinds = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"]
        assert names[:5] == [(k, "window") for k in kinds]
        assert [k for k, _ in names[5:10]] == kinds and all(a != "window" for _, a in names[5:10])
        assert names[10] == ("all_reduce", "oneshot")


def _refused_on_one_rank(rank, n, store_path):
    """A rank that cannot make its segment (simulated: BRAID_REGISTERED_BUFFERS=0 on rank 1
    only) makes every rank of the host fall back to plain tensors for that buffer: the usual
    paths, exact results, nothing left in /dev/shm; the next buffer is registered again."""
    c = make_comm(rank, n, store_path)
    try:
        count = 300000  # past the one-shot limit: "twoshot" on private memory, "window" registered
        with environment({"BRAID_REGISTERED_BUFFERS": "0"} if rank == 1 else {}):
            refused = c.empty(count)
        registered = c.empty(count)
        names = []
        for t in (refused, registered):
            t.fill_(rank + 1)
            c.all_reduce(t)
            assert torch.equal(t, torch.full((count,), float(sum(range(1, n + 1))))), names
            names.append([e["algorithm"] for e in c.trace()["entries"] if e["kind"] == "all_reduce"][-1])
        return names
    finally:
        c.close()


def test_a_refused_segment_falls_back_on_every_rank():
    before = set(os.listdir("/dev/shm"))
    assert run_ranks(_refused_on_one_rank, 2) == [["twoshot", "window"]] * 2
    assert set(os.listdir("/dev/shm")) <= before


def _killed_while_reading(rank, n, store_path, victim):
    """Every rank all-gathers a 16 MiB registered buffer over and over (the window path: each reads
    the others' buffers in place); the test SIGKILLs the victim meanwhile."""
    c = make_comm(rank, n, store_path, timeout=30.0)
    store = open_store(store_path)
    win = c.empty(1 << 22)
    win.fill_(rank)
    out = torch.empty(n << 22)
    c.all_gather(out, win)
    store.set(f"gathering{rank}", "1")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = outcome(c.all_gather, out, win)
        if seen["type"] is not None:
            return {"seen": seen, "leaked": braid_segments([os.getpid()])}
    raise AssertionError("the peer's death went unnoticed for 60 s")


def _raised_peer_error(ranks, outcomes, victim, killed_at):
    """The victim died; rank 0 raised PeerError naming it within 2 s; nothing left in /dev/shm."""
    assert outcomes[victim][0] == "died", outcomes[victim]
    kind, result = outcomes[0]
    assert kind == "ok", result
    seen = result["seen"]
    assert seen["type"] == "PeerError", seen
    assert f"rank {victim} (pid {ranks.pids[victim]}" in seen["message"], seen
    assert seen["at"] - killed_at < 2.0, seen
    assert result["leaked"] == []
    assert braid_segments(ranks.pids) == []


def test_a_peer_killed_during_window_collectives_raises_peer_error():
    """A rank SIGKILLed while the ranks read each other's registered buffers: the survivors raise
    PeerError naming it within 2 s (the victim's memory stays mapped in the survivors, so a read in
    progress finishes; the wait after it notices the death), and nothing is left in /dev/shm."""
    n, victim = 2, 1
    with FreshRanks(n) as ranks:
        ranks.start(_killed_while_reading, victim)
        open_store(ranks.store_path).wait([f"gathering{r}" for r in range(n)], timedelta(seconds=60))
        time.sleep(0.3)  # aims the kill at the middle of the loop; no outcome rests on it
        killed_at = time.monotonic()
        ranks.kill(victim)
        outcomes = ranks.outcomes()
    _raised_peer_error(ranks, outcomes, victim, killed_at)


# -- point to point and all_to_all with split sizes from registered buffers --------------------------
# A send from a registered buffer offers the receiver its data in place (csrc/core/transport/shm/
# mailbox.cc) from 16 KiB on (BRAID_P2P_WINDOW_MIN_BYTES), where the send waits for its receiver
# anyway: inside an all_to_all with split sizes at any size, a plain send only past the mailbox's
# eager 4 MiB.
P2P_MIN = 16 << 10
EAGER = 4 << 20


def _last(c, kinds):
    return [e for e in c.trace()["entries"] if e["kind"] in kinds][-1]


def _point_to_point(rank, n, store_path):
    c = make_comm(rank, n, store_path)
    seen = []
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
            es = dtype.itemsize
            # all_to_all with split sizes: rank i sends rank j (i + j + 1) * unit elements, pieces
            # below the threshold at the small unit, either side of it at the large ones (odd counts)
            for unit in (101, P2P_MIN // es // 2 + 7, 3 * P2P_MIN // es + 1):
                sends = [(rank + j + 1) * unit for j in range(n)]
                recvs = [(i + rank + 1) * unit for i in range(n)]
                # the input at an offset in its window (the same size on every rank: the largest)
                win = c.empty(n * (2 * n - 1) * unit + 3, dtype=dtype)
                win = win[:sum(sends) + 3]
                mine = make_input(unit, rank, sum(sends), dtype)
                win[3:].copy_(mine)
                out = torch.empty(sum(recvs), dtype=dtype)
                c.all_to_all(out, win[3:], output_split_sizes=recvs, input_split_sizes=sends)
                pieces = []
                for i in range(n):
                    theirs = [(i + j + 1) * unit for j in range(n)]
                    src = make_input(unit, i, sum(theirs), dtype)
                    pieces.append(src[sum(theirs[:rank]):sum(theirs[:rank + 1])])
                assert torch.equal(out, torch.cat(pieces)), ("all_to_all_v", dtype, unit)
                algorithm = _last(c, ("all_to_all_v",))["algorithm"]
                # private copies of the same inputs: the same bits through the mailboxes
                private = torch.empty_like(out)
                c.all_to_all(private, mine.clone(), output_split_sizes=recvs, input_split_sizes=sends)
                assert torch.equal(private, out), ("all_to_all_v private", dtype, unit)
                in_place = min(s for j, s in enumerate(sends) if j != rank) * es >= P2P_MIN
                seen.append(("all_to_all_v", str(dtype), unit, algorithm, in_place))
            # a ring of sends past the eager capacity (in place) and below it (through the mailbox)
            for count in (EAGER // es + 5, EAGER // es - 5, P2P_MIN // es):
                win = c.empty(count, dtype=dtype)
                win.copy_(make_input(count, rank, count, dtype))
                got = torch.empty(count, dtype=dtype)
                nxt, prv = (rank + 1) % n, (rank - 1) % n
                if rank % 2 == 0:
                    c.send(win, nxt)
                    c.recv(got, prv)
                else:
                    c.recv(got, prv)
                    c.send(win, nxt)
                assert torch.equal(got, make_input(count, prv, count, dtype)), ("send", dtype, count)
                send = [e for e in c.trace()["entries"] if e["kind"] == "send"][-1]
                seen.append(("send", str(dtype), count, send["algorithm"], count * es > EAGER))
                # async sends and receives in one batch, the same way
                works = c.batch_isend_irecv([P2POp("send", win, nxt), P2POp("recv", got, prv)])
                for w in works:
                    w.wait()
                assert torch.equal(got, make_input(count, prv, count, dtype)), ("batch", dtype, count)
        return seen
    finally:
        c.close()


@pytest.mark.parametrize("n", [2, 3])
def test_point_to_point_from_registered_buffers(n):
    """all_to_all with split sizes and sends read in place from registered buffers (the recorder
    says "window" where they were, on every rank), exact against the reference and bitwise the
    mailbox path's, either side of the 16 KiB threshold and of the 4 MiB eager capacity."""
    results = run_ranks(_point_to_point, n)
    assert len({tuple(r) for r in results}) == 1, "the ranks disagree on the path"
    for kind, dtype, count, algorithm, in_place in results[0]:
        assert algorithm == ("window" if in_place else None), (kind, dtype, count, algorithm)
    assert {r[4] for r in results[0]} == {True, False}  # both paths were taken


def _declined(rank, n, store_path):
    """The receiver no longer maps the sender's window (it dropped its tensor of that id): it
    declines the offer and the data comes through the mailbox, exact; the next window is read in
    place again."""
    c = make_comm(rank, n, store_path)
    try:
        count = (EAGER >> 2) + 1000
        gone = c.empty(count)
        kept = c.empty(count)
        if rank == 1:
            del gone  # rank 1's mappings of that window go with its tensor
            got = torch.empty(count)
            names = []
            for _ in range(2):
                c.recv(got, 0)
                assert torch.equal(got, torch.arange(count, dtype=torch.float32)), names
                names.append(_last(c, ("recv",))["algorithm"])
            return names
        names = []
        for t in (gone, kept):
            t.copy_(torch.arange(count, dtype=torch.float32))
            c.send(t, 1)
            names.append(_last(c, ("send",))["algorithm"])
        return names
    finally:
        c.close()


def test_an_offer_the_receiver_cannot_read_goes_through_the_mailbox():
    assert run_ranks(_declined, 2) == [[None, "window"], [None, "window"]]


def _killed_while_offering(rank, n, store_path, victim):
    """Rank 0 sends 8 MiB from a registered buffer to the victim, which never receives it: the
    send waits on its offer until the test kills the victim."""
    c = make_comm(rank, n, store_path, timeout=30.0)
    store = open_store(store_path)
    win = c.empty(1 << 21)
    c.barrier()
    store.set(f"offering{rank}", "1")
    if rank == victim:
        time.sleep(120)  # killed long before
        raise AssertionError("not killed")
    seen = outcome(c.send, win, victim)
    return {"seen": seen, "leaked": braid_segments([os.getpid()])}


def test_a_receiver_killed_while_offered_raises_peer_error():
    n, victim = 2, 1
    with FreshRanks(n) as ranks:
        ranks.start(_killed_while_offering, victim)
        open_store(ranks.store_path).wait([f"offering{r}" for r in range(n)], timedelta(seconds=60))
        time.sleep(0.3)  # lets rank 0's offer go out; no outcome rests on it
        killed_at = time.monotonic()
        ranks.kill(victim)
        outcomes = ranks.outcomes()
    _raised_peer_error(ranks, outcomes, victim, killed_at)
