"""The group interface (comm/core/group.py): a torch ProcessGroup as a braid Group, checked collective by
collective against exact local results, and braid's layers on CUDA tensors (GPU cases, marked).

CPU: every collective of ProcessGroupAdapter over gloo and over braid's c10d backend, at 2 and 3
ranks, on rank-distinct small integers (exact in float32 whatever the summation order), async
works waited and chained, broadcast sources and neighbours as ranks of a sub-group, the default
group looked up at first use (and again after it is made anew), the argument errors.

GPU (skipped without CUDA): TP layers and the ZeRO wrapper on CUDA tensors over gloo (two
processes on one GPU, through host memory), over braid's Communicator (built with CUDA), and over
NCCL where two GPUs exist, against the dense model on the same GPU.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from braid.bench.models import BLOCK_PLAN, Block, LanguageModel
from braid.comm import Int8Quantizer, Work, tp, zero
from braid.comm.core.build_info import is_cuda_build
from braid.comm.core.group import DefaultGroup, Group, ProcessGroupAdapter, as_group, check_device
from helpers.ranks import carrier, make_comm, new_store_path, process_group, run_ranks
from torch import nn


def _ints(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-50, 50, shape, generator=g).float()


def _collectives(rank, world_size, store_path, backend):
    """Each collective of the adapter against the exact result; returns how many were checked."""
    with process_group(rank, world_size, store_path, backend=backend):
        g = as_group(dist.group.WORLD)
        assert isinstance(g, ProcessGroupAdapter) and as_group(dist.group.WORLD) is g  # one per group
        assert (g.rank, g.world_size) == (rank, world_size)
        n, checked = world_size, 0
        every = [_ints(r, 6 * n) for r in range(n)]
        for op, expect in (("sum", sum(every)), ("avg", sum(every) / n), ("max", torch.stack(every).amax(0)),
                           ("min", torch.stack(every).amin(0)), (dist.ReduceOp.SUM, sum(every))):
            t = every[rank].clone()
            g.all_reduce(t, op)
            assert torch.equal(t, expect), op
            checked += 1
        ints = torch.arange(5, dtype=torch.int64) * (rank + 1)
        g.all_reduce(ints, "avg")  # integers average with truncation, as braid's own
        assert torch.equal(ints, torch.div(torch.arange(5) * sum(range(1, n + 1)), n, rounding_mode="trunc"))
        out = torch.empty(n, 6 * n)
        g.all_gather(out, every[rank])
        assert torch.equal(out, torch.stack(every))
        part = torch.empty(6)
        g.reduce_scatter(part, every[rank], "avg")
        assert torch.equal(part, (sum(every) / n)[6 * rank:6 * rank + 6])
        a2a = torch.empty(6 * n)
        g.all_to_all(a2a, every[rank])
        assert torch.equal(a2a, torch.cat([every[r][6 * rank:6 * rank + 6] for r in range(n)]))
        b = every[rank].clone()
        g.broadcast(b, src=n - 1)
        assert torch.equal(b, every[n - 1])
        checked += 5
        # Async: wait() completes the average; a future chains; is_completed after wait.
        t = every[rank].clone()
        work = g.all_reduce(t, "avg", async_op=True)
        assert isinstance(work, Work), type(work)  # one handle class, whoever runs the call
        assert work.wait() and work.is_completed() and torch.equal(t, sum(every) / n)
        assert work.is_success() and "done" in work.describe()
        assert isinstance(g.barrier(async_op=True), Work)
        t = every[rank].clone()
        fut = g.reduce_scatter(part, t, "avg", async_op=True).get_future().then(lambda f: f.value()[0] * 2)
        assert torch.equal(fut.wait(), (sum(every) / n)[6 * rank:6 * rank + 6] * 2)
        recv = torch.empty(6 * n)
        pair = g.send_recv(every[rank], (rank + 1) % n, recv, (rank - 1) % n)
        assert isinstance(pair, Work) and pair.wait() and pair.is_success()
        assert torch.equal(recv, every[(rank - 1) % n])
        checked += 3
        # Sub-group: ranks {1, .., n-1}; its rank 0 is global rank 1.
        sub = dist.new_group(list(range(1, n)))
        if rank >= 1:
            s = as_group(sub)
            assert (s.rank, s.world_size) == (rank - 1, n - 1)
            b = every[rank].clone()
            s.broadcast(b, src=0)
            assert torch.equal(b, every[1])
            with pytest.raises(ValueError, match=r"src must be a rank of the group, in \[0, "):
                s.broadcast(b, src=n - 1)
            checked += 1
        else:
            with pytest.raises(ValueError, match="this rank is not a member of the group"):
                as_group(sub, "group", "test")
        g.barrier()
        return checked


@pytest.mark.parametrize("backend", ("gloo", "braid"))
@pytest.mark.parametrize("world_size", (2, 3))
def test_process_group_collectives_are_exact(backend, world_size):
    assert run_ranks(_collectives, world_size, backend) == [13] + [14] * (world_size - 1)


def _default_group(rank, world_size, store_path):
    """DefaultGroup: made before init_process_group, looked up at first use, and again when the
    default group is destroyed and made anew."""
    lazy = as_group(None, "group")
    assert isinstance(lazy, DefaultGroup) and not lazy.resolved
    seen = []
    for backend in ("gloo", "braid"):
        with process_group(rank, world_size, store_path, backend=backend):
            t = torch.full((3,), float(rank + 1))
            lazy.all_reduce(t)
            seen.append((lazy.world_size, t.tolist(), lazy.process_group is dist.group.WORLD))
    return seen


def test_default_group_is_resolved_at_first_use():
    expect = [(2, [3.0] * 3, True)] * 2
    assert run_ranks(_default_group, 2) == [expect, expect]


def test_as_group_errors_name_the_argument():
    with pytest.raises(TypeError, match="where: comm must be a braid.comm.Communicator, a "
                                        "torch.distributed.ProcessGroup or None"):
        as_group("gloo", "comm", "where")
    lazy = as_group(None, "process_group")
    with pytest.raises(ValueError, match="process_group is None .* not initialized"):
        _ = lazy.world_size


def test_communicator_is_a_group_with_capabilities():
    c = make_comm(0, 1, _store())
    try:
        assert isinstance(c, Group) and as_group(c) is c
        assert {"compressed_all_reduce", "hierarchical"} <= c.capabilities
        check_device(c, torch.device("cpu"), "x")
        assert "a braid Communicator takes CPU" in c.device_problem(torch.device("meta"))
        check_device(c, torch.device("meta"), "x")  # meta tensors carry nothing: no refusal
        # One handle class: a plain and a compressed call's handles are both braid.comm.Work.
        plain = c.all_reduce(torch.ones(8), async_op=True)
        packed = c.all_reduce(torch.ones(1024), op="avg", compression=Int8Quantizer(), async_op=True)
        for w in (plain, packed):
            assert isinstance(w, Work) and w.wait() and w.is_completed() and w.is_success(), w
        assert type(packed).__name__ == "CompressedWork" and "done" in repr(packed)
    finally:
        c.close()


def _store():
    from helpers.ranks import new_store_path

    return new_store_path()


def _device_refusals(rank, world_size, store_path):
    """A CUDA-only group refuses CPU parameters, naming both; a gloo group serves every device."""
    with process_group(rank, world_size, store_path):
        g = as_group(dist.group.WORLD)
        check_device(g, torch.device("cpu"), "parameters")
        check_device(g, torch.device("cuda"), "parameters")  # gloo serves CUDA (through host memory)
        g._backends = {"cuda": "nccl"}  # what an NCCL group reports
        messages = []
        for build in (lambda: zero.shard(nn.Linear(4, 4), g),
                      lambda: tp.ColumnParallelLinear(4, 4, group=g)):
            try:
                build()
                messages.append("no error")
            except ValueError as e:
                messages.append(str(e))
        return messages


def test_cpu_parameters_on_a_cuda_only_group_are_refused():
    for sharded, column in run_ranks(_device_refusals, 2):
        assert ("shard: the module's parameters are on cpu, but the process group serves cuda (nccl) "
                "tensors only, not cpu") in sharded, sharded
        assert "ColumnParallelLinear: the weights are on cpu, but the process group serves cuda" in column


# ---------------------------------------------------------------------------------------------
# GPU: the same layers on CUDA tensors. Two processes share one GPU over gloo (through host memory)
# and over braid's Communicator; NCCL needs one GPU per rank.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_cuda_build = pytest.mark.skipif(not torch.cuda.is_available() or not is_cuda_build(),
                                      reason="needs a CUDA device and a braid build with CUDA")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
DIM, HEADS, HIDDEN, BATCH, SEQ, VOCAB = 32, 4, 64, 2, 8, 48
# float32 on the GPU with TF32 off: the sharded model sums the same products in another order;
# a few ulps per layer, far below 1e-4; a wrong shard or reduction is off by O(1).
GPU_TOL = {"atol": 1e-4, "rtol": 1e-4}


def _gpu_group(kind, rank, world_size, store_path):
    """(context, device) for carrier ``kind`` on CUDA: "gloo", "braid" (braid's c10d backend),
    "communicator", or "nccl"."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    if kind == "nccl":
        return process_group(rank, world_size, store_path, backend="nccl"), device
    return carrier(kind, rank, world_size, store_path), device


def _tp_on_gpu(rank, world_size, store_path, kind, sequence_parallel):
    ctx, device = _gpu_group(kind, rank, world_size, store_path)
    with ctx as c:
        c = dist.group.WORLD if c is None else c
        torch.manual_seed(0)
        dense = Block(DIM, HEADS, HIDDEN).to(device)
        model = tp.parallelize(copy.deepcopy(dense), c, BLOCK_PLAN)
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(BATCH, SEQ, DIM, generator=g, device=device)
        w = torch.randn(BATCH, SEQ, DIM, generator=g, device=device)
        xd, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        (dense(xd) * w).sum().backward()
        out = model(xt)
        (out * w).sum().backward()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, dense(x), **GPU_TOL)
        torch.testing.assert_close(xt.grad, xd.grad, **GPU_TOL)
        grp = as_group(c)
        for name, m in model.named_modules():
            if isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear)):
                ref = dense.get_submodule(name).weight.grad
                dim = 0 if isinstance(m, tp.ColumnParallelLinear) else 1
                torch.testing.assert_close(m.weight.grad, ref.chunk(grp.world_size, dim)[grp.rank], **GPU_TOL)
        return out.device.type


