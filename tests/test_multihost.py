"""Collectives across hosts, over TCP, against exact references.

Hosts are simulated on one machine with ``BRAID_HOST_ID`` (ranks with different ids talk over TCP
on loopback, ranks with equal ids through shared memory), so these run everywhere; the tests in
test_multihost_netns.py repeat the core of them between network namespaces. Tiny tunables (4 KiB
socket chunks, 1 KiB reduction pieces, a 256-byte small-message limit, tiny shm slots) push a few
thousand elements through every path: the leaders' one-shot, the owners' pieces, hierarchical
slices with padding, multi-chunk striping across sockets.

The promised order of an all_reduce across hosts: each host's ranks in rank order (the host's
partial result, rounded to the dtype), then the hosts in host order, with avg's division once,
by the number of all ranks.
"""

import os
import time

import pytest
import torch
from braid import comm
from helpers import DTYPES, CaseLog, assert_ranks_agree, make_input, ops_for, reduce_reference
from helpers.ranks import environment, make_comm, open_store, process_group, run_ranks

TINY_TCP = {"slot_bytes": 1024, "oneshot_max_bytes": 256, "nslots": 2}
TINY_ENV = {
    "BRAID_SOCKET_CHUNK_BYTES": "4096",
    "BRAID_CROSS_PIECE_BYTES": "1024",
    "BRAID_CROSS_ONESHOT_MAX_BYTES": "256",
    "BRAID_NSOCKS": "3",
}
# Layouts: host id of every rank. Two hosts of 1, 2 and 3 ranks, ranks of a host not consecutive,
# and three uneven hosts (2 + 1 + 1).
LAYOUTS = {
    "2x1": [0, 1],
    "2x2": [0, 0, 1, 1],
    "2x3": [0, 0, 0, 1, 1, 1],
    "2x2-interleaved": [0, 1, 0, 1],
    "2+1+1": [0, 0, 1, 2],
    "3x1": [0, 1, 2],
    "1+2+1-interleaved": [1, 0, 2, 1],  # uneven hosts whose ranks are not contiguous
    "5x1": [0, 1, 2, 3, 4],  # log-round algorithms with a host past a power of two
    "3x2": [0, 0, 1, 1, 2, 2],  # the ring between hosts inside the hierarchical algorithms
}
COUNTS = (0, 1, 2, 3, 7, 13, 63, 64, 65, 257, 1021, 1024 + 1, 4099, 12289)


def hosts_comm(rank, n, store_path, layout, tiny=True, rank_in=None, **kwargs):
    """A communicator whose ranks sit on the simulated hosts of ``layout``: by BRAID_HOST_ID, or,
    when the ranks really run on separate hosts (network namespaces: BRAID_TEST_REAL_HOSTS=1), by
    their own host identity. ``rank_in``: (rank, size) in a communicator over some of the ranks
    (give each such communicator its own ``prefix``)."""
    env = dict(TINY_ENV) if tiny else {}
    if os.environ.get("BRAID_TEST_REAL_HOSTS") != "1":
        env["BRAID_HOST_ID"] = f"host{layout[rank]}"
    rank, n = rank_in or (rank, n)
    with environment(env):
        return make_comm(rank, n, store_path, **(TINY_TCP if tiny else {}), **kwargs)


def hosts_of(layout):
    """Ranks of each host, hosts in order of their lowest rank."""
    order = []
    for h in layout:
        if h not in order:
            order.append(h)
    return [[r for r, x in enumerate(layout) if x == h] for h in order]


def cross_host_reference(inputs, op, layout):
    """The all_reduce result across hosts: host partials in rank order, then hosts in order."""
    host_op = "sum" if op == "avg" else op
    partials = [reduce_reference([inputs[r] for r in ranks], host_op, 1) for ranks in hosts_of(layout)]
    return reduce_reference(partials, op, len(layout))


def doubling_reference(parts, op, n):
    """Recursive doubling among ``parts`` (members in order): members p.. folded into the ones p
    below them (p the largest power of two <= the members), then pairs 2^k apart combined, the
    lower member's partial first, in the accumulator type; rounded once, avg divided by n."""
    acc_dtype = torch.float32 if parts[0].dtype in (torch.float16, torch.bfloat16) else parts[0].dtype
    step = "sum" if op == "avg" else op
    acc = [x.to(acc_dtype) for x in parts]
    p = 1 << (len(acc).bit_length() - 1)
    for e in range(len(acc) - p):
        acc[e] = reduce_reference([acc[e], acc[e + p]], step, 1)
    mask = 1
    while mask < p:
        acc = [reduce_reference([acc[min(i, i ^ mask)], acc[max(i, i ^ mask)]], step, 1) for i in range(p)]
        mask <<= 1
    return reduce_reference([acc[0]], op, n).to(parts[0].dtype)


def doubling_cross_host_reference(inputs, op, layout):
    """all_reduce with recursive doubling between the host leaders: host partials (rank order,
    rounded), then doubling among the hosts in host order."""
    host_op = "sum" if op == "avg" else op
    partials = [reduce_reference([inputs[r] for r in ranks], host_op, 1) for ranks in hosts_of(layout)]
    return doubling_reference(partials, op, len(layout))


def reduce_scatter_reference(inputs, op, layout, rank):
    """Rank ``rank``'s chunk of reduce_scatter across hosts: host partials (rank order, rounded),
    then the hosts: in host order at two hosts (direct), around the ring from three, where the
    block of host b is reduced in the host order b + 1, b + 2, ..., b (its owner last)."""
    hosts = hosts_of(layout)
    count = inputs[0].numel() // len(layout)
    mine = slice(rank * count, (rank + 1) * count)
    if len(hosts) <= 2:
        return cross_host_reference(inputs, op, layout)[mine]
    host_op = "sum" if op == "avg" else op
    partials = [reduce_reference([inputs[r][mine] for r in ranks], host_op, 1) for ranks in hosts]
    b = next(h for h, ranks in enumerate(hosts) if rank in ranks)
    return reduce_reference([partials[(b + 1 + j) % len(hosts)] for j in range(len(hosts))], op, len(layout))


