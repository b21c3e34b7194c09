"""Long random schedules of mixed collectives on 2-4 ranks.

The other collective tests walk grids one kind at a time; here one seeded schedule (the same on
every rank) interleaves every kind, dtype, op and size class on two communicators used
alternately (one with the default algorithms, one forced onto the ring, both with small slots so
that most messages take several pipelined rounds, and other tunables drawn from the seed),
blocking and async calls mixed, async work waited in a different order on every rank,
compressed all-reduces among them. Every plain result must equal its reference bit for bit,
every result (compressed ones included) must be the same on all ranks, and nothing may hang.
``SOAK_STEPS=5000 pytest tests/test_soak.py`` runs longer schedules (default 200 operations
each, a few seconds in all).
"""
import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from braid.comm import Cast, CommError, Int8Quantizer, PeerError, TopK
from helpers import DTYPES, OPS, CaseLog, assert_ranks_agree, braid_segments, make_input, reduce_reference
from helpers.ranks import FreshRanks, make_comm, open_store, process_group, run_ranks

STEPS = int(os.environ.get("SOAK_STEPS", "200"))
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier", "compressed")
WEIGHTS = (6, 2, 2, 2, 1, 1, 2)
SENTINEL = 77


def _count(rng: random.Random) -> int:
    """Mostly a few hundred to a few thousand elements (several rounds of the tiny slots), some
    empty or tiny messages (one-shot), a few tens of thousands."""
    r = rng.random()
    if r < 0.15:
        return rng.choice((0, 1, 2, 3))
    if r < 0.55:
        return rng.randint(4, 400)
    if r < 0.95:
        return rng.randint(400, 6000)
    return rng.randint(6000, 50000)


def _tunables(rng: random.Random) -> dict:
    """Small slots (most messages take several rounds, slots are reused), drawn per schedule:
    pipeline depth, one-shot limit, streaming (non-temporal) outputs or not, skewed or lockstep
    two-shot rounds."""
    return {"slot_bytes": rng.choice((1024, 4096, 16384)), "nslots": rng.choice((2, 3, 4)),
            "oneshot_max_bytes": rng.choice((256, 2048)), "stream_min_bytes": rng.choice((0, None)),
            "skew_rounds": rng.choice((True, False))}


def _compressor(rng: random.Random):
    """A compressor for one key of a schedule: int8 (two block sizes), top-k (sparse or dense
    path) or a bfloat16 cast, each with error feedback and two exact warm-up calls."""
    kind = rng.choice(("int8", "topk", "cast"))
    if kind == "int8":
        return kind, Int8Quantizer(block=rng.choice((32, 256)), seed=rng.randint(0, 99), warmup_steps=2)
    if kind == "topk":
        return kind, TopK(rng.choice((0.05, 0.3)), warmup_steps=2)
    return kind, Cast(torch.bfloat16, warmup_steps=2)


def _uneven_all_to_all(rng, rank, n, count, make):
    """An all-to-all with split sizes drawn from ``rng``: rank r sends S[r][j] <= count elements
    to rank j; ``make(r, numel)`` is rank r's input. Returns (S, every rank's input, this rank's
    sentinel-filled output, its expected result)."""
    S = [[rng.randrange(count + 1) for _ in range(n)] for _ in range(n)]
    full = [make(r, sum(S[r])) for r in range(n)]
    expected = torch.cat([full[r][sum(S[r][:rank]):sum(S[r][:rank + 1])] for r in range(n)])
    return S, full, torch.full_like(expected, SENTINEL), expected