def _zero_on_gpu(rank, world_size, store_path, kind, stage, mixed):
    """The ZeRO wrapper on CUDA parameters against the dense model trained on the whole batch."""
    ctx, device = _gpu_group(kind, rank, world_size, store_path)
    with ctx as c:
        c = dist.group.WORLD if c is None else c
        torch.manual_seed(0)
        dense = LanguageModel(VOCAB, DIM, HEADS, HIDDEN, layers=2).to(device)
        policy = (zero.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if mixed else None)
        sharded = zero.shard(copy.deepcopy(dense), c, stage=stage, bucket_cap_mb=0.01, mp_policy=policy)
        assert all(p.device == device for p in sharded.parameters())
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (dense, sharded)]
        ids = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(r))
               .to(device) for r in range(world_size)]

        def loss_of(m, batch):
            logits = m(batch[:, :-1])
            return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

        losses = []
        for _ in range(3):
            for o in opts:
                o.zero_grad()
            (sum(loss_of(dense, b) for b in ids) / world_size).backward()  # the mean over ranks' batches
            loss = loss_of(sharded, ids[rank])
            loss.backward()
            for o in opts:
                o.step()
            losses.append(loss.item())
        full = sharded.full_state_dict()
        tol = {"atol": 3e-2, "rtol": 0} if mixed else GPU_TOL  # bfloat16 compute: see test_zero
        for k, v in dense.state_dict().items():
            torch.testing.assert_close(full[k], v, **tol, msg=lambda m, k=k: f"{k}: {m}")
        return losses


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ("gloo", "braid", "communicator"))
@pytest.mark.parametrize("sequence_parallel", (False,))
def test_tp_on_cuda_tensors(kind, sequence_parallel):
    if kind != "gloo" and not is_cuda_build():
        pytest.skip("needs a braid build with CUDA")
    assert run_ranks(_tp_on_gpu, 2, kind, sequence_parallel) == ["cuda", "cuda"]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ("gloo", "braid", "communicator"))
