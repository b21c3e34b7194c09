"""all_to_all (equal and uneven splits) and compressed all_reduce on 1-4 ranks against exact
pure-torch references.

The compressed all-reduce is deterministic given its seeds, so each rank rebuilds the whole
pipeline in torch (quantize every rank's input, sum the decoded chunks in rank order,
re-quantize, decode) and compares bit for bit; the test process checks that all ranks hold the
same bits. Tiny slots push the all-to-all and all-gather through their pipelined paths.
"""
from datetime import timedelta

import numpy as np
import pytest
import torch
from braid.comm import Cast, Int4Quantizer, Int8Quantizer, TopK, WireStats, _C
from braid.comm.compression.compressors import _key_hash, _mix64
from braid.comm.core.wire import dense_wire_bytes
from helpers import CaseLog, assert_ranks_agree, make_input, outcome, reduce_reference
from helpers import compression_reference as ref
from helpers.ranks import make_comm, run_ranks

TINY = {"slot_bytes": 1024, "oneshot_max_bytes": 256, "nslots": 2}
KEY = "bucket"


def all_to_all_grid(rank, n, store_path, seed):
    log = CaseLog()
    # The last one writes every output with non-temporal stores (as messages beyond the cache).
    for tunables in ({}, TINY, dict(TINY, stream_min_bytes=1)):
        with make_comm(rank, n, store_path, **tunables) as c:
            for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
                for m in (0, 1, 2, 13, 61, 127, 257, 1031):
                    inputs = [make_input(seed, r, n * m, torch.int64).to(dtype) for r in range(n)]
                    out = torch.full((n * m,), 77, dtype=dtype)
                    inp = inputs[rank].clone()
                    c.all_to_all(out, inp)
                    expected = torch.cat([inputs[r][rank * m : (rank + 1) * m] for r in range(n)])
                    log.check(f"{tunables} {dtype} m {m}", out, expected, rank_specific=True)
                    log.check(
                        f"{tunables} {dtype} m {m}: input untouched", inp, inputs[rank], rank_specific=True
                    )
            w = c.all_to_all(torch.empty(4 * n), torch.full((4 * n,), float(rank)), async_op=True)
            w.wait()
    return log.summary()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_to_all_matches_reference(n):
    assert_ranks_agree(run_ranks(all_to_all_grid, n, 11), min_cases=100)


def _split_matrices(n, seed):
    """Rows rank i sends to rank j, S[i][j]: random (zeros included), one where each rank
    receives equal pieces (output_split_sizes left None), and one with a piece larger than the
    4 MiB a pair keeps in flight."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([0, 1, 2, 5, 17, 64])
    mats = []
    for _ in range(4):
        idx = torch.randint(0, len(choices), (n, n), generator=g)
        mats.append((choices[idx].tolist(), False))
    per_dest = [int(v) for v in torch.randint(0, 9, (n,), generator=g)]
    mats.append(([per_dest[:] for _ in range(n)], True))
    big = [[3] * n for _ in range(n)]
    big[0][n - 1] = 400_000  # 400,000 rows of 3 floats: 4.8 MB from rank 0 to rank n - 1
    mats.append((big, False))
    return mats


def _pieces(S, rank, n, dtype, seed, row):
    """Rank `rank`'s input: its pieces for every rank, seeded by (sender, receiver)."""
    return [make_input(seed * 31 + rank * 7 + j, rank, S[rank][j] * row, torch.int64).to(dtype).view(-1, row)
            for j in range(n)]