def _issue(c, rng, i, rank, n, seed, compressors, integral):
    """Issues operation ``i`` of the schedule. Returns (what, work or None, outputs, expected,
    rank_specific); expected None means only agreement across ranks is checked. ``integral``: the
    all-reduce inputs are whole numbers, whose reductions are exact in any order (the ring
    reduces each chunk in its own rotation of the ranks, not in rank order)."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    async_op = rng.random() < 0.5
    dtype = rng.choice(DTYPES)
    count = _count(rng)
    s = seed * 100003 + i
    if kind == "all_reduce":
        op = rng.choice(OPS)
        inputs = [make_input(s, r, count, dtype, integral=integral) for r in range(n)]
        t = inputs[rank].clone()
        if rng.random() < 0.2 and count > 1:  # a strided view
            base = torch.stack([t, t], dim=1)
            t = base[:, 1]
        work = c.all_reduce(t, op=op, async_op=async_op)
        return f"#{i} all_reduce {dtype} {count} {op}", work, [t], [reduce_reference(inputs, op, n)], False
    if kind == "reduce_scatter":
        op = rng.choice(OPS)
        full = [make_input(s, r, n * count, dtype) for r in range(n)]
        out = torch.full((count,), SENTINEL, dtype=dtype)
        expected = reduce_reference(full, op, n)[rank * count:(rank + 1) * count]
        work = c.reduce_scatter(out, full[rank].clone(), op=op, async_op=async_op)
        return f"#{i} reduce_scatter {dtype} {count} {op}", work, [out], [expected], True
    if kind == "all_gather":
        inputs = [make_input(s, r, count, dtype) for r in range(n)]
        out = torch.full((n * count,), SENTINEL, dtype=dtype)
        work = c.all_gather(out, inputs[rank], async_op=async_op)
        return f"#{i} all_gather {dtype} {count}", work, [out], [torch.cat(inputs)], False
    if kind == "broadcast":
        src = rng.randrange(n)
        inputs = [make_input(s, r, count, dtype) for r in range(n)]
        t = inputs[rank].clone()
        work = c.broadcast(t, src=src, async_op=async_op)
        return f"#{i} broadcast {dtype} {count} from {src}", work, [t], [inputs[src]], False
    if kind == "all_to_all":
        if rng.random() < 0.5:
            S, full, out, expected = _uneven_all_to_all(rng, rank, n, count,
                                                        lambda r, m: make_input(s, r, m, dtype))
            work = c.all_to_all(out, full[rank].clone(), async_op=async_op,
                                output_split_sizes=[S[r][rank] for r in range(n)], input_split_sizes=S[rank])
            return f"#{i} all_to_all {dtype} uneven {S}", work, [out], [expected], True
        full = [make_input(s, r, n * count, dtype) for r in range(n)]
        out = torch.full((n * count,), SENTINEL, dtype=dtype)
        expected = torch.cat([full[r][rank * count:(rank + 1) * count] for r in range(n)])
        work = c.all_to_all(out, full[rank].clone(), async_op=async_op)
        return f"#{i} all_to_all {dtype} {count}", work, [out], [expected], True
    if kind == "barrier":
        return f"#{i} barrier", c.barrier(async_op=async_op), [], [], False
    # Compressed: one compressor per key, reused, so residuals carry over (and are rebuilt when
    # the key's size changes); the result is checked for agreement across ranks only.
    key = f"k{rng.randrange(3)}"
    if key not in compressors:
        compressors[key] = _compressor(rng)
    name, q = compressors[key]
    dtype = rng.choice((torch.float32, torch.bfloat16))
    count = max(count, 1)
    t = make_input(s, rank, count, dtype)
    op = rng.choice(("sum", "avg"))
    work = c.all_reduce(t, op=op, compression=q, key=key, async_op=async_op)
    return f"#{i} {name} {key} {dtype} {count} {op}", work, [t], [None], False


def _play(rank, n, seed, rng, comms, log, before_step=lambda i: None, call_started=None):
    """Runs the schedule that ``rng`` draws (seeded alike on every rank, so the same schedule) on
    ``comms``, checking into ``log``. ``before_step(i)`` runs before operation i;
    ``call_started[0]`` is set to time.monotonic() before every call."""
    waits = random.Random(seed * 7919 + rank)  # each rank's own order of waiting
    started = call_started if call_started is not None else [0.0]
    compressors = [{}, {}]
    pending = []

    def check(what, outs, expected, rank_specific):
        for out, exp in zip(outs, expected):
            if exp is None:
                log.expect(f"{what}: finite", bool(torch.isfinite(out).all()))
                log.check(what, out, out)  # into the cross-rank digest
            else:
                log.check(what, out, exp, rank_specific=rank_specific)

    def finish(batch):
        for k in sorted(range(len(batch)), key=lambda _: waits.random()):
            what, work, _, _, _ = batch[k]
            started[0] = time.monotonic()
            log.expect(f"{what}: wait() returns True", work.wait() is True)
        for what, _, outs, expected, rank_specific in batch:
            check(what, outs, expected, rank_specific)

    for i in range(STEPS):
        before_step(i)
        which = rng.randrange(2)
        started[0] = time.monotonic()
        what, work, outs, expected, rank_specific = _issue(comms[which], rng, i, rank, n, seed,
                                                           compressors[which], integral=which == 1)
        if work is None:
            check(what, outs, expected, rank_specific)
        else:
            pending.append((what, work, outs, expected, rank_specific))
        if pending and rng.random() < 0.15:
            take = rng.randint(1, len(pending))
            finish(pending[:take])
            pending = pending[take:]
    finish(pending)


def _communicators(rank, n, store_path, rng, **kwargs):
    """The schedule's two communicators: default algorithms, and the ring; tunables from ``rng``."""
    return [make_comm(rank, n, store_path, **_tunables(rng), **kwargs),
            make_comm(rank, n, store_path, algo="ring", **_tunables(rng), **kwargs)]