def reference_of(algorithm):
    """The reference of the all_reduce order an algorithm across hosts promises."""
    return {"ring": ring_cross_host_reference, "doubling": doubling_cross_host_reference}.get(
        algorithm, cross_host_reference)


# ----------------------------------------------------------------------------------------------
# Rank functions.


def all_reduce_across_hosts(rank, n, store_path, layout, seed):
    log = CaseLog()
    with hosts_comm(rank, n, store_path, layout) as c:
        log.expect(
            "topology",
            (c.num_hosts, c.local_world_size) == (len(hosts_of(layout)), layout.count(layout[rank])),
            f"{c.num_hosts} {c.local_world_size}",
        )
        for dtype in DTYPES:
            for count in COUNTS:
                inputs = [make_input(seed, r, count, dtype) for r in range(n)]
                # Three hosts take the ring between hosts past the small sizes.
                reference = reference_of(c.all_reduce_algorithm(count * inputs[0].element_size()))
                for op in ops_for(dtype):
                    expected = reference(inputs, op, layout)
                    t = inputs[rank].clone()
                    c.all_reduce(t, op=op)
                    log.check(f"{dtype} count {count} {op}", t, expected)
                    out = inputs[rank].clone()
                    w = c.all_reduce(out, op=op, async_op=True)  # two in flight, in issue order
                    t2 = inputs[rank].clone()
                    w2 = c.all_reduce(t2, op=op, async_op=True)
                    w.wait()
                    w2.wait()
                    log.check(f"{dtype} count {count} {op} async", out, expected)
                    log.check(f"{dtype} count {count} {op} async 2", t2, expected)
    return log.summary()


def ring_reference(parts, op, n):
    """The ring between hosts over members' inputs ``parts``: chunk c (of len(parts)) reduced in
    the member order c, c + 1, ... (cyclic), in the accumulator type, rounded once, avg divided
    by the n ranks."""
    m, count = len(parts), parts[0].numel()
    out = torch.empty_like(parts[0])
    for c in range(m):
        lo, hi = count * c // m, count * (c + 1) // m
        out[lo:hi] = reduce_reference([parts[(c + j) % m][lo:hi] for j in range(m)], op, n)
    return out


