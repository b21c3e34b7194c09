"""braid as a torch.distributed backend: c10d collectives exact, and DDP, FSDP2 and DTensor on it.

Collectives are checked exactly (integer-valued float64). Training runs the same model on the
braid default group and on a gloo group in the same processes, and compares the parameters:
within 1e-5, since the two reduce in different orders (float32 sums of two or three terms differ
by an ulp; a wrong or missing reduction differs by O(lr)).
"""
import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from braid import comm  # noqa: F401  (registers the backend)
from helpers import SmallMLP
from helpers.ranks import braid_default_group, process_group, run_ranks
from torch import nn

# Trained float32 parameters of order 1: braid and gloo sum the ranks' gradients in different orders,
# an ulp (1.2e-7 relative) apart per sum at 3 ranks, a few ulps after some SGD steps; a wrong or
# missing reduction moves them by O(lr) = 0.1.
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _values(rank, *shape, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-50, 50, shape, generator=g).double()


def _run_collectives(rank, world_size, store_path):
    n = world_size
    every = [_values(r, 3, 5) for r in range(n)]
    with braid_default_group(rank, world_size, store_path):
        assert dist.get_backend() == "braid"
        for op, expect in ((dist.ReduceOp.SUM, sum(every)), (dist.ReduceOp.MAX, torch.stack(every).amax(0)),
                           (dist.ReduceOp.MIN, torch.stack(every).amin(0)),
                           (dist.ReduceOp.PRODUCT, torch.stack(every).prod(0))):
            t = every[rank].clone()
            dist.all_reduce(t, op=op)
            assert torch.equal(t, expect), op
        t = every[rank].clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        # Integer sums are exact in float64; only the division by n rounds (an ulp of values below
        # 50 is 7e-15), however it is done. A wrong sum is off by 1/n or more.
        torch.testing.assert_close(t, sum(every) / n, rtol=0, atol=1e-12)
        # Bitwise ops on integers (all_reduce and reduce_scatter); refused on floats.
        ints = [e.long() * 37 + 1000 for e in every]
        for op, fold in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                         (dist.ReduceOp.BXOR, torch.bitwise_xor)):
            expect = ints[0]
            for x in ints[1:]:
                expect = fold(expect, x)
            t = ints[rank].clone()
            dist.all_reduce(t, op=op)
            assert torch.equal(t, expect), op
            whole = torch.cat([x.flatten()[:2 * n] for x in ints]).view(n, 2 * n)
            out = torch.empty(2, dtype=torch.int64)
            dist.reduce_scatter_tensor(out, whole[rank].clone(), op=op)
            ref = whole[0]
            for x in whole[1:]:
                ref = fold(ref, x)
            assert torch.equal(out, ref[2 * rank:2 * rank + 2]), op
        with pytest.raises(ValueError, match="needs an integer tensor"):
            dist.all_reduce(every[rank].clone(), op=dist.ReduceOp.BAND)

        # Non-contiguous, async, through the future.
        t = every[rank].clone().t()
        work = dist.all_reduce(t, async_op=True)
        value = work.get_future().wait()
        assert torch.equal(t, sum(every).t()) and torch.equal(value[0], t)

        for src in range(n):
            t = every[rank].clone()
            dist.broadcast(t, src)
            assert torch.equal(t, every[src])

        outs = [torch.empty(3, 5, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(outs, every[rank])
        assert all(torch.equal(o, e) for o, e in zip(outs, every))
        whole = torch.empty(3 * n, 5, dtype=torch.float64)
        dist.all_gather_into_tensor(whole, every[rank])
        assert torch.equal(whole, torch.cat(every))

        big = [_values(r, n * 4, 2, salt=1) for r in range(n)]
        out = torch.empty(4, 2, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, big[rank])
        assert torch.equal(out, sum(big)[rank * 4:(rank + 1) * 4])
        dist.reduce_scatter(out, list(big[rank].chunk(n)))
        assert torch.equal(out, sum(big)[rank * 4:(rank + 1) * 4])

        for root in range(n):
            t = every[rank].clone()
            dist.reduce(t, dst=root)
            assert torch.equal(t, sum(every) if rank == root else every[rank])
            gathered = [torch.empty(3, 5, dtype=torch.float64) for _ in range(n)] if rank == root else None
            dist.gather(every[rank], gathered, dst=root)
            if rank == root:
                assert all(torch.equal(o, e) for o, e in zip(gathered, every))
            piece = torch.empty(3, 5, dtype=torch.float64)
            dist.scatter(piece, [e + 7 for e in every] if rank == root else None, src=root)
            assert torch.equal(piece, every[rank] + 7)

        # all_to_all: rank r's i-th block goes to rank i's r-th block.
        send = _values(rank, n * 2, 3, salt=2)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        expect = torch.cat([_values(r, n * 2, 3, salt=2)[rank * 2:(rank + 1) * 2] for r in range(n)])
        assert torch.equal(recv, expect)
        outs = [torch.empty(2, dtype=torch.float64) for _ in range(n)]
        dist.all_to_all(outs, [torch.full((2,), 10.0 * rank + i, dtype=torch.float64) for i in range(n)])
        for r, o in enumerate(outs):
            assert torch.equal(o, torch.full((2,), 10.0 * r + rank, dtype=torch.float64))

        dist.barrier()

        # A sub-group of the first two ranks (the others take no part, as torch requires).
        sub = dist.new_group([0, 1])
        if rank < 2:
            t = every[rank].clone()
            dist.all_reduce(t, group=sub)
            assert torch.equal(t, every[0] + every[1])
        # A group of the first and last ranks: group rank 1 is global rank n - 1.
        ends = dist.new_group([0, n - 1])
        if rank in (0, n - 1):
            t = every[rank].clone()
            dist.broadcast(t, group_src=1, group=ends)
            assert dist.get_global_rank(ends, 1) == n - 1 and torch.equal(t, every[n - 1])

        # Uneven splits: rank i sends i + j + 1 rows (of 4) to rank j, one of them with a
        # non-contiguous output, one async; lists of tensors of different sizes.
        rows = [[i + j + 1 for j in range(n)] for i in range(n)]
        piece = [[_values(i, rows[i][j], 4, salt=10 + j) for j in range(n)] for i in range(n)]
        expect = torch.cat([piece[i][rank] for i in range(n)])
        recv = torch.empty_like(expect)
        dist.all_to_all_single(recv, torch.cat(piece[rank]), [rows[i][rank] for i in range(n)], rows[rank])
        assert torch.equal(recv, expect)
        strided = torch.empty(4, expect.shape[0], dtype=torch.float64).t()
        work = dist.all_to_all_single(strided, torch.cat(piece[rank]), [rows[i][rank] for i in range(n)],
                                      rows[rank], async_op=True)
        work.wait()
        assert torch.equal(strided, expect)
        outs = [torch.empty(rows[i][rank], 4, dtype=torch.float64) for i in range(n)]
        dist.all_to_all(outs, piece[rank])
        assert all(torch.equal(o, piece[i][rank]) for i, o in enumerate(outs))
        with pytest.raises(ValueError, match="input_split_sizes must sum to input.size"):
            dist.all_to_all_single(torch.empty(3), torch.empty(3), [1, 2] + [0] * (n - 2),
                                   [2, 2] + [0] * (n - 2))
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_collectives_through_torch_distributed(world_size):
    assert run_ranks(_run_collectives, world_size) == [True] * world_size


def _run_point_to_point(rank, world_size, store_path):
    n = world_size
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    with braid_default_group(rank, world_size, store_path):
        # Ring exchanges with isend/irecv, and with batch_isend_irecv, from empty to 12 MiB: past
        # the 4 MiB of mailbox per pair, every rank's send waits for the receive it issued after it.
        for size in (0, 1, 1000, 3 << 18, 3 << 20):
            out = torch.arange(size, dtype=torch.float32) + 1000 * rank
            got = torch.full((size,), -1.0)
            works = [dist.isend(out, nxt), dist.irecv(got, prv)]
            for w in works:
                w.wait()
            assert torch.equal(got, torch.arange(size, dtype=torch.float32) + 1000 * prv), size
            got2 = torch.full((size,), -1.0)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out * 2, nxt),
                                             dist.P2POp(dist.irecv, got2, prv)]):
                w.wait()
            assert torch.equal(got2, 2 * (torch.arange(size, dtype=torch.float32) + 1000 * prv)), size
        # Blocking send/recv between ranks 0 and 1, a non-contiguous receive, int64.
        if rank < 2:
            other = 1 - rank
            payload = torch.arange(12, dtype=torch.int64).view(3, 4) * (rank + 1)
            target = torch.zeros(4, 3, dtype=torch.int64).t()
            if rank == 0:
                dist.send(payload, other)
                dist.recv(target, other)
            else:
                dist.recv(target, other)
                dist.send(payload, other)
            assert torch.equal(target, torch.arange(12, dtype=torch.int64).view(3, 4) * (other + 1))
        # In a sub-group, peers are group ranks.
        pair = dist.new_group([0, n - 1])
        if rank in (0, n - 1):
            buf = torch.tensor([float(rank)])
            if rank == 0:
                dist.send(buf, group_dst=1, group=pair)
            else:
                dist.recv(buf, group_src=0, group=pair)
                assert buf.item() == 0.0
        # Collectives still line up after point-to-point traffic.
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [float(n)] * 3
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_point_to_point(world_size):
    assert run_ranks(_run_point_to_point, world_size) == [True] * world_size