def random_schedule(rank, n, store_path, seed):
    log = CaseLog()
    rng = random.Random(seed)
    comms = _communicators(rank, n, store_path, rng)
    try:
        _play(rank, n, seed, rng, comms, log)
    finally:
        for c in comms:
            c.close()
    return log.summary()


@pytest.mark.parametrize("n,seed", [(2, 1), (3, 2), (4, 3)])
def test_random_schedule(n, seed):
    assert_ranks_agree(run_ranks(random_schedule, n, seed), min_cases=STEPS)


# A dead peer must be reported "within about a second" (DESIGN section 5); as in test_failures.
DETECTION_LIMIT_S = 2.0


def schedule_with_death(rank, n, store_path, seed, victim, die_at):
    """The schedule of ``seed``, except that rank ``victim`` ends its process before operation
    ``die_at``, whatever it has in flight. Every other rank must raise PeerError from the first
    call that needs the victim, within the detection limit of that call's start or the death,
    whichever came later; then both communicators refuse work at once or raise too."""
    store = open_store(store_path)
    rng = random.Random(seed)
    comms = _communicators(rank, n, store_path, rng, timeout=30.0)
    started = [0.0]

    def before_step(i):
        if rank == victim and i == die_at:
            store.set("died", repr(time.monotonic()))
            os._exit(3)  # no close(): only the process ending tells the peers

    try:
        _play(rank, n, seed, rng, comms, CaseLog(), before_step, started)
    except CommError as e:
        raised = time.monotonic()
        died = float(store.get("died").decode())
        after = []
        for c in comms:
            try:
                c.all_reduce(torch.ones(3))
                after.append("returned")
            except CommError as later:
                after.append(type(later).__name__)
        return {"type": type(e).__name__, "message": str(e), "late_s": raised - max(started[0], died),
                "after": after, "leaked": braid_segments([os.getpid()])}
    finally:
        for c in comms:
            c.close()
    return {"type": None, "message": "the schedule finished without the victim"}