def ring_cross_host_reference(inputs, op, layout):
    """all_reduce with the ring between hosts: host partials (rank order, rounded), then the ring
    among the hosts, of the whole message (leaders) or of each local index's slice (uniform hosts
    with several ranks: hierarchical)."""
    hosts = hosts_of(layout)
    host_op = "sum" if op == "avg" else op
    n, local, count = len(layout), len(hosts[0]), inputs[0].numel()
    if len({len(h) for h in hosts}) == 1 and local > 1:
        per = -(-count // local)
        padded = [torch.cat([x, torch.zeros(per * local - count, dtype=x.dtype)]) for x in inputs]
        partials = [reduce_reference([padded[r] for r in ranks], host_op, 1) for ranks in hosts]
        return torch.cat(
            [ring_reference([p[i * per : (i + 1) * per] for p in partials], op, n) for i in range(local)]
        )[:count]
    partials = [reduce_reference([inputs[r] for r in ranks], host_op, 1) for ranks in hosts]
    return ring_reference(partials, op, n)


def ring_across_hosts(rank, n, store_path, layout, algo, seed):
    """The ring between hosts (BRAID_ALGO=ring, or chosen for one rank on each of three hosts):
    every dtype and op at counts around the chunk and piece boundaries, exact against its order."""
    log = CaseLog()
    with hosts_comm(rank, n, store_path, layout, algo=algo) as c:
        log.expect("ring chosen", c.all_reduce_algorithm(1 << 20) == "ring", c.all_reduce_algorithm(1 << 20))
        for dtype in DTYPES:
            for count in (300, 767, 768, 769, 3001, 12289):  # past the one-shot limit: the ring
                inputs = [make_input(seed, r, count, dtype) for r in range(n)]
                for op in ops_for(dtype):
                    t = inputs[rank].clone()
                    c.all_reduce(t, op=op)
                    log.check(f"{dtype} count {count} {op}", t, ring_cross_host_reference(inputs, op, layout))
    return log.summary()


def forced_algorithms(rank, n, store_path, layout, seed):
    """BRAID_ALGO across hosts: each cross-host structure forced gives the same exact result at
    every size (the order does not depend on the structure), and the choice is reported."""
    log = CaseLog()
    uniform = len({layout.count(h) for h in layout}) == 1 and layout.count(layout[0]) > 1
    for algo in ("oneshot", "hierarchical", "leaders", "auto"):
        with hosts_comm(rank, n, store_path, layout, algo=algo) as c:
            want = {
                "oneshot": "oneshot",
                "leaders": "leaders",
                "hierarchical": "hierarchical" if uniform else "leaders",
            }.get(algo)
            if want is not None:
                log.expect(
                    f"{algo} reported",
                    c.all_reduce_algorithm(1 << 20) == want,
                    c.all_reduce_algorithm(1 << 20),
                )
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                for count in (0, 1, 5, 1021, 5003):
                    inputs = [make_input(seed, r, count, dtype) for r in range(n)]
                    for op in ("sum", "avg", "max"):
                        t = inputs[rank].clone()
                        c.all_reduce(t, op=op)
                        chosen = c.all_reduce_algorithm(count * inputs[0].element_size())
                        log.check(f"{algo} {dtype} {count} {op}", t, reference_of(chosen)(inputs, op, layout))
    return log.summary()


def algo_disagreement(rank, n, store_path, layout, trials):
    """`trials` communicators in turn, connections made on demand (the default), the last rank
    forcing another algorithm: each all_reduce's outcome on this rank."""
    from helpers import outcome

    seen = []
    for _ in range(trials):
        with hosts_comm(rank, n, store_path, layout, algo="leaders" if rank == n - 1 else "hierarchical",
                        timeout=30.0) as c:
            seen.append(outcome(c.all_reduce, torch.ones(10000)))
    return seen


def data_movement_across_hosts(rank, n, store_path, layout, seed):
    """all_gather, broadcast from every root, all_to_all (equal and uneven), reduce_scatter,
    point-to-point, barrier: each against the exact result."""
    log = CaseLog()
    with hosts_comm(rank, n, store_path, layout) as c:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for count in (0, 1, 5, 1031, 3000):
                inputs = [make_input(seed, r, count, dtype) for r in range(n)]
                out = torch.full((n * count,), 7, dtype=dtype)
                c.all_gather(out, inputs[rank])
                log.check(f"all_gather {dtype} {count}", out, torch.cat(inputs))
                for root in range(n):
                    t = inputs[rank].clone()
                    c.broadcast(t, src=root)
                    log.check(f"broadcast {dtype} {count} from {root}", t, inputs[root])
                chunks = [make_input(seed + 1, r, n * count, dtype) for r in range(n)]
                out = torch.full((n * count,), 7, dtype=dtype)
                c.all_to_all(out, chunks[rank])
                expected = torch.cat([chunks[r][rank * count : (rank + 1) * count] for r in range(n)])
                log.check(f"all_to_all {dtype} {count}", out, expected, rank_specific=True)
                for op in ("sum", "max", "avg"):
                    inp = [make_input(seed + 2, r, n * count, dtype) for r in range(n)]
                    out = torch.full((count,), 7, dtype=dtype)
                    c.reduce_scatter(out, inp[rank].clone(), op=op)
                    log.check(f"reduce_scatter {dtype} {count} {op}", out,
                              reduce_scatter_reference(inp, op, layout, rank), rank_specific=True)
        # Uneven all_to_all: rank i sends (i + j) % 3 + 1 rows to rank j.
        sizes_in = [(rank + j) % 3 + 1 for j in range(n)]
        sizes_out = [(j + rank) % 3 + 1 for j in range(n)]
        inp = torch.arange(sum(sizes_in), dtype=torch.float32) + 1000 * rank
        out = torch.empty(sum(sizes_out))
        c.all_to_all(out, inp, output_split_sizes=sizes_out, input_split_sizes=sizes_in)
        expected = []
        for j in range(n):
            theirs = [(j + k) % 3 + 1 for k in range(n)]
            start = sum(theirs[:rank])
            expected.append(torch.arange(start, start + theirs[rank], dtype=torch.float32) + 1000 * j)
        log.check("all_to_all uneven", out, torch.cat(expected), rank_specific=True)
        c.barrier()
    return log.summary()


def backend_across_hosts(rank, n, store_path, layout, name):
    """One of test_backend's rank functions with the braid backend's ranks on simulated hosts:
    torch.distributed's calls (point-to-point and batch_isend_irecv included), DDP, FSDP2 and
    DTensor against gloo in the same processes."""
    import test_backend

    env = dict(TINY_ENV)
    if os.environ.get("BRAID_TEST_REAL_HOSTS") != "1":
        env["BRAID_HOST_ID"] = f"host{layout[rank]}"
    with environment(env):
        return getattr(test_backend, name)(rank, n, store_path)


def module_across_hosts(rank, n, store_path, layout, module, name, *args):
    """One of test_zero's or test_tp's rank functions with its ranks on simulated hosts: braid's
    sharded wrapper (against DDP on gloo) and TP layers (against the dense model), unchanged."""
    import importlib

    env = dict(TINY_ENV)
    if os.environ.get("BRAID_TEST_REAL_HOSTS") != "1":
        env["BRAID_HOST_ID"] = f"host{layout[rank]}"
    with environment(env):
        return getattr(importlib.import_module(module), name)(rank, n, store_path, *args)


def compressed_across_hosts(rank, n, store_path, layout, seed):
    """Quantized and top-k all-reduces move their payloads with all_to_all and all_gather only:
    across hosts they give the same bits as on one host, step after step (error feedback
    included). The warm-up steps are exact all-reduces, in the cross-host order."""
    log = CaseLog()
    with hosts_comm(rank, n, store_path, layout) as across, make_comm(rank, n, store_path) as one_host:
        for make in (
            lambda: comm.Int8Quantizer(block=64, stochastic=False),
            lambda: comm.Int4Quantizer(block=32),
            lambda: comm.TopK(ratio=0.05),
        ):
            a, b = make(), make()
            for step in range(5):
                inputs = [make_input(seed + step, r, 3001, torch.float32) for r in range(n)]
                t1, t2 = inputs[rank].clone(), inputs[rank].clone()
                across.all_reduce(t1, op="avg", compression=a)
                one_host.all_reduce(t2, op="avg", compression=b)
                if step < a.warmup_steps:
                    exact = reference_of(across.all_reduce_algorithm(3001 * 4))
                    log.check(f"{type(a).__name__} warm-up step {step}", t1, exact(inputs, "avg", layout))
                else:
                    log.check(f"{type(a).__name__} step {step}", t1, t2)
    return log.summary()


def silent_host(rank, n, store_path, layout):
    """Rank 0 stays connected but never calls: its peer on the other host times out naming it."""
    from datetime import timedelta

    from helpers import outcome
    from helpers.ranks import open_store

    store = open_store(store_path)
    with hosts_comm(rank, n, store_path, layout, tiny=False, timeout=2.0) as c:
        c.barrier()
        if rank == 0:
            store.wait(["silent/done"], timedelta(seconds=30))  # alive, connected, silent
            return None
        result = outcome(c.all_reduce, torch.ones(10))
        store.set("silent/done", "1")
        return result


# ----------------------------------------------------------------------------------------------
# Tests.


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
def test_all_reduce_across_hosts(name):
    layout = LAYOUTS[name]
    assert_ranks_agree(run_ranks(all_reduce_across_hosts, len(layout), layout, 11), min_cases=100)


@pytest.mark.parametrize("name", ["2x2", "2+1+1"])
def test_forced_algorithms_across_hosts(name):
    layout = LAYOUTS[name]
    assert_ranks_agree(run_ranks(forced_algorithms, len(layout), layout, 13), min_cases=150)


@pytest.mark.parametrize("name,algo", [("3x1", "auto"), ("2+1+1", "ring"), ("2x2", "ring")])
def test_ring_between_hosts(name, algo):
    layout = LAYOUTS[name]
    assert_ranks_agree(run_ranks(ring_across_hosts, len(layout), layout, algo, 17), min_cases=100)


@pytest.mark.slow
def test_ranks_forcing_different_algorithms_raise_a_mismatch():
    """Ranks that disagree on BRAID_ALGO across hosts raise CollectiveMismatch (the algorithm is
    part of the descriptor) rather than mixing structures, every rank and every time. With
    connections on demand the disagreeing rank can find the mismatch on its host and leave before
    a counterpart's first connection to it, which its closed listener then refuses: the
    counterpart waits for the notice of the mismatch the rank sent before leaving. Before it did,
    that counterpart raised PeerError in about 1 trial of 10: 30 trials show it is gone."""
    layout = LAYOUTS["2x2"]
    for r, trials in enumerate(run_ranks(algo_disagreement, len(layout), layout, 30, deadline_s=240)):
        assert len(trials) == 30, r
        for t, seen in enumerate(trials):
            assert seen["type"] == "CollectiveMismatch", (r, t, seen)


@pytest.mark.parametrize("name", ["2x1", "2x2-interleaved", "2+1+1", "1+2+1-interleaved", "5x1", "3x2"])
def test_data_movement_across_hosts(name):
    layout = LAYOUTS[name]
    assert_ranks_agree(run_ranks(data_movement_across_hosts, len(layout), layout, 5), min_cases=50)


@pytest.mark.parametrize(
    "fn", ["_run_collectives", "_run_point_to_point", "_run_ddp_fsdp_dtensor", "_run_work_api_and_callbacks"]
)
@pytest.mark.parametrize("name", ["2x1", "2+1+1"])
def test_torch_distributed_backend_across_hosts(name, fn):
    layout = LAYOUTS[name]
    results = run_ranks(backend_across_hosts, len(layout), layout, fn)
    assert all(r is not False for r in results), results


def _expected_between_hosts(q, inputs, residuals, op, layout, call, dtype):
    """A compressed all-reduce across uniform hosts in torch: host sums (rank order, rounded to
    the dtype, zero padded to a multiple of the local ranks), slice i of every host compressed by
    the rank of local index i (its own seed and residual) and all-reduced among those ranks as the
    flat compressed all-reduce does, avg divided by all ranks. Returns (result, residuals)."""
    from test_compressed_collectives import _expected_cast, _expected_quantized, _expected_top_k

    hosts = hosts_of(layout)
    n, local, nhosts, numel = len(layout), len(hosts[0]), len(hosts), inputs[0].numel()
    per = -(-numel // local)
    padded = [torch.cat([x, torch.zeros(per * local - numel, dtype=dtype)]) for x in inputs]
    host_sum = [reduce_reference([padded[r] for r in ranks], "sum", 1) for ranks in hosts]
    out, new_res = torch.empty(per * local, dtype=dtype), list(residuals)
    for i in range(local):
        owners = [ranks[i] for ranks in hosts]
        slices = [host_sum[h][i * per : (i + 1) * per] for h in range(nhosts)]
        owned = [residuals[r] if residuals[r] is not None else torch.zeros(per) for r in owners]
        if isinstance(q, comm.TopK):
            out[i * per : (i + 1) * per], res = _expected_top_k(
                q, slices, owned, op, nhosts, dtype, divisor=n
            )
        elif isinstance(q, comm.Cast):
            out[i * per : (i + 1) * per], res = _expected_cast(q, slices, owned, op, nhosts, dtype, divisor=n)
        else:
            out[i * per : (i + 1) * per], res = _expected_quantized(
                q, slices, [residuals[r] for r in owners], op, nhosts, call, dtype, divisor=n, ranks=owners
            )
        for h, r in enumerate(owners):
            new_res[r] = res[h]
    return out[:numel], new_res


COMPRESSED_BETWEEN_HOSTS = {
    "int8": lambda: comm.Int8Quantizer(block=64, seed=3),
    "int4": lambda: comm.Int4Quantizer(block=32, seed=5),
    "int8-nearest-no-ef": lambda: comm.Int8Quantizer(block=64, stochastic=False, error_feedback=False),
    "topk": lambda: comm.TopK(0.05),
    "topk-dense": lambda: comm.TopK(0.5),
    "cast-bf16": lambda: comm.Cast(torch.bfloat16),
    "cast-f16-no-ef": lambda: comm.Cast(torch.float16, error_feedback=False),
}


def compressed_between_hosts(rank, n, store_path, layout, seed, names):
    """Across uniform hosts with several ranks each, compressed all-reduces are exact on each
    host and compressed only between hosts: every call equals the torch reference bit for bit
    (sizes that do not divide, both ops, float32 and bfloat16, error feedback carried over
    calls, async calls), and the residuals are the slices'."""
    from test_compressed_collectives import KEY

    log = CaseLog()
    with hosts_comm(rank, n, store_path, layout) as c:
        for name in names:
            for dtype in (torch.float32, torch.bfloat16):
                for numel in (1, 13, 1000, 4099):
                    for op in ("avg", "sum"):
                        q = COMPRESSED_BETWEEN_HOSTS[name]()
                        local = layout.count(layout[rank])
                        per = -(-numel // local)
                        residuals = [torch.zeros(per) for _ in range(n)]
                        what = f"{name} {dtype} numel {numel} {op}"
                        for call in range(4):
                            inputs = [make_input(seed + call, r, numel, dtype) for r in range(n)]
                            t = inputs[rank].clone()
                            work = c.all_reduce(t, op=op, compression=q, key=KEY, async_op=call % 2 == 1)
                            if work is not None:
                                work.wait()
                            if call < q.warmup_steps:
                                log.check(f"{what} call {call}", t, cross_host_reference(inputs, op, layout))
                                continue
                            base = residuals if q.error_feedback else [None] * n
                            expected, new_res = _expected_between_hosts(
                                q, inputs, base, op, layout, call, dtype
                            )
                            log.check(f"{what} call {call}", t, expected)
                            if q.error_feedback:
                                residuals = new_res
                                log.check(
                                    f"{what} call {call} residual",
                                    q.residual(KEY),
                                    residuals[rank],
                                    rank_specific=True,
                                )
    return log.summary()


@pytest.mark.parametrize(
    "names",
    [("int8", "int4", "int8-nearest-no-ef"), ("topk", "topk-dense"), ("cast-bf16", "cast-f16-no-ef")],
    ids=["quantized", "topk", "cast"],
)
@pytest.mark.parametrize("name", ["2x2", "2x3"])
@pytest.mark.slow
def test_compression_is_exact_on_hosts_and_compressed_between(name, names):
    layout = LAYOUTS[name]
    assert_ranks_agree(run_ranks(compressed_between_hosts, len(layout), layout, 31, names), min_cases=60)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_wrapper_across_hosts_matches_ddp(stage):
    """braid.comm.fsdp (ZeRO-1/2/3) with its ranks on 2 + 1 hosts ends where DDP on gloo does."""
    layout = [0, 0, 1]
    run_ranks(module_across_hosts, len(layout), layout, "test_zero", "_run_vs_ddp", stage, 1, True, 1)


@pytest.mark.parametrize("name", ["2x2"])
def test_zero_plus_plus_across_hosts_trains_like_exact(name):
    """ZeRO-3 with int8 weight gathers and int8 gradient reduce-scatters on a Communicator across
    simulated hosts (TCP between them): the same checks as on one host (test_zero.py)."""
    layout = LAYOUTS[name]
    results = run_ranks(module_across_hosts, len(layout), layout, "test_zero",
                        "_run_quantized_reduce_scatters", "communicator", 8, 3, True)
    assert all(r["params"] == results[0]["params"] for r in results)
    for r in results:
        torch.testing.assert_close(r["losses"], r["ref"], rtol=1e-2, atol=0)


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
def test_tensor_parallel_across_hosts_matches_dense(sequence_parallel):
    """braid.comm.tp's block and training across 2 x 2 hosts equal the dense model's."""
    layout = LAYOUTS["2x2"]
    checked = run_ranks(module_across_hosts, len(layout), layout, "test_tp", "on_communicator", "_run_block",
                        sequence_parallel)
    assert checked == [16] * len(layout)
    losses = run_ranks(
        module_across_hosts, len(layout), layout, "test_tp", "on_communicator", "_run_training",
        sequence_parallel, 3
    )
    assert all(run == losses[0] for run in losses)


@pytest.mark.parametrize("name", ["2x1", "2+1+1"])
def test_compressed_all_reduce_across_hosts_equals_one_host(name):
    layout = LAYOUTS[name]
    assert_ranks_agree(run_ranks(compressed_across_hosts, len(layout), layout, 3), min_cases=12)


def fused_hierarchical_equals_host_pair(rank, n, store_path, layout, seed):
    """A Communicator across hosts reduces exactly inside each host and compressed across (its fused
    hierarchical path); the compressor's one hierarchical algorithm over the host pair (HostGroups of
    a Communicator per host and one per local index, through the group interface) gives the same
    bits, residuals and wire bytes. The warm-up's exact calls follow each carrier's exact order
    (the communicator: host partials, then hosts; the pair: every rank in rank order), so there
    they agree to float32 rounding only."""
    from braid.comm.core.group_carrier import HostGroups

    log = CaseLog()
    hosts = hosts_of(layout)
    host = next(i for i, members in enumerate(hosts) if rank in members)
    local = hosts[host].index(rank)
    whole = hosts_comm(rank, n, store_path, layout)
    intra = hosts_comm(rank, n, store_path, layout, prefix=f"intra{host}/", rank_in=(local, len(hosts[host])))
    inter = hosts_comm(rank, n, store_path, layout, prefix=f"inter{local}/", rank_in=(host, len(hosts)))
    pair = HostGroups(whole, intra, inter)
    makers = {"int8": lambda: comm.Int8Quantizer(block=64), "int4": lambda: comm.Int4Quantizer(block=32),
              "topk": lambda: comm.TopK(0.02), "topk dense": lambda: comm.TopK(0.6),
              "bf16": lambda: comm.Cast(torch.bfloat16)}
    for name, make in makers.items():
        fused, generic = make(), make()
        for call in range(4):
            x = make_input(seed + call, rank, 3001, torch.float32)
            a, b = x.clone(), x.clone()
            whole.all_reduce(a, op="avg", compression=fused, key="k")
            generic.all_reduce(pair, b, "avg", key="k")
            if call < fused.warmup_steps:
                log.expect(f"{name} call {call} (exact)", torch.allclose(a, b, rtol=1e-6, atol=1e-6))
                continue
            log.check(f"{name} call {call}", b, a)
            if fused.residual("k") is not None:
                log.check(f"{name} call {call} residual", generic.residual("k"), fused.residual("k"),
                          rank_specific=True)
            log.expect(f"{name} call {call} wire", fused.last_wire_bytes == generic.last_wire_bytes,
                       f"{fused.last_wire_bytes} vs {generic.last_wire_bytes}")
    for c in (inter, intra, whole):
        c.close()
    return log.summary()


@pytest.mark.parametrize("name", ["2x2", "2x2-interleaved"])
def test_communicator_hierarchical_equals_the_algorithm_on_the_host_pair(name):
    layout = LAYOUTS[name]
    assert_ranks_agree(run_ranks(fused_hierarchical_equals_host_pair, len(layout), layout, 5), min_cases=40)


def test_silent_peer_on_other_host_times_out_naming_it():
    results = run_ranks(silent_host, 2, [0, 1])
    r1 = results[1]
    assert r1["type"] == "CommTimeout", r1
    assert "rank 0" in r1["message"], r1


# ----------------------------------------------------------------------------------------------
# Faults across hosts.

DETECTION_LIMIT_S = 2.0  # a dead peer on another host must be noticed long before any deadline


def killed_across_hosts(rank, n, store_path, layout, victims):
    from helpers import outcome
    from helpers.ranks import open_store

    c = hosts_comm(rank, n, store_path, layout, timeout=30.0)
    store = open_store(store_path)
    c.all_reduce(make_input(0, rank, 5000, torch.float32))
    if rank in victims:
        store.set(f"victim_ready{rank}", str(os.getpid()))
        store.wait(["never_set"])  # blocks until the test process SIGKILLs this rank
        raise AssertionError("the victim was not killed")
    seen = outcome(c.all_reduce, make_input(0, rank, 5000, torch.float32))
    return {"seen": seen, "after": outcome(c.barrier)}


@pytest.mark.parametrize("victims", [(3,), (2, 3)], ids=["one-rank", "whole-host"])
@pytest.mark.slow
def test_rank_killed_on_other_host_raises_peer_error_everywhere(victims):
    """SIGKILL of a rank (or of every rank of a host) while the others wait in an all_reduce: every
    survivor, on either host, raises PeerError within 2 s, and the communicator stays poisoned."""
    import time
    from datetime import timedelta

    from helpers.ranks import FreshRanks, open_store

    layout = LAYOUTS["2x2"]
    n = len(layout)
    with FreshRanks(n) as ranks:
        ranks.start(killed_across_hosts, layout, victims)
        open_store(ranks.store_path).wait([f"victim_ready{v}" for v in victims], timedelta(seconds=60))
        killed_at = time.monotonic()
        for v in victims:
            ranks.kill(v)
        outcomes = ranks.outcomes()
    for r in range(n):
        if r in victims:
            assert outcomes[r][0] == "died", outcomes[r]
            continue
        kind, result = outcomes[r]
        assert kind == "ok", result
        seen = result["seen"]
        assert seen["type"] == "PeerError", (r, seen)
        assert seen["at"] - killed_at < DETECTION_LIMIT_S, (r, seen)
        assert result["after"]["type"] == "PeerError", (r, result["after"])


def mismatch_across_hosts(rank, n, store_path, layout):
    from helpers import outcome

    with hosts_comm(rank, n, store_path, layout, timeout=30.0) as c:
        x = torch.ones(1000)
        if rank == n - 1:
            return outcome(c.all_gather, torch.empty(1000 * n), x)
        return outcome(c.all_reduce, x)


@pytest.mark.parametrize("name", ["2x1", "2x2", "2+1+1"])
def test_mismatch_across_hosts_raises_everywhere(name):
    """One rank calls all_gather where the others call all_reduce: every rank raises
    CollectiveMismatch (the ranks that compared descriptors; the others through the failure they
    were sent), none waits for the deadline."""
    layout = LAYOUTS[name]
    results = run_ranks(mismatch_across_hosts, len(layout), layout)
    for r, seen in enumerate(results):
        assert seen["type"] == "CollectiveMismatch", (r, seen)
        assert seen["elapsed"] < 10, (r, seen)


def link_cut(rank, n, store_path, layout):
    """test_multihost_netns: after a barrier each rank waits for the test to cut host 1's link,
    then calls all_reduce with a 3 s deadline."""
    from datetime import timedelta

    from helpers import outcome
    from helpers.ranks import open_store

    store = open_store(store_path)
    c = hosts_comm(rank, n, store_path, layout, tiny=False, timeout=3.0)
    c.barrier()
    store.set(f"cut/ready{rank}", "1")
    store.wait(["cut/go"], timedelta(seconds=60))
    return outcome(c.all_reduce, torch.ones(100000))


def tcp_endpoint(rank, n, store_path, layout):
    """test_multihost_netns: the TCP endpoint this rank published (its listening address)."""
    from helpers.ranks import open_store

    with hosts_comm(rank, n, store_path, layout, tiny=False) as c:
        prefix = c._prefix
        c.barrier()
    return open_store(store_path).get(f"{prefix}tcp/{rank}").decode()


def nothing_outlives_close(rank, n, store_path, layout):
    """File descriptors (sockets, listener, eventfd) and threads (progress, accept) before a
    communicator across hosts and after its close()."""

    def fds():
        return sorted(os.listdir("/proc/self/fd"))

    def threads():
        return len(os.listdir("/proc/self/task"))

    before = (fds(), threads())
    c = hosts_comm(rank, n, store_path, layout)
    c.all_reduce(torch.ones(100000), async_op=True).wait()  # starts the progress thread
    during = len(fds())
    c.close()
    after = (fds(), threads())
    return {"before": before, "after": after, "more_during": during > len(before[0])}


def test_no_socket_or_thread_outlives_close():
    layout = LAYOUTS["2x2"]
    for r, result in enumerate(run_ranks(nothing_outlives_close, len(layout), layout)):
        assert result["more_during"], (r, result)
        assert result["after"] == result["before"], (r, result)


def pipeline_across_hosts(rank, n, store_path, layout, schedule_name):
    """A two-stage pipeline (one stage per host) of a small MLP, trained with a
    torch.distributed.pipelining schedule on the braid backend and, in the same processes, on a
    gloo group: the losses and the stage's gradients agree (the stages only move activations and
    gradients point to point, so the results are the same up to float32 rounding order: 1e-6)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import pipelining
    from helpers.ranks import COMM_TIMEOUT_S, process_group

    def stage_module(stage):
        torch.manual_seed(stage)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))

    def train(group):
        module = stage_module(rank)
        stage = pipelining.PipelineStage(module, rank, n, torch.device("cpu"), group=group)
        loss_fn = torch.nn.MSELoss()
        schedule = getattr(pipelining, schedule_name)(stage, n_microbatches=4, loss_fn=loss_fn)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 16, generator=g)
        target = torch.randn(8, 16, generator=g)
        losses = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target, losses=losses)
        grads = torch.cat([p.grad.flatten() for p in module.parameters()])
        return grads, [loss.item() for loss in losses]

    env = {"BRAID_HOST_ID": f"host{layout[rank]}"} if os.environ.get("BRAID_TEST_REAL_HOSTS") != "1" else {}
    with environment(env), process_group(rank, n, store_path, backend="braid"):
        gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=COMM_TIMEOUT_S))
        braid_grads, braid_losses = train(None)
        gloo_grads, gloo_losses = train(gloo)
    close = torch.allclose(braid_grads, gloo_grads, rtol=1e-6, atol=1e-6)
    return {
        "grads_close": close,
        "losses": (braid_losses, gloo_losses),
        "nonzero": bool(braid_grads.abs().sum() > 0),
    }


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_pipelining_schedule_across_hosts_equals_gloo(schedule):
    layout = LAYOUTS["2x1"]
    for r, result in enumerate(run_ranks(pipeline_across_hosts, len(layout), layout, schedule)):
        assert result["grads_close"] and result["nonzero"], (r, result)
        braid_losses, gloo_losses = result["losses"]
        assert braid_losses == pytest.approx(gloo_losses, rel=1e-6), (r, result)


def recv_from_any_source(rank, n, store_path, layout):
    """recv from any source (torch's ``src=None``) on the braid backend: rank 0 takes every
    message sent to it, from peers on its own host (shared memory) and on others (TCP), and
    reports each sender; a peer's messages arrive in its send order; a receive from any source
    issued before one from a named peer takes that peer's first message, the named one its second."""
    import torch.distributed as dist

    env = {"BRAID_HOST_ID": f"host{layout[rank]}"} if layout else {}
    got = []
    with environment(env), process_group(rank, n, store_path, backend="braid"):
        if rank == 0:
            for _ in range(2 * (n - 1)):
                t = torch.empty(3)
                sender = dist.recv(t)
                got.append((sender, t.tolist()))
            dist.barrier()
            first, second = torch.empty(2), torch.empty(2)
            w_any = dist.irecv(first)  # issued first: takes rank n-1's first message
            w_named = dist.irecv(second, src=n - 1)
            w_any.wait()
            w_named.wait()
            got.append((w_any._source_rank(), first.tolist(), second.tolist()))
        else:
            for k in range(2):
                dist.send(torch.full((3,), 10.0 * rank + k), dst=0)
            dist.barrier()
            if rank == n - 1:
                dist.send(torch.tensor([1.0, 1.0]), dst=0)
                dist.send(torch.tensor([2.0, 2.0]), dst=0)
        dist.barrier()
    return got


@pytest.mark.parametrize("layout", [None, (0, 0, 1, 2)], ids=["one-host", "2+1+1"])
def test_recv_from_any_source(layout):
    n = 4
    got = run_ranks(recv_from_any_source, n, layout)[0]
    by_sender = {}
    for sender, values in got[:-1]:
        by_sender.setdefault(sender, []).append(values[0])
    assert by_sender == {r: [10.0 * r, 10.0 * r + 1] for r in range(1, n)}, got
    assert got[-1] == (n - 1, [1.0, 1.0], [2.0, 2.0]), got


# ----------------------------------------------------------------------------------------------
# Connections: on demand, and strangers at the listeners.


def connections_on_demand(rank, n, store_path, layout, connect):
    """Four hosts of one rank, the ring between hosts: the connections each rank holds after
    building the communicator and after an all_reduce (BRAID_TCP_CONNECT=``connect``)."""
    with environment({"BRAID_TCP_CONNECT": connect}):
        with hosts_comm(rank, n, store_path, layout, algo="ring") as c:
            built = c.connections()
            # Every rank reads its count before any starts the all_reduce (whose first transfers
            # would connect to it): a barrier through the store, which opens no braid connection.
            store = open_store(store_path)
            store.add("connections-read", 1)
            deadline = time.monotonic() + 30
            while int(store.add("connections-read", 0)) < n and time.monotonic() < deadline:
                time.sleep(0.01)
            t = torch.full((5000,), float(rank + 1))
            c.all_reduce(t)
            return {"built": built, "after": c.connections(), "exact": bool((t == n * (n + 1) / 2).all())}


@pytest.mark.parametrize("connect", ["lazy", "eager"])
def test_connections_open_on_demand(connect):
    """On demand (the default) a communicator opens no TCP connection while it is built, and an
    all_reduce whose ring joins four hosts leaves each rank connected to its two neighbours, not
    to all three others; eager connects every pair while building."""
    layout = [0, 1, 2, 3]
    sockets = 2 * int(TINY_ENV["BRAID_NSOCKS"])  # two channels
    for r in run_ranks(connections_on_demand, 4, layout, connect):
        assert r["exact"], r
        if connect == "lazy":
            assert r["built"] == {"peers": 0, "sockets": 0}, r
            assert r["after"] == {"peers": 2, "sockets": 2 * sockets}, r
        else:
            assert r["built"] == r["after"] == {"peers": 3, "sockets": 3 * sockets}, r


def dribble(sock, stop):
    """Sends a byte every 50 ms, 40 times or until ``stop``."""
    for _ in range(40):
        if stop.wait(0.05):
            return
        sock.send(b"B")


def strangers_at_the_listeners(rank, n, store_path, layout):
    """Every rank's listener gets 80 idle connections, one with garbage and one dribbling bytes
    (from rank 0, once every listener is published) before the ranks' first all_reduce; returns
    how long that all_reduce took and whether it was right."""
    import socket
    import threading
    import time
    from datetime import timedelta

    from helpers.ranks import open_store

    store = open_store(store_path)
    with hosts_comm(rank, n, store_path, layout) as c:
        held, stop = [], threading.Event()
        if rank == 0:
            for r in range(n):
                host, port = store.get(f"{c._prefix}tcp/{r}").decode().rsplit(":", 1)
                held += [socket.create_connection((host, int(port)), timeout=5) for _ in range(80)]
                garbage = socket.create_connection((host, int(port)), timeout=5)
                garbage.sendall(bytes(range(200)))
                held.append(garbage)
                slow = socket.create_connection((host, int(port)), timeout=5)
                held.append(slow)
                threading.Thread(target=dribble, args=(slow, stop), daemon=True).start()
            store.set("strangers/ready", "1")
        store.wait(["strangers/ready"], timedelta(seconds=30))
        start = time.monotonic()
        t = torch.full((5000,), float(rank + 1))
        c.all_reduce(t)
        took = time.monotonic() - start
        stop.set()
        for s in held:
            s.close()
        return {"seconds": took, "exact": bool((t == n * (n + 1) / 2).all())}


def test_strangers_at_the_listeners_do_not_stall_the_first_collective():
    """Strangers holding connections to every rank's listener (idle, garbage, a slow talker; more
    than the acceptor authenticates at once) cost the ranks' first all_reduce, which opens the
    connections between hosts, well under one handshake deadline (5 s): each incoming
    connection is authenticated on its own deadline, the oldest dropped past 64 at once."""
    for r in run_ranks(strangers_at_the_listeners, 4, [0, 0, 1, 1]):
        assert r["exact"] and r["seconds"] < 2.5, r


def doubling_across_hosts(rank, n, store_path, layout, algo, seed):
    """Recursive doubling between host leaders (forced, or chosen for small messages at many
    hosts): every dtype and op at counts around the one-shot limit, exact against its tree."""
    log = CaseLog()
    with environment({"BRAID_CROSS_DOUBLING_MIN_HOSTS": "4"}):
        with hosts_comm(rank, n, store_path, layout, algo=algo) as c:
            small = c.all_reduce_algorithm(64)
            log.expect("doubling chosen", small == "doubling", small)
            for dtype in DTYPES:
                for count in (0, 1, 7, 64, 1001):
                    inputs = [make_input(seed, r, count, dtype) for r in range(n)]
                    reference = reference_of(c.all_reduce_algorithm(count * inputs[0].element_size()))
                    for op in ops_for(dtype):
                        t = inputs[rank].clone()
                        c.all_reduce(t, op=op)
                        log.check(f"{dtype} count {count} {op}", t, reference(inputs, op, layout))
            # Doubling's log2 H partners (and an extra's), the ring's two neighbours.
            log.expect("connections", c.connections()["peers"] <= 5, c.connections())
    return log.summary()


@pytest.mark.parametrize("layout,algo", [([0, 1, 2, 3, 4], "auto"), ([0, 0, 1, 2, 3], "auto"),
                                         ([0, 1, 2], "doubling"), (list(range(8)), "auto")])
@pytest.mark.slow
def test_recursive_doubling_between_hosts(layout, algo):
    """Small all_reduces among 4, 5 and 8 hosts (and 3, forced) go by recursive doubling between the host
    leaders: exact against its reduction tree (extras folded in, pairs 2^k apart, lower first),
    bitwise identical on every rank; with larger counts the same run takes the ring."""
    assert_ranks_agree(run_ranks(doubling_across_hosts, len(layout), layout, algo, 23), min_cases=100)


def one_rank_cannot_listen(rank, n, store_path, layout):
    """Rank 1 names a network interface that does not exist; every rank's construction ends."""
    import time

    from helpers import outcome

    env = {"BRAID_SOCKET_IFNAME": "=braid-no-such-if0"} if rank == 1 else {}
    start = time.monotonic()
    with environment(env):
        seen = outcome(hosts_comm, rank, n, store_path, layout, timeout=60.0)
    return {**seen, "seconds": time.monotonic() - start}


def test_a_rank_failing_the_bootstrap_makes_every_rank_raise_at_once():
    """A rank that cannot take part (here: no such interface to listen on) publishes why before it
    raises, and every other rank, waiting for the TCP endpoints, raises that reason within seconds
    instead of at its 60 s deadline."""
    results = run_ranks(one_rank_cannot_listen, 3, [0, 1, 2])
    for r in results:
        assert r["type"] is not None and r["seconds"] < 10, r
        assert "braid-no-such-if0" in r["message"], r
    assert all("rank 1 could not join" in r["message"] for i, r in enumerate(results) if i != 1), results
