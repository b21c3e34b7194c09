"""Collectives on 1-4 ranks against exact pure-torch references.

Every rank regenerates every rank's input from (seed, rank) and checks its own result bitwise; the
test process then checks that all ranks ran the same cases and hold the same bits. Tiny slots
(1 KiB, 2 of them) and a 256-byte one-shot limit push a few hundred elements through every
one-shot/pipelined switch, several rounds and slot reuse.
"""
import glob
import os
import time

import pytest
import torch
import torch.distributed as dist
from braid import comm
from braid.comm import _C
from helpers import DTYPES, OPS, CaseLog, assert_ranks_agree, make_input, ops_for, reduce_reference
from helpers.ranks import (COMM_TIMEOUT_S, listen_ports, make_comm, new_store_path, open_store, process_group,
                           run_ranks)

WORLD_SIZES = (1, 2, 3, 4)
SLOT_BYTES, ONESHOT_MAX_BYTES, NSLOTS = 1024, 256, 2
TINY = {"slot_bytes": SLOT_BYTES, "oneshot_max_bytes": ONESHOT_MAX_BYTES, "nslots": NSLOTS}
SMALL_COUNTS = (0, 1, 2, 3, 7, 13, 31)
SENTINEL = 77  # written into outputs first, so unwritten elements show; no input takes this value
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT,
              "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
BITWISE_ENUMS = ("band", "bor", "bxor")


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _slot_elems(parts: int, elem_bytes: int) -> int:
    """Elements per piece when a slot is cut in ``parts`` (braid's slot_elems, two_shot.cc)."""
    e = SLOT_BYTES // (parts * elem_bytes)
    return e - e % 16 if e >= 64 else e


def boundary_counts(kind: str, n: int, dtype: torch.dtype, algo: str = "auto") -> list:
    """Element counts around every switch of ``kind`` on ``n`` ranks: the one-shot limit, one and
    two pipelined rounds and nslots + 1 rounds (the first slot reuse), each -1/0/+1, plus small
    counts. For reduce_scatter the count is the per-rank output."""
    es = _elem_size(dtype)
    if kind == "all_reduce":
        oneshot = ONESHOT_MAX_BYTES // es
        if algo == "ring":  # ring chunks hold the accumulator type: float32 for half types
            block = n * _slot_elems(1, 8 if es == 8 else 4)
        else:
            block = n * _slot_elems(n + 1, es)
    elif kind == "reduce_scatter":
        oneshot = ONESHOT_MAX_BYTES // (n * es)
        block = _slot_elems(n, es)
    else:
        oneshot = ONESHOT_MAX_BYTES // es
        block = _slot_elems(1, es)
    marks = (oneshot, block, 2 * block, (NSLOTS + 1) * block)
    return sorted(set(SMALL_COUNTS) | {m + d for m in marks for d in (-1, 0, 1)})