@pytest.mark.parametrize("n,seed", [(2, 11), (3, 12), (4, 13)])
@pytest.mark.slow
def test_peer_dies_anywhere_in_a_schedule(n, seed):
    """Each case kills a different rank at a different point of a schedule (in a pipelined round,
    among queued async work, in a compressed all-reduce, ...)."""
    rng = random.Random(seed)
    for case in range(2):
        victim, die_at = rng.randrange(n), rng.randrange(1, STEPS)
        with FreshRanks(n) as ranks:
            ranks.start(schedule_with_death, seed * 10 + case, victim, die_at)
            outcomes = ranks.outcomes()
        where = f"case {case}: rank {victim} dies before operation {die_at}"
        assert outcomes[victim] == ("died", 3), (where, outcomes[victim])
        for r in range(n):
            if r == victim:
                continue
            kind, seen = outcomes[r]
            assert kind == "ok", (where, r, kind, seen)
            assert seen["type"] == PeerError.__name__, (where, r, seen)
            assert seen["late_s"] < DETECTION_LIMIT_S, (where, r, seen)
            assert all(a != "returned" for a in seen["after"]), (where, r, seen)
            assert not seen["leaked"], (where, r, seen)


# -- the same through torch.distributed on the braid backend ------------------------------------
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "prod": dist.ReduceOp.PRODUCT}
# torch 2.13 renamed the tensor forms (the old names warn); older releases have only those.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
BACKEND_KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single",
                 "reduce_scatter_single", "reduce_scatter", "all_to_all_single", "gather", "scatter",
                 "send_recv", "ring_exchange", "barrier")