def _run_other_dtypes_move(rank, world_size, store_path):
    """Calls that only move data take any dtype (bool, int8, int16, complex64: as bytes), as gloo
    does: broadcast, all_gather(_into_tensor), gather, scatter, all_to_all(_single, with and
    without splits), send/recv, and DDP's broadcast of a bool buffer; reductions still refuse them
    naming the dtype."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    n = world_size

    def value(r, dtype, m=6):
        base = torch.arange(m) * 7 + 3 * r
        if dtype == torch.bool:
            return base % 3 == 0
        if dtype.is_complex:
            return torch.complex(base.float(), -base.float()).to(dtype)
        return base.to(dtype)

    with braid_default_group(rank, world_size, store_path):
        for dtype in (torch.bool, torch.int8, torch.int16, torch.complex64):
            t = value(rank, dtype)
            dist.broadcast(t, src=n - 1)
            assert torch.equal(t, value(n - 1, dtype)), dtype
            outs = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(outs, value(rank, dtype))
            assert all(torch.equal(o, value(r, dtype)) for r, o in enumerate(outs)), dtype
            flat = torch.empty(n * 6, dtype=dtype)
            dist.all_gather_into_tensor(flat, value(rank, dtype))
            assert torch.equal(flat, torch.cat([value(r, dtype) for r in range(n)])), dtype
            got = [torch.empty(6, dtype=dtype) for _ in range(n)] if rank == 0 else None
            dist.gather(value(rank, dtype), got, dst=0)
            if rank == 0:
                assert all(torch.equal(o, value(r, dtype)) for r, o in enumerate(got)), dtype
            piece = torch.empty(6, dtype=dtype)
            dist.scatter(piece, [value(r, dtype) for r in range(n)] if rank == 0 else None, src=0)
            assert torch.equal(piece, value(rank, dtype)), dtype
            whole = value(rank, dtype, 2 * n)
            out = torch.empty_like(whole)
            dist.all_to_all_single(out, whole)
            expect = torch.cat([value(r, dtype, 2 * n)[2 * rank:2 * rank + 2] for r in range(n)])
            assert torch.equal(out, expect), dtype
            splits = [1 + (j + rank) % 2 for j in range(n)]  # what this rank sends to each
            recv = [1 + (rank + j) % 2 for j in range(n)]    # what each rank sends to this one
            src = value(rank, dtype, sum(splits))
            out = torch.empty(sum(recv), dtype=dtype)
            dist.all_to_all_single(out, src, output_split_sizes=recv, input_split_sizes=splits)
            sent_by = [value(r, dtype, sum(1 + (j + r) % 2 for j in range(n))) for r in range(n)]
            offs = [sum(1 + (j + r) % 2 for j in range(rank)) for r in range(n)]
            expect = torch.cat([sent_by[r][offs[r]:offs[r] + recv[r]] for r in range(n)])
            assert torch.equal(out, expect), dtype
            if rank < 2:
                x = value(rank, dtype)
                if rank == 0:
                    dist.send(x, 1)
                else:
                    dist.recv(x, 0)
                    assert torch.equal(x, value(0, dtype)), dtype
            if dtype.is_complex:  # torch sums complex tensors as their float32 view
                t = value(rank, dtype)
                dist.all_reduce(t)
                assert torch.equal(t, sum(value(r, dtype) for r in range(n)))
            else:
                with pytest.raises(TypeError, match="unsupported dtype"):
                    dist.all_reduce(value(rank, dtype))
        model = nn.Linear(3, 3)
        model.register_buffer("mask", torch.rand(3, 3, generator=torch.Generator().manual_seed(rank)) > 0.5)
        ddp = DDP(model)  # broadcasts rank 0's buffers
        expect = torch.rand(3, 3, generator=torch.Generator().manual_seed(0)) > 0.5
        assert torch.equal(ddp.module.mask, expect)
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_data_moving_calls_take_any_dtype(world_size):
    assert run_ranks(_run_other_dtypes_move, world_size) == [True] * world_size


def _run_roots_that_disagree(rank, world_size, store_path):
    """reduce and gather run as an all-reduce / all-gather, which every rank completes whatever
    root it names: ranks that name different roots raise CollectiveMismatch (each in a group of
    its own, which the error poisons) instead of returning as if all went well."""
    from braid.comm import CollectiveMismatch

    with braid_default_group(rank, world_size, store_path):
        seen = []
        for call in ("reduce", "gather"):
            group = dist.new_group(list(range(world_size)))
            dst = rank % 2  # ranks 0 and 1 disagree
            try:
                if call == "reduce":
                    dist.reduce(torch.ones(3), dst=dst, group=group)
                else:
                    out = [torch.empty(3) for _ in range(world_size)] if rank == dst else None
                    dist.gather(torch.ones(3), out, dst=dst, group=group)
                seen.append(f"{call}: no error")
            except CollectiveMismatch as e:
                assert "root" in str(e) or "tag" in str(e), str(e)
                seen.append(f"{call}: mismatch")
        t = torch.ones(2)
        dist.all_reduce(t)  # the default group is untouched
        assert t.tolist() == [float(world_size)] * 2
    return seen


def test_roots_that_disagree_raise_a_mismatch():
    for seen in run_ranks(_run_roots_that_disagree, 2):
        assert seen == ["reduce: mismatch", "gather: mismatch"], seen


def _run_work_api_and_callbacks(rank, world_size, store_path):
    """The Work a braid call returns: wait() raises braid's error (a future-wrapping Work once
    returned normally from a failed call, leaving unreduced tensors), wait(timeout) and result()
    work; a collective issued and waited for inside a future's callback completes (it once hung:
    the callback runs on braid's progress thread), which torch's PowerSGD hook relies on."""
    from braid.comm import CollectiveMismatch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    from torch.nn.parallel import DistributedDataParallel as DDP

    with braid_default_group(rank, world_size, store_path) as gloo:
        t = torch.ones(3)
        w = dist.all_reduce(t, async_op=True)
        assert w.wait(timeout=timedelta(seconds=30)) and w.is_success()
        assert torch.equal(w.result()[0], torch.full((3,), float(world_size)))
        # A receive of another size than the send raises the mismatch from wait() (in a group of
        # its own: the error poisons it).
        pair = dist.new_group([0, 1])
        if rank < 2:
            x = torch.zeros(4 + rank)
            if rank == 0:
                w = dist.isend(x, group_dst=1, group=pair)
            else:
                w = dist.irecv(x, group_src=0, group=pair)
            if rank == 1:
                with pytest.raises(CollectiveMismatch, match="point-to-point mismatch"):
                    w.wait()
            else:
                w.wait()  # the send completed into the mailbox
        # A collective issued and waited for from a callback, then one issued after it.
        u = torch.full((4,), float(rank))
        fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
        inner = fut.then(lambda _: dist.all_reduce(u, async_op=True).get_future().wait()[0].tolist())
        v = torch.ones(2)
        dist.all_reduce(v)
        assert inner.wait() == [float(sum(range(world_size)))] * 4
        assert v.tolist() == [float(world_size)] * 2
        # DDP with torch's PowerSGD hook (its callbacks all-reduce and wait) trains as on gloo.
        trained = []
        for group in (dist.group.WORLD, gloo):
            torch.manual_seed(0)
            model = DDP(SmallMLP(), process_group=group)
            state = powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                           start_powerSGD_iter=2, min_compression_rate=0.5)
            model.register_comm_hook(state, powerSGD.powerSGD_hook)
            _train(model, 6, rank)
            trained.append([p.detach().clone() for p in model.parameters()])
        for a, b in zip(*trained):
            torch.testing.assert_close(a, b, **TOL)
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_work_api_and_collectives_from_callbacks(world_size):
    assert run_ranks(_run_work_api_and_callbacks, world_size) == [True] * world_size


def _train(model, steps, rank, data_seed=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(data_seed + rank)  # each rank its own batch
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _run_ddp_fsdp_dtensor(rank, world_size, store_path):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    with braid_default_group(rank, world_size, store_path) as gloo:
        braid_mesh = init_device_mesh("cpu", (world_size,))
        gloo_mesh = DeviceMesh.from_group(gloo, "cpu")
        assert braid_mesh.get_group().name() != gloo_mesh.get_group().name()
        torch.manual_seed(0)
        base = SmallMLP()
        results = {}
        for name, make in {
            "ddp": lambda m, mesh, group: DDP(m, process_group=group),
            "fsdp2": lambda m, mesh, group: fully_shard(m, mesh=mesh),
            "tp": lambda m, mesh, group: parallelize_module(
                m, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}),
        }.items():
            trained = []
            for mesh, group in ((braid_mesh, dist.group.WORLD), (gloo_mesh, gloo)):
                model = make(copy.deepcopy(base), mesh, group)
                # TP ranks must see the same batch (they hold slices of one model).
                _train(model, 5, 0 if name == "tp" else rank)
                trained.append([_full(p) for p in model.parameters()])
            for a, b in zip(*trained):
                torch.testing.assert_close(a, b, **TOL)
            results[name] = [p.sum().item() for p in trained[0]]
        # FSDP2 with a gradient divide factor other than the world size reduce-scatters with
        # PREMUL_SUM(1/factor) (gloo has no PREMUL_SUM: compare with its mean, rescaled).
        grads = []
        for mesh, factor in ((braid_mesh, 5.0), (gloo_mesh, None)):
            model = fully_shard(copy.deepcopy(base), mesh=mesh)
            if factor is not None:
                model.set_gradient_divide_factor(factor)
            x = torch.randn(8, 12, generator=torch.Generator().manual_seed(rank))
            model(x).square().mean().backward()
            grads.append([p.grad.full_tensor() for p in model.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(a * 5.0 / world_size, b, **TOL)
    return results


@pytest.mark.parametrize("world_size", (2, 3))
def test_ddp_fsdp2_and_dtensor_train_as_on_gloo(world_size):
    """DDP, FSDP2 (fully_shard) and a DTensor tensor-parallel MLP (ColwiseParallel then
    RowwiseParallel) on the braid default group end with the parameters of the same runs on gloo;
    and every rank holds the same model."""
    results = run_ranks(_run_ddp_fsdp_dtensor, world_size)
    for name in results[0]:
        assert all(r[name] == results[0][name] for r in results), name


def _run_coalesced_sparse_and_name(rank, world_size, store_path):
    """all_gather_coalesced in torch's layout (one list per rank, one tensor per input, shapes
    odd, an empty one among them); a sparse all_reduce (hybrid, uneven nonzeros,
    duplicate indices) equal to the dense sum; the group names itself braid where torch asks it
    (DDP's logging) and in torch.distributed, and a sub-group does too."""
    n = world_size
    with braid_default_group(rank, world_size, store_path):
        inputs = [torch.full((3,), float(rank)), torch.arange(10.0).view(2, 5) + rank, torch.empty(0),
                  torch.tensor([rank + 0.5])]
        outputs = [[torch.empty_like(t) for t in inputs] for _ in range(n)]
        outputs[n - 1][1] = torch.empty(5, 2).t()  # not contiguous: written through a copy
        dist.all_gather_coalesced(outputs, inputs)
        for r in range(n):
            assert torch.equal(outputs[r][0], torch.full((3,), float(r)))
            assert torch.equal(outputs[r][1], torch.arange(10.0).view(2, 5) + r)
            assert outputs[r][2].numel() == 0
            assert outputs[r][3].item() == r + 0.5
        with pytest.raises(ValueError, match="one per rank"):
            dist.all_gather_coalesced([[torch.empty(3)]], [torch.ones(3)])

        def sparse(r):
            g = torch.Generator().manual_seed(r)
            nnz = 2 + 3 * r  # uneven, with duplicates
            idx = torch.randint(0, 4, (2, nnz), generator=g)
            values = torch.randint(-9, 9, (nnz, 3), generator=g).double()
            return torch.sparse_coo_tensor(idx, values, (4, 4, 3))
        mine = sparse(rank)
        dist.all_reduce(mine)
        expect = sum(sparse(r).to_dense() for r in range(n))
        assert mine.is_sparse and torch.equal(mine.to_dense(), expect)
        with pytest.raises(ValueError, match="can only be summed"):
            dist.all_reduce(sparse(rank), op=dist.ReduceOp.MAX)

        assert dist.group.WORLD._get_backend_name() == "braid"
        sub = dist.new_group(list(range(n)), backend="braid")
        assert dist.get_backend(sub) == "braid" and sub._get_backend_name() == "braid"
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        assert model._get_ddp_logging_data()["backend_name"] == "braid"
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_coalesced_gather_sparse_all_reduce_and_group_name(world_size):
    assert run_ranks(_run_coalesced_sparse_and_name, world_size) == [True] * world_size


def _run_monitored_barrier(rank, world_size, store_path):
    """The process group's monitored_barrier: passes when every rank comes; when rank 2 stays
    away, rank 0 raises naming it (every missing rank with wait_all_ranks) within the timeout,
    and rank 1, whose answer never comes, says so."""
    with process_group(rank, world_size, store_path, backend="braid"):
        pg = dist.group.WORLD
        pg.monitored_barrier(timedelta(seconds=30))
        late = dist.new_group(backend="braid")
        if rank == 0:
            expected = "Rank 0 timed out in monitoredBarrier after 500 ms. Ranks 2 failed"
            with pytest.raises(RuntimeError, match=expected):
                late.monitored_barrier(timedelta(milliseconds=500), wait_all_ranks=True)
        elif rank == 1:
            with pytest.raises(RuntimeError, match="Rank 1 successfully reached monitoredBarrier"):
                late.monitored_barrier(timedelta(milliseconds=1500))
        dist.barrier()  # the default group is untouched
    return True


def test_monitored_barrier():
    assert run_ranks(_run_monitored_barrier, 3) == [True] * 3


def _run_unsupported(rank, world_size, store_path):
    with braid_default_group(rank, world_size, store_path):
        with pytest.raises(TypeError, match="unsupported dtype"):
            dist.all_reduce(torch.ones(2, dtype=torch.bool))
        with pytest.raises(ValueError, match="'band' needs an integer tensor"):
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
        with pytest.raises(ValueError, match="PREMUL_SUM needs a floating-point tensor"):
            dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(2.0))
        with pytest.raises(ValueError, match="share memory"):
            dist.all_reduce(torch.ones(1).expand(4))
        with pytest.raises(ValueError, match="share memory"):
            dist.all_gather_into_tensor(torch.ones(1).expand(2 * world_size), torch.ones(2))
        # Argument errors are raised before anything is sent: the group still works.
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [world_size] * 2
    return True