@pytest.mark.parametrize("stage,mixed", ((3, False), (2, False), (3, True)))
def test_zero_on_cuda_parameters(kind, stage, mixed):
    if kind != "gloo" and not is_cuda_build():
        pytest.skip("needs a braid build with CUDA")
    losses = run_ranks(_zero_on_gpu, 2, kind, stage, mixed)
    assert losses[0][-1] < losses[0][0], losses


@needs_two_gpus
@pytest.mark.gpu
def test_tp_and_zero_over_nccl():
    assert run_ranks(_tp_on_gpu, 2, "nccl", False) == ["cuda", "cuda"]
    run_ranks(_zero_on_gpu, 2, "nccl", 3, False)


def test_old_names_of_the_group_argument_still_work_with_a_warning():
    """The layers take their group as ``group=``; ``communicator=`` (tp, cp, fsdp) and
    ``process_group=`` (the DDP hook) still work, with a DeprecationWarning; both at once is a
    TypeError. Positional calls are unchanged."""
    from braid.comm import cp, ddp

    c = make_comm(0, 1, new_store_path())
    try:
        warning = r"ColumnParallelLinear.__init__\(\): communicator= is now group="
        with pytest.warns(DeprecationWarning, match=warning):
            old = tp.ColumnParallelLinear(4, 6, communicator=c)
        new = tp.ColumnParallelLinear(4, 6, group=c)
        assert old.weight.shape == new.weight.shape == (6, 4)
        with pytest.raises(TypeError, match="got both communicator= and group="):
            tp.ColumnParallelLinear(4, 6, communicator=c, group=c)
        with pytest.warns(DeprecationWarning, match="communicator= is now group="):
            idx = cp.shard_indices(8, communicator=c, balanced=False)
        assert torch.equal(idx, cp.shard_indices(8, c, balanced=False))
        with pytest.warns(DeprecationWarning, match="communicator= is now group="):
            zero.shard(nn.Linear(3, 3), communicator=c)
        with pytest.warns(DeprecationWarning, match=r"comm_hook\(\): process_group= is now group="):
            state, _ = ddp.comm_hook(process_group=c)
        assert state.group is c and state.process_group is c and state.communicator is c
    finally:
        c.close()