def _backend_op(rng, i, rank, n, seed):
    """Operation ``i`` through torch.distributed: returns (what, work or None, outputs, expected).
    Inputs are whole numbers, so every reduction is exact in any order; products stay small."""
    kind = rng.choice(BACKEND_KINDS)
    dtype = rng.choice(DTYPES)
    count = _count(rng)
    async_op = rng.random() < 0.5
    s = seed * 100003 + i

    def x(r, numel=count, salt=0):
        return make_input(s + salt, r, numel, dtype, integral=True)

    what = f"#{i} {kind} {dtype} {count}"
    if kind == "all_reduce":
        op = rng.choice(tuple(REDUCE_OPS))
        t = x(rank)
        return what + f" {op}", dist.all_reduce(t, op=REDUCE_OPS[op], async_op=async_op), [t], \
            [reduce_reference([x(r) for r in range(n)], op, n)]
    if kind == "broadcast":
        src = rng.randrange(n)
        t = x(rank)
        return what + f" from {src}", dist.broadcast(t, src, async_op=async_op), [t], [x(src)]
    if kind == "reduce":
        dst, op = rng.randrange(n), rng.choice(tuple(REDUCE_OPS))
        t = x(rank)
        work = dist.reduce(t, dst, op=REDUCE_OPS[op], async_op=async_op)
        return what + f" {op} to {dst}", work, [t] if rank == dst else [], \
            [reduce_reference([x(r) for r in range(n)], op, n)]
    if kind == "all_gather":
        outs = [torch.full((count,), SENTINEL, dtype=dtype) for _ in range(n)]
        return what, dist.all_gather(outs, x(rank), async_op=async_op), outs, [x(r) for r in range(n)]
    if kind == "all_gather_single":
        out = torch.full((n * count,), SENTINEL, dtype=dtype)
        work = ALL_GATHER_SINGLE(out, x(rank), async_op=async_op)
        return what, work, [out], [torch.cat([x(r) for r in range(n)])]
    if kind in ("reduce_scatter_single", "reduce_scatter"):
        op = rng.choice(tuple(REDUCE_OPS))
        full = [x(r, n * count) for r in range(n)]
        out = torch.full((count,), SENTINEL, dtype=dtype)
        if kind == "reduce_scatter":
            pieces = list(full[rank].chunk(n)) if count else [torch.empty(0, dtype=dtype)] * n
            work = dist.reduce_scatter(out, pieces, op=REDUCE_OPS[op], async_op=async_op)
        else:
            work = REDUCE_SCATTER_SINGLE(out, full[rank], op=REDUCE_OPS[op], async_op=async_op)
        expected = reduce_reference(full, op, n)[rank * count:(rank + 1) * count]
        return what + f" {op}", work, [out], [expected]
    if kind == "all_to_all_single":
        if rng.random() < 0.5:
            S, full, out, expected = _uneven_all_to_all(rng, rank, n, count, x)
            work = dist.all_to_all_single(out, full[rank], [S[r][rank] for r in range(n)], S[rank],
                                          async_op=async_op)
            return what + f" uneven {S}", work, [out], [expected]
        full = [x(r, n * count) for r in range(n)]
        out = torch.full((n * count,), SENTINEL, dtype=dtype)
        work = dist.all_to_all_single(out, full[rank], async_op=async_op)
        return what, work, [out], [torch.cat([full[r][rank * count:(rank + 1) * count] for r in range(n)])]
    if kind == "gather":
        dst = rng.randrange(n)
        outs = [torch.full((count,), SENTINEL, dtype=dtype) for _ in range(n)] if rank == dst else None
        work = dist.gather(x(rank), outs, dst=dst, async_op=async_op)
        return what + f" to {dst}", work, outs or [], [x(r) for r in range(n)]
    if kind == "scatter":
        src = rng.randrange(n)
        out = torch.full((count,), SENTINEL, dtype=dtype)
        pieces = [x(r, salt=1) for r in range(n)] if rank == src else None
        work = dist.scatter(out, pieces, src=src, async_op=async_op)
        return what + f" from {src}", work, [out], [x(rank, salt=1)]
    if kind == "send_recv":
        a, b = rng.sample(range(n), 2) if n > 1 else (0, 0)
        if n == 1 or rank not in (a, b):
            return what + " (not a party)", None, [], []
        if rank == a:
            dist.send(x(a), b)
            return what + f" {a} -> {b}", None, [], []
        t = torch.full((count,), SENTINEL, dtype=dtype)
        dist.recv(t, a)
        return what + f" {a} -> {b}", None, [t], [x(a)]
    if kind == "ring_exchange":
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        got = torch.full((count,), SENTINEL, dtype=dtype)
        ops = [dist.P2POp(dist.isend, x(rank), nxt), dist.P2POp(dist.irecv, got, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return what, None, [got], [x(prv)]
    return f"#{i} barrier", dist.barrier(async_op=async_op), [], []


def backend_schedule(rank, n, store_path, seed):
    log = CaseLog()
    rng = random.Random(seed)
    waits = random.Random(seed * 7919 + rank)
    pending = []

    def finish(batch):
        for k in sorted(range(len(batch)), key=lambda _: waits.random()):
            batch[k][1].wait()
        for what, _, outs, expected in batch:
            for out, exp in zip(outs, expected):
                log.check(what, out, exp, rank_specific=True)

    with process_group(rank, n, store_path, backend="braid"):
        for i in range(STEPS):
            what, work, outs, expected = _backend_op(rng, i, rank, n, seed)
            if work is None:
                for out, exp in zip(outs, expected):
                    log.check(what, out, exp, rank_specific=True)
            else:
                pending.append((what, work, outs, expected))
            if pending and rng.random() < 0.15:
                take = rng.randint(1, len(pending))
                finish(pending[:take])
                pending = pending[take:]
        finish(pending)
    return log.summary()


@pytest.mark.parametrize("n,seed", [(2, 21), (3, 22), (4, 23)])
def test_backend_random_schedule(n, seed):
    """Every c10d collective and point-to-point call braid implements, mixed as above."""
    summaries = run_ranks(backend_schedule, n, seed)
    failures = [f"rank {r}: {f}" for r, s in enumerate(summaries) for f in s["failures"]]
    assert not failures, "\n".join(failures[:20])