def test_unsupported_arguments_raise_naming_them():
    assert run_ranks(_run_unsupported, 2) == [True, True]


def _run_premul_sum(rank, world_size, store_path):
    """PREMUL_SUM(f) sums every rank's input times f (a float or a one-element tensor) on
    all_reduce, reduce and the reduce-scatters, leaving the inputs of out-of-place calls as they
    were; values are integers times powers of two, so every order of summation is exact."""
    n = world_size
    out = {}
    with braid_default_group(rank, world_size, store_path):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            every = [_values(r, 4 * n + 1, salt=7).to(dtype) for r in range(n)]
            for f in (0.5, torch.tensor(0.25, dtype=torch.float64), torch.tensor([2.0])):
                op = dist._make_nccl_premul_sum(f)
                fv = float(f)
                expect = sum(e.double() * fv for e in every).to(dtype)
                t = every[rank].clone()
                dist.all_reduce(t, op=op)
                assert torch.equal(t, expect), (dtype, f)
                out[f"{dtype} {f}"] = t.tolist()
                # Non-contiguous tensors are reduced and written back through a copy.
                t = torch.zeros(2 * every[rank].numel(), dtype=dtype)[::2]
                t.copy_(every[rank])
                dist.all_reduce(t, op=op)
                assert torch.equal(t, expect), (dtype, f, "strided")
                t = every[rank].clone()
                work = dist.all_reduce(t, op=op, async_op=True)
                work.wait()
                assert torch.equal(t, expect), (dtype, f, "async")
                t = every[rank].clone()
                dist.reduce(t, dst=n - 1, op=op)
                assert torch.equal(t, expect if rank == n - 1 else every[rank]), (dtype, f, "reduce")
                whole = torch.cat([e[:4 * n] for e in every]).view(n, 4 * n)
                inp = whole[rank].clone()
                shard = torch.empty(4, dtype=dtype)
                dist.reduce_scatter_tensor(shard, inp, op=op)
                assert torch.equal(shard, (whole.double() * fv).sum(0).to(dtype)[4 * rank:4 * rank + 4])
                assert torch.equal(inp, whole[rank]), "the input of reduce_scatter_tensor changed"
                # In place: the output is this rank's slice of the input.
                inp = whole[rank].clone()
                dist.reduce_scatter_tensor(inp[4 * rank:4 * rank + 4], inp, op=op)
                assert torch.equal(inp[4 * rank:4 * rank + 4], shard)
                pieces = list(whole[rank].clone().chunk(n))
                shard2 = torch.empty(4, dtype=dtype)
                dist.reduce_scatter(shard2, pieces, op=op)
                assert torch.equal(shard2, shard)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_premul_sum(world_size):
    results = run_ranks(_run_premul_sum, world_size)
    assert all(r == results[0] for r in results)