def uneven_all_to_all_grid(rank, n, store_path, seed, stream):
    log = CaseLog()
    row = 3
    # stream: received pieces are written with non-temporal stores, whatever their size.
    with make_comm(rank, n, store_path, **({"stream_min_bytes": 1} if stream else {})) as c:
        for case, (S, equal_out) in enumerate(_split_matrices(n, seed)):
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                if S[0][n - 1] > 1000 and dtype != torch.float32:
                    continue
                mine = _pieces(S, rank, n, dtype, seed, row)
                inp = torch.cat(mine)
                expected = torch.cat([_pieces(S, j, n, dtype, seed, row)[rank] for j in range(n)])
                out_splits = None if equal_out else [S[j][rank] for j in range(n)]
                out = torch.full_like(expected, 77)
                c.all_to_all(out, inp, output_split_sizes=out_splits, input_split_sizes=S[rank])
                log.check(f"case {case} {dtype}", out, expected, rank_specific=True)
                log.check(f"case {case} {dtype}: input untouched", inp, torch.cat(mine), rank_specific=True)
                # Split sizes as a tensor and as numpy integers: the same exchange.
                if case == 0 and dtype == torch.float32:
                    out2 = torch.full_like(expected, 77)
                    c.all_to_all(out2, inp, output_split_sizes=None if equal_out else np.array(out_splits),
                                 input_split_sizes=torch.tensor(S[rank]))
                    log.check(f"case {case}: splits as tensor / numpy", out2, expected, rank_specific=True)
                # Non-contiguous output (written through a staging buffer), async.
                strided = torch.full((row, expected.shape[0]), 77, dtype=dtype).t()
                w = c.all_to_all(strided, inp, True, output_split_sizes=out_splits, input_split_sizes=S[rank])
                w.wait()
                log.check(f"case {case} {dtype}: strided async", strided, expected, rank_specific=True)
        # Several in flight, waited in reverse order, between plain collectives.
        S = _split_matrices(n, seed + 1)[0][0]
        works, outs = [], []
        for k in range(4):
            inp = torch.cat(_pieces(S, rank, n, torch.float32, seed + k, row))
            outs.append(torch.empty(sum(S[j][rank] for j in range(n)), row))
            works.append(c.all_to_all(outs[-1], inp, True, output_split_sizes=[S[j][rank] for j in range(n)],
                                      input_split_sizes=S[rank]))
            t = torch.full((5,), float(rank))
            works.append(c.all_reduce(t, async_op=True))
            outs.append((t, torch.full((5,), float(sum(range(n))))))
        for w in reversed(works):
            w.wait()
        for k in range(4):
            expected = torch.cat([_pieces(S, j, n, torch.float32, seed + k, row)[rank] for j in range(n)])
            log.check(f"in flight {k}", outs[2 * k], expected, rank_specific=True)
            t, e = outs[2 * k + 1]
            log.check(f"in flight all_reduce {k}", t, e)
    return log.summary()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("stream", [False, True])
def test_uneven_all_to_all_matches_reference(n, stream):
    assert_ranks_agree(run_ranks(uneven_all_to_all_grid, n, 5, stream), min_cases=20)


def uneven_sizes_disagree(rank, n, store_path):
    """Rank 0 sends 3 rows to rank 1, which expects 2: the receiver raises CollectiveMismatch
    and the communicator is poisoned on every rank."""
    c = make_comm(rank, n, store_path)
    sends = [[1, 3], [2, 1]][rank]
    recvs = [[1, 2], [2, 1]][rank]  # rank 1 expects 2 rows from rank 0
    seen = [outcome(c.all_to_all, torch.empty(sum(recvs), 2), torch.zeros(sum(sends), 2),
                    output_split_sizes=recvs, input_split_sizes=sends),
            outcome(c.barrier)]
    c.close()
    return seen


def test_uneven_all_to_all_sizes_that_disagree_raise():
    r0, r1 = run_ranks(uneven_sizes_disagree, 2)
    assert r1[0]["type"] == "CollectiveMismatch" and "expected 16 bytes" in r1[0]["message"], r1
    # Rank 0's send may complete before rank 1 looks at it; its next call fails at the latest.
    assert r0[0]["type"] is not None or r0[1]["type"] is not None, r0
    assert all(e["type"] in (None, "CollectiveMismatch", "PeerError", "CommError") for e in r0), r0