def _filled(count: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((count,), SENTINEL, dtype=dtype)


def ring_reference(inputs, op: str, n: int) -> torch.Tensor:
    """The ring's result: rounds of n chunks; chunk c of a round is reduced in the rank order
    c, c+1, ..., c+n-1 (mod n), half types accumulated in float32 and rounded once."""
    es = inputs[0].element_size()
    chunk = _slot_elems(1, 8 if es == 8 else 4)  # ring slots hold the accumulator type
    out = torch.empty_like(inputs[0])
    for off in range(0, out.numel(), n * chunk):
        block = min(n * chunk, out.numel() - off)
        per = -(-block // n)
        for c in range(n):
            part = slice(off + min(c * per, block), off + min((c + 1) * per, block))
            out[part] = reduce_reference([inputs[(c + k) % n][part] for k in range(n)], op, n)
    return out


# ----------------------------------------------------------------------------------------------
# Rank functions (module level: they travel to the ranks by pickle).

def all_reduce_grid(rank, n, store_path, seed):
    log = CaseLog()
    # "oneshot" forced: messages over the one-shot buffer still go two-shot. Two-shot runs both
    # schedules (lockstep and skewed rounds) whatever the host's default.
    schedules = (("auto", None), ("oneshot", None), ("twoshot", False), ("twoshot", True), ("ring", None))
    for algo, skew in schedules:
        reference = ring_reference if algo == "ring" else reduce_reference
        if skew is not None:
            algo_label = f"{algo} {'skewed' if skew else 'lockstep'}"
        else:
            algo_label = algo
        with make_comm(rank, n, store_path, algo=algo, skew_rounds=skew, **TINY) as c:
            for dtype in DTYPES:
                for count in boundary_counts("all_reduce", n, dtype, algo):
                    inputs = [make_input(seed, r, count, dtype) for r in range(n)]
                    for op in ops_for(dtype):
                        t = inputs[rank].clone()
                        c.all_reduce(t, op=op)
                        log.check(f"{algo_label} {dtype} count {count} {op}", t, reference(inputs, op, n))
            # Integral values are exact in any order: the ring must also match the rank-ordered
            # reference on them (its order is an implementation choice, exactness is not).
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                inputs = [make_input(seed, r, 3001, dtype, integral=True) for r in range(n)]
                t = inputs[rank].clone()
                c.all_reduce(t, op="avg")
                log.check(f"{algo_label} {dtype} integral avg", t, reduce_reference(inputs, "avg", n))
    return log.summary()


def _tunables(stream: bool) -> dict:
    """The tiny test tunables; ``stream`` writes every output with non-temporal stores."""
    return dict(TINY, stream_min_bytes=0) if stream else TINY


def _output(count: int, dtype: torch.dtype, misaligned: bool) -> torch.Tensor:
    """A sentinel-filled output; ``misaligned`` starts it one element into its storage, so that
    streaming copies run their unaligned head and tail."""
    return _filled(count + 1, dtype)[1:] if misaligned else _filled(count, dtype)


def reduce_scatter_grid(rank, n, store_path, seed, stream=False):
    log = CaseLog()
    with make_comm(rank, n, store_path, **_tunables(stream)) as c:
        for dtype in DTYPES:
            for m in boundary_counts("reduce_scatter", n, dtype):
                inputs = [make_input(seed, r, n * m, dtype) for r in range(n)]
                mine = slice(rank * m, (rank + 1) * m)
                for op in ops_for(dtype):
                    expected = reduce_reference(inputs, op, n)[mine]
                    inp, out = inputs[rank].clone(), _output(m, dtype, stream)
                    c.reduce_scatter(out, inp, op=op)
                    log.check(f"{dtype} m {m} {op}", out, expected, rank_specific=True)
                    log.check(f"{dtype} m {m} {op}: input untouched", inp, inputs[rank], rank_specific=True)
                    buf = inputs[rank].clone()
                    c.reduce_scatter(buf[mine], buf, op=op)
                    log.check(f"{dtype} m {m} {op} in place", buf[mine], expected, rank_specific=True)
    return log.summary()


def all_gather_grid(rank, n, store_path, seed, stream=False):
    log = CaseLog()
    with make_comm(rank, n, store_path, **_tunables(stream)) as c:
        for dtype in DTYPES:
            for m in boundary_counts("all_gather", n, dtype):
                inputs = [make_input(seed, r, m, dtype) for r in range(n)]
                expected = torch.cat(inputs)
                inp, out = inputs[rank].clone(), _output(n * m, dtype, stream)
                c.all_gather(out, inp)
                log.check(f"{dtype} m {m}", out, expected)
                log.check(f"{dtype} m {m}: input untouched", inp, inputs[rank], rank_specific=True)
                out = _output(n * m, dtype, stream)
                mine = out[rank * m:(rank + 1) * m]
                mine.copy_(inputs[rank])
                c.all_gather(out, mine)
                log.check(f"{dtype} m {m} in place", out, expected)
    return log.summary()


def broadcast_grid(rank, n, store_path, seed, stream=False):
    log = CaseLog()
    with make_comm(rank, n, store_path, **_tunables(stream)) as c:
        for dtype in DTYPES:
            for count in boundary_counts("broadcast", n, dtype):
                inputs = [make_input(seed, r, count, dtype) for r in range(n)]
                for src in range(n):
                    t = _output(count, dtype, stream)
                    t.copy_(inputs[rank])
                    c.broadcast(t, src=src)
                    log.check(f"{dtype} count {count} src {src}", t, inputs[src])
    return log.summary()


def non_contiguous(rank, n, store_path, seed):
    log = CaseLog()
    with make_comm(rank, n, store_path, **TINY) as c:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for count in (13, 700):  # one-shot, and several pipelined rounds for every dtype
                what = f"{dtype} count {count}"
                # all_reduce of a transposed view
                grids = [make_input(seed, r, 3 * count, dtype).view(3, count) for r in range(n)]
                t = grids[rank].clone().t()
                log.expect(f"{what}: transposed view is non-contiguous", not t.is_contiguous())
                c.all_reduce(t)
                expected = reduce_reference([g.t() for g in grids], "sum", n)
                log.check(f"{what} all_reduce transposed", t, expected)
                # all_reduce of every other element: the gaps must stay as they were
                flats = [make_input(seed + 1, r, 2 * count, dtype) for r in range(n)]
                base = flats[rank].clone()
                c.all_reduce(base[::2], op="max")
                log.check(f"{what} all_reduce strided", base[::2],
                          reduce_reference([f[::2] for f in flats], "max", n))
                log.check(f"{what} all_reduce strided: gaps", base[1::2], flats[rank][1::2],
                          rank_specific=True)
                # reduce_scatter: transposed input, strided output
                inputs = [make_input(seed + 2, r, n * count, dtype).view(count, n).t() for r in range(n)]
                out_base = _filled(2 * count, dtype)
                c.reduce_scatter(out_base[::2], inputs[rank].clone())
                mine = slice(rank * count, (rank + 1) * count)
                expected = reduce_reference([x.reshape(-1) for x in inputs], "sum", n)[mine]
                log.check(f"{what} reduce_scatter", out_base[::2], expected, rank_specific=True)
                log.check(f"{what} reduce_scatter: gaps", out_base[1::2], _filled(count, dtype),
                          rank_specific=True)
                # all_gather: strided input, strided output
                inputs = [make_input(seed + 3, r, 2 * count, dtype)[::2] for r in range(n)]
                out_base = _filled(2 * n * count, dtype)
                c.all_gather(out_base[::2], inputs[rank])
                log.check(f"{what} all_gather", out_base[::2], torch.cat(inputs))
                log.check(f"{what} all_gather: gaps", out_base[1::2], _filled(n * count, dtype))
                # broadcast of a strided view from the last rank
                base = make_input(seed + 4, rank, 2 * count, dtype)
                gaps = base[1::2].clone()
                c.broadcast(base[::2], src=n - 1)
                log.check(f"{what} broadcast", base[::2], make_input(seed + 4, n - 1, 2 * count, dtype)[::2])
                log.check(f"{what} broadcast: gaps", base[1::2], gaps, rank_specific=True)
    return log.summary()


def _issue(c, kind, i, rank, n, seed):
    """Issues async collective number ``i``; returns (what, work, outputs, expected outputs)."""
    dtype = (torch.float32, torch.bfloat16, torch.int32)[i % 3]
    count = (1, 300, 1001)[(i // 3) % 3]
    inputs = [make_input(seed + i, r, count, dtype) for r in range(n)]
    what = f"#{i} {kind} {dtype} count {count}"
    if kind == "all_reduce":
        # A strided view: reduced in a contiguous copy that the progress thread copies back.
        t = torch.stack([inputs[rank], inputs[rank]], dim=1)[:, 0]
        return what, c.all_reduce(t, op="avg", async_op=True), [t], [reduce_reference(inputs, "avg", n)]
    if kind == "reduce_scatter":
        full = [make_input(seed + i, r, n * count, dtype) for r in range(n)]
        out = _filled(count, dtype)
        expected = reduce_reference(full, "sum", n)[rank * count:(rank + 1) * count]
        # The input is a temporary: braid must keep it alive until the work has run.
        return what, c.reduce_scatter(out, full[rank].clone(), async_op=True), [out], [expected]
    if kind == "all_gather":
        out = _filled(n * count, dtype)
        return what, c.all_gather(out, inputs[rank], async_op=True), [out], [torch.cat(inputs)]
    if kind == "broadcast":
        t = inputs[rank].clone()
        return what, c.broadcast(t, src=i % n, async_op=True), [t], [inputs[i % n]]
    return what, c.barrier(async_op=True), [], []


def async_out_of_order(rank, n, store_path, seed):
    log = CaseLog()
    kinds = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")
    with make_comm(rank, n, store_path, **TINY) as c:
        issued = []
        for i in range(30):
            what, work, outs, expected = _issue(c, kinds[i % len(kinds)], i, rank, n, seed)
            # Half of the futures are taken while the work may still be queued, half after it ended.
            issued.append((what, work, outs, expected, work.get_future() if i % 2 else None))
            if i == 15:  # a blocking call among queued ones runs in issue order on every rank
                blocking = [make_input(seed, r, 500, torch.float64) for r in range(n)]
                t = blocking[rank].clone()
                c.all_reduce(t)
                log.check("blocking call between async ones", t, reduce_reference(blocking, "sum", n))
        # Each rank waits in its own order; results are checked in issue order (the digest's).
        order = torch.randperm(len(issued), generator=torch.Generator().manual_seed(rank)).tolist()
        values = {}
        for k in order:
            what, work, outs, expected, fut = issued[k]
            log.expect(f"{what}: wait() returns True", work.wait() is True)
            log.expect(f"{what}: completed and successful", work.is_completed() and work.is_success())
            values[k] = (fut or work.get_future()).wait()
        for k, (what, _, outs, expected, _) in enumerate(issued):
            value = values[k]
            same = len(value) == len(outs) and all(v.data_ptr() == o.data_ptr() for v, o in zip(value, outs))
            log.expect(f"{what}: future holds the output tensors", same, f"{len(value)} for {len(outs)}")
            for v, e in zip(value, expected):
                log.check(what, v, e, rank_specific=what.split()[1] == "reduce_scatter")
        # Futures chain like torch.distributed's (DDP comm hooks rely on it).
        inputs = [make_input(seed, r, 257, torch.float32) for r in range(n)]
        t = inputs[rank].clone()
        doubled = c.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2).wait()
        log.check("chained future", doubled, reduce_reference(inputs, "sum", n) * 2)
        log.expect("Work.wait(timeout) of finished work returns True",
                   c.barrier(async_op=True).wait(timeout=COMM_TIMEOUT_S) is True)
    return log.summary()


def semantics(rank, n, store_path, seed):
    log = CaseLog()
    store = open_store(store_path)
    with make_comm(rank, n, store_path, **TINY) as c:
        log.expect("rank/world_size", (c.rank, c.world_size) == (rank, n))
        log.expect("local_rank/local_world_size (one host)", (c.local_rank, c.local_world_size) == (rank, n))
        log.expect("not closed", not c.closed)
        log.expect("sync calls return None", c.barrier() is None)
        # ReduceOp enums mean what the strings mean.
        for dtype in (torch.float32, torch.float16, torch.int64):
            for count in (5, 400):
                inputs = [make_input(seed, r, count, dtype) for r in range(n)]
                for op, enum in REDUCE_OPS.items():
                    if op in BITWISE_ENUMS and dtype.is_floating_point:
                        continue
                    t = inputs[rank].clone()
                    c.all_reduce(t, op=enum)
                    log.check(f"{enum} {dtype} count {count}", t, reduce_reference(inputs, op, n))
        # Shapes other than 1-D: a scalar and a 3-D tensor.
        for shape in ((), (2, 3, 5)):
            inputs = [make_input(seed, r, 30, torch.float32)[:torch.Size(shape).numel()].reshape(shape)
                      for r in range(n)]
            t = inputs[rank].clone()
            c.all_reduce(t)
            log.check(f"shape {shape}", t, reduce_reference(inputs, "sum", n))
        # The barrier returns only once every rank has arrived: each rank counts itself in the
        # store before it and must see every rank counted after it.
        for i in range(5):
            store.add(f"before_barrier{i}", 1)
            c.barrier()
            arrived = store.add(f"before_barrier{i}", 0)
            log.expect(f"barrier {i}: every rank arrived", arrived == n, f"{arrived} of {n}")
        # The tuner's choice by size, and a forced algorithm.
        log.expect("auto, small: oneshot", c.all_reduce_algorithm(ONESHOT_MAX_BYTES) == "oneshot")
        log.expect("auto, large: twoshot", c.all_reduce_algorithm(ONESHOT_MAX_BYTES + 1) == "twoshot")
    log.expect("closed after close()", c.closed)
    c.close()  # idempotent
    with make_comm(rank, n, store_path, algo="ring", **TINY) as ring:
        chosen = {ring.all_reduce_algorithm(16), ring.all_reduce_algorithm(1 << 20)}
        log.expect("forced ring", chosen == {"ring"}, str(chosen))
    # Two communicators used alternately stay independent.
    a, b = make_comm(rank, n, store_path, **TINY), make_comm(rank, n, store_path, algo="ring", **TINY)
    for i in range(4):
        for name, cm, op in (("a", a, "sum"), ("b", b, "max")):
            inputs = [make_input(seed + i, r, 300, torch.int32) for r in range(n)]
            t = inputs[rank].clone()
            cm.all_reduce(t, op=op)
            log.check(f"interleaved communicator {name} #{i}", t, reduce_reference(inputs, op, n))
    a.close()
    b.close()
    return log.summary()


def close_with_queued_work(rank, n, store_path, seed):
    log = CaseLog()
    c = make_comm(rank, n, store_path, **TINY)
    issued = []
    for i in range(8):
        inputs = [make_input(seed + i, r, 97 * (i + 1), torch.float32) for r in range(n)]
        t = inputs[rank].clone()
        issued.append((i, c.all_reduce(t, async_op=True), t, reduce_reference(inputs, "sum", n)))
    c.close()  # at once: the queued collectives must still run, on every rank, in order
    for i, work, t, expected in issued:
        log.expect(f"#{i} completed by close()", work.is_completed() and work.is_success())
        log.check(f"#{i}", t, expected)
    return log.summary()


def shallowest_pipeline(rank, n, store_path, kind):
    """One collective of ``kind`` through the shallowest pipeline (nslots=2), several rounds long."""
    kind, _, schedule = kind.partition("-")  # "-skewed" / "-lockstep": force the round schedule
    skew = {"skewed": True, "lockstep": False, "": None}[schedule]
    algo = kind if kind in ("twoshot", "ring") else None
    log = CaseLog()
    with make_comm(rank, n, store_path, algo=algo, slot_bytes=SLOT_BYTES, oneshot_max_bytes=ONESHOT_MAX_BYTES,
                   nslots=2, skew_rounds=skew, timeout=3.0) as c:
        count = 2000  # float32: 8000 bytes, several 1 KiB slot rounds for every kind
        inputs = [make_input(9, r, count, torch.float32, integral=True) for r in range(n)]
        if kind in ("twoshot", "ring"):
            t = inputs[rank].clone()
            c.all_reduce(t)
            log.check(kind, t, reduce_reference(inputs, "sum", n))
        elif kind == "reduce_scatter":
            full = [make_input(9, r, n * count, torch.float32, integral=True) for r in range(n)]
            out = _filled(count, torch.float32)
            c.reduce_scatter(out, full[rank])
            expected = reduce_reference(full, "sum", n)[rank * count:(rank + 1) * count]
            log.check(kind, out, expected, rank_specific=True)
        elif kind == "all_gather":
            out = _filled(n * count, torch.float32)
            c.all_gather(out, inputs[rank])
            log.check(kind, out, torch.cat(inputs))
        else:
            t = inputs[rank].clone()
            c.broadcast(t, src=n - 1)
            log.check(kind, t, inputs[n - 1])
    return log.summary()


def reported_algorithm(rank, n, store_path, nbytes):
    """Rank 0 forces one-shot, rank 1 two-shot: a message over the one-shot limit must still meet."""
    algo = "oneshot" if rank == 0 else "twoshot"
    with make_comm(rank, n, store_path, algo=algo, **TINY) as c:
        inputs = [make_input(3, r, nbytes // 4, torch.float32) for r in range(n)]
        t = inputs[rank].clone()
        c.all_reduce(t)  # a CollectiveMismatch here would mean the ranks chose different algorithms
        return {"same": torch.equal(t, reduce_reference(inputs, "sum", n)),
                "reported": c.all_reduce_algorithm(nbytes)}


def wait_with_tiny_timeout(rank, n, store_path):
    """Rank 0's all_reduce cannot finish until rank 1 joins, which it does only after rank 0's
    wait(timeout=1e-12) has returned."""
    store = open_store(store_path)
    with make_comm(rank, n, store_path, timeout=2.0) as c:
        t = torch.ones(10)
        result = {}
        if rank == 0:
            work = c.all_reduce(t, async_op=True)
            start = time.monotonic()
            try:
                result["returned"] = work.wait(timeout=1e-12)
            except comm.CommError as e:
                result["returned"] = f"{type(e).__name__}: {e}"
            result["elapsed"] = time.monotonic() - start
            store.set("waited", "1")
            if result["returned"] is False:
                work.wait()
        else:
            store.wait(["waited"])
            try:
                c.all_reduce(t)
            except comm.CommError:
                pass  # rank 0 gave up already; its report tells the story
        return result


def default_tunables(rank, n, store_path, seed):
    log = CaseLog()
    # 300k float32 (1.2 MB): two-shot and the ring over the built-in 256 KiB slots, several rounds.
    for algo in ("auto", "ring"):
        with make_comm(rank, n, store_path, algo=algo) as c:
            inputs = [make_input(seed, r, 300_000, torch.float32, integral=True) for r in range(n)]
            t = inputs[rank].clone()
            c.all_reduce(t)
            log.check(f"{algo} default tunables", t, reduce_reference(inputs, "sum", n))
    return log.summary()


def init_from_env(rank, n, store_path, port):
    import os

    env = {"RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        c = comm.init(timeout=COMM_TIMEOUT_S)
        # A second init() in the same processes reuses the store rank 0 hosts (it once tried to
        # listen on the port again: EADDRINUSE).
        with comm.init(timeout=COMM_TIMEOUT_S) as second:
            t = torch.ones(3)
            second.all_reduce(t)
            assert t.tolist() == [float(n)] * 3
    finally:  # pooled worker: leave the environment as found
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    log = CaseLog()
    with c:
        log.expect("rank/world_size from the environment", (c.rank, c.world_size) == (rank, n))
        inputs = [make_input(7, r, 1000, torch.float32) for r in range(n)]
        t = inputs[rank].clone()
        c.all_reduce(t)
        log.check("all_reduce", t, reduce_reference(inputs, "sum", n))
    return log.summary()


def init_from_process_group(rank, n, store_path):
    log = CaseLog()
    with process_group(rank, n, store_path):
        with comm.init(timeout=COMM_TIMEOUT_S) as c:
            log.expect("rank/world_size from the process group",
                       (c.rank, c.world_size) == (dist.get_rank(), dist.get_world_size()))
            # Integral data: gloo's summation order is not braid's, and both are exact on it.
            inputs = [make_input(11, r, 1000, torch.float32, integral=True) for r in range(n)]
            ours, gloo = inputs[rank].clone(), inputs[rank].clone()
            c.all_reduce(ours)
            dist.all_reduce(gloo)
            log.check("braid and gloo agree", ours, gloo)
            log.check("all_reduce", ours, reduce_reference(inputs, "sum", n))
    return log.summary()


# ----------------------------------------------------------------------------------------------
# Tests

@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_reduce_matches_reference(n):
    """all_reduce for every dtype x op x algorithm (auto, forced one-shot, two-shot, ring) at every chunk
    boundary: bitwise equal to the reference in the algorithm's order, identical on all ranks."""
    assert_ranks_agree(run_ranks(all_reduce_grid, n, 1), min_cases=4 * len(DTYPES) * len(OPS))


@pytest.mark.parametrize("stream", (False, True), ids=("cached", "streaming"))
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_scatter_matches_reference(n, stream):
    """reduce_scatter out of place (input untouched) and in place (output = input's own slice), every
    dtype x op at every chunk boundary: rank r gets exactly slice r of the ordered reduction.
    "streaming" writes the output with non-temporal stores (stream_min_bytes=0), misaligned."""
    assert_ranks_agree(run_ranks(reduce_scatter_grid, n, 2, stream), min_cases=len(DTYPES) * len(OPS))


@pytest.mark.parametrize("stream", (False, True), ids=("cached", "streaming"))
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_gather_matches_reference(n, stream):
    """all_gather out of place and in place (input = output's own slice), every dtype, every chunk
    boundary: the output is every rank's input in rank order, every element written. "streaming"
    writes the output with non-temporal stores (stream_min_bytes=0) into misaligned memory."""
    assert_ranks_agree(run_ranks(all_gather_grid, n, 3, stream), min_cases=len(DTYPES))


@pytest.mark.parametrize("stream", (False, True), ids=("cached", "streaming"))
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_broadcast_from_every_rank(n, stream):
    """broadcast from every source rank, every dtype, every chunk boundary: each rank ends with the
    source's tensor; "streaming" as for all_gather."""
    assert_ranks_agree(run_ranks(broadcast_grid, n, 4, stream), min_cases=len(DTYPES) * n)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_non_contiguous_tensors(n):
    """Transposed and strided views go through contiguous copies: each collective gets the
    right values into the view and leaves the elements between strides untouched."""
    assert_ranks_agree(run_ranks(non_contiguous, n, 5), min_cases=30)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_async_waited_out_of_order(n):
    """30 async collectives of every kind in flight (plus a blocking one among them), waited in a
    different order on each rank: all succeed with the right values, futures hold the output tensors
    themselves and chain with then()."""
    assert_ranks_agree(run_ranks(async_out_of_order, n, 6), min_cases=30 * 3)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_semantics(n):
    """ReduceOp enums, scalar and 3-D shapes, barrier ordering, properties, the tuner's algorithm
    choice, idempotent close() and two interleaved communicators."""
    assert_ranks_agree(run_ranks(semantics, n, 8), min_cases=20)


@pytest.mark.parametrize("n", (2, 3))
def test_close_finishes_queued_work(n):
    """close() right after issuing async collectives runs them all to completion with the right
    values before it frees the communicator."""
    assert_ranks_agree(run_ranks(close_with_queued_work, n, 10), min_cases=16)


@pytest.mark.parametrize("kind", [
    "twoshot-skewed", "twoshot-lockstep",
    "ring",
    "reduce_scatter-skewed", "reduce_scatter-lockstep", "all_gather", "broadcast",
])
def test_shallowest_pipelines(kind):
    """nslots=2 (the smallest valid depth; the ring needs one slot to write while its neighbour
    reads the other): every pipelined algorithm completes, several rounds through its two slots,
    with exact results."""
    assert_ranks_agree(run_ranks(shallowest_pipeline, 3, kind))


def test_all_reduce_algorithm_reports_what_runs():
    """all_reduce_algorithm(nbytes) names what all_reduce runs: with one rank forcing one-shot and the
    other two-shot, a 1 KiB message (over the 256-byte one-shot limit) meets as two-shot on both
    (no mismatch), so both must report "twoshot"."""
    results = run_ranks(reported_algorithm, 2, 1024)
    assert all(r["same"] for r in results)
    assert [r["reported"] for r in results] == ["twoshot", "twoshot"]


def test_wait_with_sub_nanosecond_timeout_returns():
    """Work.wait(timeout=1e-12) on a collective that cannot finish yet returns False at once, like any
    other positive timeout."""
    result = run_ranks(wait_with_tiny_timeout, 2)[0]
    assert result["returned"] is False and result["elapsed"] < 1.0, result


@pytest.mark.parametrize("n", (2, 4))
def test_default_tunables_large_message(n):
    """The built-in slot size and depth (no test knobs) on a 1.2 MB all_reduce, two-shot and ring."""
    assert_ranks_agree(run_ranks(default_tunables, n, 12), min_cases=2)


def test_tunables_from_environment(monkeypatch):
    """BRAID_* variables set the tunables; a constructor argument overrides its variable."""
    monkeypatch.setenv("BRAID_ALGO", "ring")
    monkeypatch.setenv("BRAID_ONESHOT_MAX_BYTES", "100")
    with comm.Communicator(open_store(new_store_path()), 0, 1, timeout=5.0) as c:
        assert c.all_reduce_algorithm(10) == "ring"
    monkeypatch.setenv("BRAID_ALGO", "auto")
    with comm.Communicator(open_store(new_store_path()), 0, 1, timeout=5.0) as c:
        assert (c.all_reduce_algorithm(100), c.all_reduce_algorithm(101)) == ("oneshot", "twoshot")
    with comm.Communicator(open_store(new_store_path()), 0, 1, timeout=5.0, oneshot_max_bytes=1000) as c:
        assert c.all_reduce_algorithm(1000) == "oneshot"


def test_environment_sizes_take_suffixes(monkeypatch):
    """Byte-count variables accept K, M and G suffixes (powers of 1024, either case)."""
    for raw, value in (("512K", 512 << 10), ("3m", 3 << 20), ("1G", 1 << 30), ("4096", 4096)):
        monkeypatch.setenv("BRAID_SLOT_BYTES", raw)
        monkeypatch.setenv("BRAID_STREAM_MIN_BYTES", raw)
        t = _C.Tunables.from_env()
        assert (t.slot_bytes, t.stream_min_bytes) == (value, value), raw


def _last_level_cache_bytes() -> int:
    best_level, best = 0, 0
    for entry in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        with open(os.path.join(entry, "level")) as f:
            level = int(f.read())
        with open(os.path.join(entry, "size")) as f:
            raw = f.read().strip()
        size = int(raw.rstrip("KM")) << {"K": 10, "M": 20}.get(raw[-1], 0)
        if level > best_level:
            best_level, best = level, size
    return best


def test_streaming_threshold_shares_the_cache_among_local_ranks(monkeypatch):
    """By default outputs are streamed once all local ranks' outputs together exceed half the
    last-level cache; an explicit value is kept as given."""
    monkeypatch.delenv("BRAID_STREAM_MIN_BYTES", raising=False)
    llc = _last_level_cache_bytes()
    if llc == 0:
        pytest.skip("sysfs lists no CPU caches here")
    for n in (1, 2, 3, 4):
        t = _C.Tunables.from_env()
        assert t.stream_min_bytes == -1
        t.resolve(n)
        assert t.stream_min_bytes == llc // 2 // n
    t = _C.Tunables.from_env()
    t.stream_min_bytes = 12345
    t.resolve(4)
    assert t.stream_min_bytes == 12345


def test_oversubscription_is_judged_by_the_host_ranks_cpus_together():
    """Spin and skew default on when the host's ranks have a CPU each, judged by the union of their
    CPUs: ranks pinned one per core (as mpirun and taskset place them) see one CPU each but are not
    oversubscribed. A knob set by hand stays as set."""
    t = _C.Tunables()
    t.resolve(2, 2)
    assert (t.spin_us, t.skew_rounds) == (20.0, 1)
    t = _C.Tunables()
    t.resolve(4, 2)
    assert (t.spin_us, t.skew_rounds) == (0.0, 0)
    t = _C.Tunables()
    t.spin_us = 3.0
    t.resolve(4, 2)
    assert t.spin_us == 3.0


def pinned_tunables(rank, n, store_path, cpus):
    """The resolved spin and skew of a communicator made with this rank pinned to ``cpus[rank]``."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[rank]})
    try:
        with make_comm(rank, n, store_path) as c:
            t = torch.full((4,), float(rank))
            c.all_reduce(t)  # the resolved settings agree across the ranks: the collectives line up
            assert t.tolist() == [float(sum(range(n)))] * 4
            return c._c.tunables.spin_us, c._c.tunables.skew_rounds
    finally:
        os.sched_setaffinity(0, before)


def test_ranks_pinned_one_per_core_spin():
    """Two ranks pinned to two CPUs spin and skew; two pinned to one CPU do neither."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    for name in ("BRAID_SPIN_US", "BRAID_SKEW_ROUNDS"):
        if name in os.environ:
            pytest.skip(f"{name} is set in the environment")
    assert run_ranks(pinned_tunables, 2, cpus[:2]) == [(20.0, 1)] * 2
    assert run_ranks(pinned_tunables, 2, [cpus[0]] * 2) == [(0.0, 0)] * 2


def test_init_from_torchrun_environment():
    """comm.init() with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT only: rank 0 hosts a TCPStore and
    the ranks build a working communicator."""
    assert_ranks_agree(run_ranks(init_from_env, 2, listen_ports(1)[0]))


def test_init_from_default_process_group():
    """comm.init() inside an initialized gloo process group takes rank, size and store from it, and
    agrees with gloo's all_reduce."""
    assert_ranks_agree(run_ranks(init_from_process_group, 2))