def _run_checkpoint_and_objects(rank, world_size, store_path, ckpt_dir):
    """torch.distributed.checkpoint saves and loads through the braid group (its planning
    gathers and broadcasts pickled objects), and the object collectives carry objects of
    different sizes per rank."""
    import torch.distributed.checkpoint as dcp

    with braid_default_group(rank, world_size, store_path):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        dcp.save({"model": model.state_dict(), "step": torch.tensor(7)}, checkpoint_id=ckpt_dir)
        fresh = torch.nn.Linear(8, 4)
        loaded = {"model": fresh.state_dict(), "step": torch.tensor(0)}
        dcp.load(loaded, checkpoint_id=ckpt_dir)
        fresh.load_state_dict(loaded["model"])
        restored = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        mine = {"rank": rank, "payload": "x" * (100 * rank + 1)}
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        first = [mine if rank == 0 else None]
        dist.broadcast_object_list(first, src=0)
        received = [None]
        pieces = [f"to {r}" for r in range(world_size)] if rank == 0 else None
        dist.scatter_object_list(received, pieces, src=0)
        at_root = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, at_root, dst=0)
        return {"restored": restored, "step": int(loaded["step"]),
                "gathered": [g["payload"] for g in gathered], "first": first[0]["rank"],
                "scattered": received[0],
                "at_root": None if at_root is None else [g["rank"] for g in at_root]}


@pytest.mark.parametrize("world_size", (2, 3))
def test_checkpoint_and_object_collectives(world_size, tmp_path):
    results = run_ranks(_run_checkpoint_and_objects, world_size, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert r["restored"] and r["step"] == 7, r
        assert r["gathered"] == ["x" * (100 * q + 1) for q in range(world_size)], r
        assert r["first"] == 0 and r["scattered"] == f"to {rank}", r
        assert r["at_root"] == (list(range(world_size)) if rank == 0 else None), r