def split_sizes_on_one_rank_only(rank, n, store_path):
    """Rank 0 passes split sizes (equal ones), the others none: different calls, which every
    rank must report as a mismatch at once instead of waiting for the deadline."""
    c = make_comm(rank, n, store_path, timeout=30.0)
    t = torch.arange(2 * n, dtype=torch.float32)
    if rank == 0:
        seen = outcome(c.all_to_all, torch.empty(2 * n), t, input_split_sizes=[2] * n,
                       output_split_sizes=[2] * n)
    else:
        seen = outcome(c.all_to_all, torch.empty(2 * n), t)
    c.close()
    return seen


@pytest.mark.parametrize("n", [2, 3])
def test_split_sizes_on_some_ranks_only_raise_a_mismatch(n):
    for seen in run_ranks(split_sizes_on_one_rank_only, n):
        assert seen["type"] == "CollectiveMismatch", seen
        assert "all_to_all with split sizes" in seen["message"], seen
        # At arrival, far below the 30 s deadline a missed detection would run into.
        assert seen["elapsed"] < 5.0, seen


def _seed(q, rank, call):
    return _mix64(q.seed, rank, _key_hash(KEY), call)


def _expected_quantized(q, inputs, residuals, op, n, call, dtype, divisor=None, ranks=None):
    """The quantized all-reduce in torch; returns (result, new residuals of every rank).
    ``ranks``: the communicator ranks of the n members (their seeds; across hosts a slice's
    members are the ranks of one local index); ``divisor``: what avg divides by when it is not
    the n members (across hosts: every rank)."""
    numel = inputs[0].numel()
    divisor = divisor or n
    ranks = ranks or list(range(n))
    chunk = q.chunk_elems(numel, n)
    cb = _C.quantized_bytes(chunk, q.bits, q.block)
    payloads, new_res = [], []
    for r in range(n):
        p, res = ref.quantize(
            inputs[r], residuals[r], q.bits, q.block, q.stochastic, _seed(q, ranks[r], call), chunk, n
        )
        payloads.append(p)
        new_res.append(res)
    gathered = []
    for j in range(n):
        acc = torch.zeros(chunk)
        for r in range(n):
            acc = acc + ref.dequantize(
                payloads[r][j * cb : (j + 1) * cb], chunk, q.bits, q.block, torch.float32
            )
        if op == "avg":
            acc = acc / torch.full_like(acc, divisor)
        seed = _mix64(_seed(q, ranks[j], call), 1)  # the owner's re-quantization
        p, _ = ref.quantize(acc, None, q.bits, q.block, q.stochastic, seed, index_base=j * chunk)
        gathered.append(p)
    return ref.dequantize(torch.cat(gathered), numel, q.bits, q.block, dtype, chunk), new_res


def _expected_top_k(q, inputs, residuals, op, n, dtype, divisor=None):
    """``divisor``: what avg divides by when it is not the n ranks summed (across hosts)."""
    numel = inputs[0].numel()
    divisor = divisor or n
    xs = [inputs[r].float() + residuals[r] for r in range(n)]
    if not q.sparse(numel, n, inputs[0].element_size()):
        return reduce_reference(xs, op, divisor).to(dtype), [torch.zeros(numel) for _ in range(n)]
    k = q.k(numel)
    acc = torch.zeros(numel)
    new_res = []
    for x in xs:
        # braid breaks ties in magnitude (common in bfloat16) toward the lower index: a stable sort
        idx = torch.argsort(-x.abs(), stable=True)[:k].sort().values
        acc.index_add_(0, idx, x[idx])
        res = x.clone()
        res[idx] = 0
        new_res.append(res)
    if op == "avg":
        acc.div_(divisor)
    return acc.to(dtype), new_res


def _expected_cast(q, inputs, residuals, op, n, dtype, divisor=None):
    xs = [inputs[r].float() + residuals[r] for r in range(n)]
    sent = [x.to(q.dtype) for x in xs]
    return reduce_reference(sent, op, divisor or n).to(dtype), [x - s.float() for x, s in zip(xs, sent)]


def _expected_wire(q, numel, n, elem_size):
    if isinstance(q, (Int8Quantizer, Int4Quantizer)):
        per_rank = (numel + n - 1) // n
        chunk = (per_rank + q.block - 1) // q.block * q.block
        values = chunk if q.bits == 8 else (chunk + 1) // 2
        return 2 * (n - 1) * (-(-values // 4) * 4 + 4 * (chunk // q.block))
    if isinstance(q, TopK):
        k = max(1, -(-numel * q.ratio // 1))
        if k * n * 8 <= numel * elem_size:
            return (n - 1) * 8 * int(k)
        return dense_wire_bytes(numel * 4, n)
    return dense_wire_bytes(numel * 2, n)


COMPRESSORS = {
    "int8": lambda: Int8Quantizer(seed=3),
    "int8-nearest-block64": lambda: Int8Quantizer(block=64, stochastic=False, seed=3),
    "int4": lambda: Int4Quantizer(seed=5),
    "int4-no-ef": lambda: Int4Quantizer(block=32, error_feedback=False),
    "topk": lambda: TopK(0.05),
    "topk-dense": lambda: TopK(0.5),
    "cast-bf16": lambda: Cast(torch.bfloat16),
    "cast-f16": lambda: Cast(torch.float16),
}


def compressed_grid(rank, n, store_path, seed, name):
    log = CaseLog()
    for tunables in ({}, TINY):
        with make_comm(rank, n, store_path, **tunables) as c:
            for dtype in (torch.float32, torch.bfloat16):
                for numel in (1, 13, 1000, 4099):
                    for op in ("avg", "sum"):
                        q = COMPRESSORS[name]()
                        what = f"{name} {tunables} {dtype} numel {numel} {op}"
                        residuals = [torch.zeros(numel) for _ in range(n)]
                        for call in range(4):
                            inputs = [make_input(seed + call, r, numel, dtype) for r in range(n)]
                            t = inputs[rank].clone()
                            c.all_reduce(t, op=op, compression=q, key=KEY)
                            if call < q.warmup_steps:  # warm-up: the exact all-reduce
                                log.check(f"{what} call {call}", t, reduce_reference(inputs, op, n))
                                continue
                            ef = q.error_feedback
                            base = residuals if ef else [torch.zeros(numel) for _ in range(n)]
                            if isinstance(q, (Int8Quantizer, Int4Quantizer)):
                                expected, new_res = _expected_quantized(
                                    q, inputs, base if ef else [None] * n, op, n, call, dtype
                                )
                            elif isinstance(q, TopK):
                                expected, new_res = _expected_top_k(q, inputs, base, op, n, dtype)
                            else:
                                expected, new_res = _expected_cast(q, inputs, base, op, n, dtype)
                            log.check(f"{what} call {call}", t, expected)
                            if ef:
                                residuals = new_res
                                log.check(
                                    f"{what} call {call} residual",
                                    q.residual(KEY),
                                    residuals[rank],
                                    rank_specific=True,
                                )
                            wire = c.last_wire_bytes
                            want = _expected_wire(q, numel, n, t.element_size())
                            log.expect(
                                f"{what} wire", wire.sent == want == wire.received, f"{wire} vs {want}"
                            )
                            log.expect(
                                f"{what} dense", wire.dense == dense_wire_bytes(numel * t.element_size(), n)
                            )
    return log.summary()


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("n", [2, 3])
def test_compressed_all_reduce_matches_reference(n, name):
    assert_ranks_agree(run_ranks(compressed_grid, n, 21, name), min_cases=50)


def async_and_ratio(rank, n, store_path):
    """Async compressed calls complete through wait() (a poll, a timedelta, no timeout) and futures
    in issue order; the wire ratio of a large tensor is what the format promises."""
    log = CaseLog()
    with make_comm(rank, n, store_path) as c:
        numel = 1 << 18
        for q, floor in ((Int8Quantizer(), 3.9), (Int4Quantizer(), 7.5), (TopK(0.01), 40 * 2 / n)):
            tensors = [make_input(7, rank, numel, torch.float32) for _ in range(4)]
            works = []
            for i, t in enumerate(tensors):
                for _ in range(2):  # warm-up
                    c.all_reduce(t.clone(), op="avg", compression=q, key=i)
                works.append(c.all_reduce(t, op="avg", compression=q, key=i, async_op=True))
            ratio = c.last_wire_bytes.ratio
            log.expect(f"{q} ratio {ratio:.2f} >= {floor}", ratio >= floor)
            futs = [w.get_future() for w in works[2:]]
            while not works[1].wait(0):  # a poll: True once the result is decoded into the tensor
                pass
            log.expect(f"{q} wait(timedelta)", works[0].wait(timedelta(seconds=60)) is True)
            done = "<braid.comm.CompressedWork all_reduce done>"
            log.expect(f"{q} repr {works[0]!r}", repr(works[0]) == done)
            for f, t in zip(futs, tensors[2:]):
                log.expect(f"{q} future value is the tensor", f.wait()[0] is t)
            for i, t in enumerate(tensors):
                log.check(f"{q} tensor {i}", t, t)  # digest: identical on every rank
    return log.summary()


@pytest.mark.parametrize("n", [2, 3])
def test_async_compressed_and_wire_ratio(n):
    assert_ranks_agree(run_ranks(async_and_ratio, n), min_cases=20)


def top_k_telescopes(rank, n, store_path):
    """With top-k and error feedback nothing is lost: n * (sum of averaged outputs) + the sum of
    every rank's final residual equals the sum of every rank's inputs (float32 rounding only)."""
    q = TopK(0.02, warmup_steps=2)
    out_total = torch.zeros(5000, dtype=torch.float64)
    in_total = torch.zeros(5000, dtype=torch.float64)
    with make_comm(rank, n, store_path) as c:
        for call in range(25):
            inputs = [make_input(100 + call, r, 5000, torch.float32) for r in range(n)]
            in_total += sum(x.double() for x in inputs)
            t = inputs[rank].clone()
            c.all_reduce(t, op="sum", compression=q, key=KEY)
            out_total += t.double()
        res = q.residual(KEY).clone()
        c.all_reduce(res, op="sum")
    err = (out_total + res.double() - in_total).abs().max().item()
    return err


def disagreeing_compressed_calls(rank, n, store_path):
    """After the warm-up, rank 1 differs in one way the payload size hides (the op; an element
    count that rounds to the same chunks or the same k; the input dtype): every rank raises
    CollectiveMismatch, as for plain collectives, instead of mixing the payloads."""
    from braid.comm import CollectiveMismatch

    seen = {}
    for name, make in (("int8", Int8Quantizer), ("int4", Int4Quantizer), ("topk", lambda: TopK(0.01))):
        for case in ("op", "size", "dtype"):
            with make_comm(rank, n, store_path) as c:
                q = make()
                for _ in range(2):
                    c.all_reduce(torch.ones(2000), op="avg", compression=q, key=KEY)
                size, op, dtype = 2000, "avg", torch.float32
                if rank == 1:
                    size, op, dtype = {"op": (2000, "sum", dtype), "size": (1990, op, dtype),
                                       "dtype": (2000, op, torch.bfloat16)}[case]
                try:
                    c.all_reduce(torch.ones(size, dtype=dtype), op=op, compression=q, key=KEY)
                    seen[f"{name} {case}"] = "no error"
                except CollectiveMismatch:
                    seen[f"{name} {case}"] = "mismatch"
                except Exception as e:  # noqa: BLE001 - reported
                    seen[f"{name} {case}"] = f"{type(e).__name__}: {e}"
    return seen


def test_disagreeing_compressed_calls_raise_a_mismatch():
    for seen in run_ranks(disagreeing_compressed_calls, 2):
        assert set(seen.values()) == {"mismatch"}, seen


def non_finite_once(rank, n, store_path):
    """One call whose input holds an inf (rank 0) or a value float16 cannot hold: that call's
    result is not finite (a loss scaler must see it), and every later call of the key is finite
    again (the residual once kept inf - inf = NaN and spoiled the tensor for good)."""
    seen = {}
    with make_comm(rank, n, store_path) as c:
        for q in (Int8Quantizer(warmup_steps=2), Int4Quantizer(warmup_steps=2), TopK(0.05, warmup_steps=2),
                  Cast(torch.float16, warmup_steps=2)):
            name = type(q).__name__
            for call in range(8):
                t = make_input(call, rank, 3000, torch.float32)
                if call == 3 and rank == 0:
                    t[17] = 1e6 if isinstance(q, Cast) else float("inf")  # 1e6 overflows float16
                c.all_reduce(t, op="avg", compression=q, key=KEY)
                seen[f"{name} {call}"] = bool(torch.isfinite(t).all())
            residual = q.residual(KEY)
            seen[f"{name} residual"] = bool(torch.isfinite(residual).all())
    return seen


def test_non_finite_gradient_does_not_stick_in_the_residual():
    for seen in run_ranks(non_finite_once, 2):
        for key, finite in seen.items():
            assert finite == (" 3" not in key), (key, seen)


@pytest.mark.parametrize("n", [2, 3])
def test_top_k_error_feedback_telescopes_across_ranks(n):
    errs = run_ranks(top_k_telescopes, n)
    assert max(errs) < 1e-3  # 25 float32 sums of values of order 10


def compressed_arguments(rank, n, store_path):
    """Bad compressed calls raise naming the argument; on one rank a compressed all-reduce is the
    exact one and sends nothing."""
    failures = []
    with make_comm(rank, n, store_path) as c:
        q = Int8Quantizer()
        for call, exc in (
            (lambda: c.all_reduce(torch.ones(4), op="max", compression=q), ValueError),
            (lambda: c.all_reduce(torch.ones(4, dtype=torch.int32), compression=q), TypeError),
            (lambda: c.all_reduce(torch.ones(4, dtype=torch.float64), compression=q), TypeError),
        ):
            try:
                call()
                failures.append(f"{exc.__name__} not raised")
            except exc:
                pass
        t = torch.arange(10, dtype=torch.float32)
        for _ in range(3):
            c.all_reduce(t, op="sum", compression=q)
        if not torch.equal(t, torch.arange(10, dtype=torch.float32)) or c.last_wire_bytes.sent != 0:
            failures.append(f"world of one: {t} {c.last_wire_bytes}")
        c.all_reduce(t)
        if c.last_wire_bytes is not None:
            failures.append("a plain all_reduce must reset last_wire_bytes")
    return failures


def test_compressed_arguments_and_world_of_one():
    assert run_ranks(compressed_arguments, 1) == [[]]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_wire_stats_of_the_hierarchical_paths(dtype):
    """Compressor.wire_stats, the one place wire statistics are computed, against the bytes each
    path moves written out: per host local ranks reduce-scatter and all-gather their slices exactly
    (2 (local - 1) slices of their dtype), and every slice is compressed among the hosts."""
    es = torch.tensor([], dtype=dtype).element_size()
    for numel, local, hosts in ((10_000, 2, 3), (4097, 3, 2), (64, 2, 2)):
        per = -(-numel // local)
        inside = 2 * (local - 1) * per * es
        dense = dense_wire_bytes(numel * es, local * hosts)
        for q in (Int8Quantizer(), Int4Quantizer(block=32)):
            chunk = q.chunk_elems(per, hosts)
            across = 2 * (hosts - 1) * q.wire_bytes(chunk)
            assert q.wire_stats(numel, es, hosts, local) == WireStats(across + inside, across + inside, dense)
        for ratio in (0.01, 0.6):  # sparse, then the dense fallback
            for ef in (True, False):
                q = TopK(ratio, error_feedback=ef)
                sparse = q.k(per) * hosts * 8 <= per * es
                for fused in (True, False):
                    fallback = 4 if ef or fused else es
                    across = (hosts - 1) * 8 * q.k(per) if sparse else dense_wire_bytes(per * fallback, hosts)
                    got = q.wire_stats(numel, es, hosts, local, float32_fallback=fused)
                    assert got == WireStats(across + inside, across + inside, dense), (ratio, ef, fused)
        q = Cast(torch.bfloat16)
        across = dense_wire_bytes(per * 2, hosts)
        assert q.wire_stats(numel, es, hosts, local) == WireStats(across + inside, across + inside, dense)
        assert q.wire_stats(numel, es, 1, local).sent == inside  # one host: nothing compressed


def fused_equals_generic(rank, n, store_path, seed):
    """The communicator's fused compressed all-reduce (its compressed_all_reduce capability) and
    the compressor's one algorithm over the group interface (GroupCarrier over the same
    Communicator) give the same bits, residuals included, warm-up and compressed calls alike."""
    from braid.comm.core.group_carrier import GroupCarrier

    log = CaseLog()
    with make_comm(rank, n, store_path) as c:
        carrier = GroupCarrier(c)
        makers = {"int8": lambda: Int8Quantizer(block=64),
                  "int8 nearest": lambda: Int8Quantizer(stochastic=False),
                  "int4": lambda: Int4Quantizer(block=32), "topk": lambda: TopK(0.02),
                  "topk dense": lambda: TopK(0.6), "bf16": lambda: Cast(torch.bfloat16)}
        for name, make in makers.items():
            for dtype in (torch.float32, torch.bfloat16):
                fused, generic = make(), make()
                for call in range(4):
                    x = make_input(seed + call, rank, 2053, dtype)
                    a, b = x.clone(), x.clone()
                    c.all_reduce(a, op="avg", compression=fused, key="k")
                    generic.all_reduce(carrier, b, "avg", key="k")
                    what = f"{name} {dtype} call {call}"
                    log.check(what, b, a)
                    if fused.residual("k") is not None:
                        log.check(f"{what} residual", generic.residual("k"), fused.residual("k"),
                                  rank_specific=True)
                    log.expect(f"{what} wire", fused.last_wire_bytes == generic.last_wire_bytes,
                               f"{fused.last_wire_bytes} vs {generic.last_wire_bytes}")
        return log.summary()


@pytest.mark.parametrize("n", (2, 3))
def test_fused_path_equals_the_algorithm_over_the_group_interface(n):
    assert_ranks_agree(run_ranks(fused_equals_generic, n, 71), min_cases=100)


def fp8_over_both_carriers(rank, n, store_path):
    """FP8Quantizer (no fused call) over a Communicator and over a gloo group: the same algorithm,
    so the same bits; within float8's rounding of the exact average; the Communicator records the
    wire bytes."""
    import torch.distributed as dist
    from helpers.ranks import process_group

    from braid.comm import FP8Quantizer

    log = CaseLog()
    with process_group(rank, n, store_path), make_comm(rank, n, store_path) as c:
        # Without error feedback, so that each call's error is its own rounding.
        a, b = FP8Quantizer(block=64, error_feedback=False), FP8Quantizer(block=64, error_feedback=False)
        for call in range(4):
            inputs = [make_input(11 + call, r, 3001, torch.float32) for r in range(n)]
            x, y = inputs[rank].clone(), inputs[rank].clone()
            c.all_reduce(x, op="avg", compression=a, key="k")
            b.all_reduce(dist.group.WORLD, y, "avg", key="k")
            log.check(f"call {call}: communicator equals gloo", x, y)
            exact = reduce_reference(inputs, "avg", n)
            if call < 2:
                log.check(f"call {call}: warm-up exact", x, exact)
                continue
            # Two roundings (each input, then the sum) of at most 1/16 of the value each, plus
            # subnormal steps near zero: a bound that a wrong sum, scale or piece breaks.
            bound = (sum(t.abs() for t in inputs) / n + exact.abs()) * (1 / 16 + 1e-6) + 1e-3
            log.expect(f"call {call}: near exact", bool(((x - exact).abs() <= bound).all()))
            log.expect(f"call {call}: wire", c.last_wire_bytes == a.last_wire_bytes
                       and a.last_wire_bytes.ratio > 3.5, f"{c.last_wire_bytes}")
        return log.summary()


def test_fp8_quantizer_over_a_communicator_and_a_process_group():
    assert_ranks_agree(run_ranks(fp8_over_both_carriers, 3), min_cases=10)
