"""braid's c10d backend for CUDA tensors: which device types a group registers braid for (every
build), the errors a build without CUDA gives, and (GPU builds, marked) collectives, DDP, the DDP
hook and FSDP2 on CUDA tensors through torch.distributed against exact references.

On a CPU-only torch, gloo stands in for NCCL in "cpu:braid,cuda:<other>": the factory's decision
is the same for any backend braid shares a group with. The staging pipeline's scheduling is
tested without a GPU in C++ (csrc/tests/staging_test.cc); test_cuda_comm.py covers the
Communicator's own CUDA calls.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from braid.comm import _C
from braid.comm.core import backend as braid_backend
from braid.comm.core.build_info import is_cuda_build
from helpers.ranks import (COMM_TIMEOUT_S, environment, make_comm, new_store_path, open_store, process_group,
                           run_ranks)

CUDA_BUILD = is_cuda_build()
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not CUDA_BUILD,
    reason="needs a CUDA device and a braid build with CUDA",
)
cpu_only_build = pytest.mark.skipif(CUDA_BUILD, reason="this braid build has CUDA")


def _device_types(pg) -> set:
    return {d.type for d in pg._device_types}


@pytest.fixture
def backend1():
    """A braid c10d backend over a one-rank communicator, and its store."""
    path = new_store_path()
    c = make_comm(0, 1, path)
    yield _C.Backend(c._release_core()), open_store(path)


# ---------------------------------------------------------------------------------------------
# Every build: registration.


def test_registered_devices_follow_the_build():
    assert braid_backend.backend_devices(True) == ["cpu", "cuda"]
    assert braid_backend.backend_devices(False) == ["cpu"]
    assert dist.Backend.backend_capability["braid"] == braid_backend.backend_devices(CUDA_BUILD)
    # "braid" alone means braid for every device type it serves.
    config = dist.distributed_c10d.BackendConfig(dist.Backend("braid"))
    assert sorted(config.get_device_backend_map()) == sorted(braid_backend.backend_devices(CUDA_BUILD))


def test_process_group_registers_braid_for_each_device_type(backend1):
    """The group of a braid-only group serves every device type it was made for with the one
    backend, and no other; bad device names are refused naming the argument."""
    backend, store = backend1
    both = _C.ProcessGroup(store, backend, ["cpu", "cuda"])
    assert _device_types(both) == {"cpu", "cuda"}
    assert both._get_backend(torch.device("cuda")) is both._get_backend(torch.device("cpu"))
    assert both._get_backend_name() == "braid"
    cpu = _C.ProcessGroup(store, backend)
    assert _device_types(cpu) == {"cpu"}
    with pytest.raises(RuntimeError, match="No backend type associated with device type cuda"):
        cpu._get_backend(torch.device("cuda"))
    with pytest.raises(ValueError, match="devices may hold 'cpu' and 'cuda', got 'meta'"):
        _C.ProcessGroup(store, backend, ["cpu", "meta"])
    with pytest.raises(ValueError, match="devices must name at least one device type"):
        _C.ProcessGroup(store, backend, [])


def test_served_devices_are_checked_against_the_build():
    braid, gloo = dist.Backend("braid"), dist.Backend("gloo")
    braid_backend._check_served_devices({"cpu": braid, "cuda": braid}, cuda_build=True)
    braid_backend._check_served_devices({"cpu": braid, "cuda": gloo}, cuda_build=False)
    with pytest.raises(ValueError, match="'cuda:braid' needs braid built with CUDA.*'cpu:braid,cuda:nccl'"):
        braid_backend._check_served_devices({"cpu": braid, "cuda": braid}, cuda_build=False)
    with pytest.raises(ValueError, match="'xpu:braid': braid serves cpu and cuda tensors, not xpu"):
        braid_backend._check_served_devices({"xpu": braid}, cuda_build=True)


def _run_groups(rank, n, store_path):
    """A braid-only default group is braid's ProcessGroup subclass, registered for the build's
    device types; a group pairing braid with another backend for CUDA (gloo standing in for
    NCCL) is torch's own ProcessGroup with braid for CPU tensors and the other for CUDA ones."""
    with process_group(rank, n, store_path, "braid"):
        world = dist.group.WORLD
        assert isinstance(world, _C.ProcessGroup)
        assert _device_types(world) == set(braid_backend.backend_devices(CUDA_BUILD))
        mixed = dist.new_group(backend="cpu:braid,cuda:gloo", timeout=timedelta(seconds=COMM_TIMEOUT_S))
        assert not isinstance(mixed, _C.ProcessGroup)
        assert isinstance(mixed._get_backend(torch.device("cpu")), _C.Backend)
        assert isinstance(mixed._get_backend(torch.device("cuda")), dist.ProcessGroupGloo)
        t = torch.arange(6, dtype=torch.float64) * (rank + 1)
        dist.all_reduce(t, group=mixed)
        assert torch.equal(t, torch.arange(6, dtype=torch.float64) * sum(range(1, n + 1)))
        if CUDA_BUILD:
            both = dist.new_group(backend="cpu:braid,cuda:braid")
            assert isinstance(both, _C.ProcessGroup) and _device_types(both) == {"cpu", "cuda"}
    return True


def test_braid_only_and_mixed_groups():
    assert run_ranks(_run_groups, 2) == [True, True]


def _run_cuda_braid_refused(rank, n, store_path):
    """'cuda:braid' in a build without CUDA fails at init naming the fix, and leaves torch ready
    for the next init."""
    store = dist.PrefixStore("refused/", open_store(store_path))
    with pytest.raises(ValueError, match="'cuda:braid' needs braid built with CUDA"):
        dist.init_process_group("cpu:braid,cuda:braid", store=store, rank=rank, world_size=n,
                                timeout=timedelta(seconds=COMM_TIMEOUT_S))
    assert not dist.is_initialized()
    with process_group(rank, n, store_path, "cpu:braid"):
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [float(n)] * 3
    return True


@cpu_only_build
def test_cuda_braid_refused_without_cuda_build():
    assert run_ranks(_run_cuda_braid_refused, 1) == [True]


@cpu_only_build
def test_cuda_tensors_refused_naming_the_argument_without_cuda_build(backend1):
    """A CUDA tensor reaching the backend of a CPU-only build (a fake tensor stands in: this torch
    has no CUDA) is refused naming the call, the argument and the build, before anything is sent."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    backend, _ = backend1
    with FakeTensorMode():
        gpu = torch.empty(8, device="cuda")
    cpu = torch.zeros(8)
    msg = "is on cuda:0, but this braid build takes CPU tensors only"
    with pytest.raises(ValueError, match=f"braid allreduce: tensor {msg}"):
        backend.allreduce([gpu])
    with pytest.raises(ValueError, match=f"braid _allgather_base: input {msg}"):
        backend._allgather_base(cpu, gpu)
    with pytest.raises(ValueError, match=f"braid broadcast: tensor {msg}"):
        backend.broadcast([gpu])
    with pytest.raises(ValueError, match=f"braid send: tensor {msg}"):
        backend.send([gpu], 0, 0)
    backend.allreduce([cpu]).wait()  # still usable


@pytest.mark.skipif(not CUDA_BUILD, reason="the check of a CUDA build")
def test_other_devices_refused_with_cuda_build(backend1):
    backend, _ = backend1
    with pytest.raises(ValueError, match="allreduce: tensor must be a CPU or CUDA tensor, got one on meta"):
        backend.allreduce([torch.empty(8, device="meta")])


# ---------------------------------------------------------------------------------------------
# GPU: torch.distributed on CUDA tensors over braid, 2 ranks (on one GPU when there is one).

# 4 KiB chunks, two slots: a 5000-element float32 tensor is five chunks, reusing each slot.
STAGING_ENV = {"BRAID_STAGING_CHUNK_BYTES": "4096", "BRAID_STAGING_SLOTS": "2"}
COUNTS = (0, 1, 1025, 5000)


def cuda_dist_collectives(rank, n, store_path, backend):
    """Every collective DDP and FSDP2 use, and the other staged ones, on CUDA tensors through
    torch.distributed: results equal to exact references (small integers: every sum is exact),
    blocking calls ordered after writes queued before them and before kernels queued after,
    async works and futures ordered on the waiting stream; point-to-point and mixed devices
    refused; CPU tensors still served without staging in the same group."""
    from test_cuda_comm import _input, cases, check_all_reduce_ordering

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    failures = []

    def check(name, got, want):
        if not torch.equal(got.cpu(), want):
            failures.append(f"rank {rank}: {name}: {(got.cpu() != want).sum().item()} elements differ")

    calls = 0
    with environment(STAGING_ENV), process_group(rank, n, store_path, backend):
        world = dist.group.WORLD
        if not (isinstance(world, _C.ProcessGroup) and _device_types(world) == {"cpu", "cuda"}):
            failures.append(f"rank {rank}: {backend} gave {type(world).__name__} for {_device_types(world)}")
        for calls, count, dtype, inputs, total in cases(n, COUNTS):
            mine = inputs[rank]
            what = f"{count} {dtype}"
            avg = dist.ReduceOp.AVG
            check_all_reduce_ordering(check, dist.all_reduce, avg, mine, total, n, device, what)

            t = mine.to(device)
            fut = dist.all_reduce(t, async_op=True).get_future()
            check(f"future {what}", fut.then(lambda f: f.value()[0] + 1).wait(), total + 1)

            t = mine.to(device)
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
            check(f"premul_sum {what}", t, (total.float() * 0.5).to(dtype))

            b = mine.to(device)
            dist.broadcast(b, src=n - 1, async_op=True).wait()
            check(f"broadcast {what}", b, inputs[n - 1])

            outs = [torch.zeros(count, dtype=dtype, device=device) for _ in range(n)]
            outs[0] = torch.zeros(2 * count, dtype=dtype, device=device)[::2]  # written through a copy
            dist.all_gather(outs, mine.to(device))
            for r in range(n):
                check(f"all_gather {what} [{r}]", outs[r], inputs[r])
            whole = torch.zeros(n * count, dtype=dtype, device=device)
            dist.all_gather_into_tensor(whole, mine.to(device))
            check(f"all_gather_into_tensor {what}", whole, torch.cat(inputs))

            big = [_input(r, count * n, calls + 500, dtype) for r in range(n)]
            want = torch.stack([x.float() for x in big]).sum(0).to(dtype)[rank * count:(rank + 1) * count]
            part = torch.empty(count, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(part, big[rank].to(device), async_op=True).wait()
            check(f"reduce_scatter_tensor {what}", part, want)
            inplace = big[rank].to(device)
            mine_slice = inplace[rank * count:(rank + 1) * count]
            dist.reduce_scatter_tensor(mine_slice, inplace)
            check(f"reduce_scatter_tensor in place {what}", mine_slice, want)

            t = mine.to(device)
            dist.reduce(t, dst=0)
            check(f"reduce {what}", t, total if rank == 0 else mine)
            gathered = [torch.empty(count, dtype=dtype, device=device) for _ in range(n)]
            gathered = gathered if rank == 0 else None
            dist.gather(mine.to(device), gathered, dst=0)
            if rank == 0:
                for r in range(n):
                    check(f"gather {what} [{r}]", gathered[r], inputs[r])
            piece = torch.empty(count, dtype=dtype, device=device)
            dist.scatter(piece, [x.to(device) for x in inputs] if rank == 0 else None, src=0)
            check(f"scatter {what}", piece, inputs[rank])
            a2a = torch.empty(count * n, dtype=dtype, device=device)
            dist.all_to_all_single(a2a, big[rank].to(device))
            check(f"all_to_all_single {what}", a2a,
                  torch.cat([big[r][rank * count:(rank + 1) * count] for r in range(n)]))

        t = torch.arange(5.0) * (rank + 1)
        dist.all_reduce(t)  # a CPU tensor in the same group
        check("cpu all_reduce", t, torch.arange(5.0) * sum(range(1, n + 1)))
        # Point-to-point on CUDA tensors (through host memory): a ring of isend/irecv, the received
        # tensor non-contiguous, and a write queued on the stream before the irecv (which the copy
        # into it must follow, not precede).
        mine = torch.arange(6.0, device=device) + 10 * rank
        got = torch.full((3, 2), -1.0, device=device).t()
        got.fill_(-2.0)
        works = [dist.isend(mine, dst=(rank + 1) % n), dist.irecv(got, src=(rank - 1) % n)]
        for w in works:
            w.wait()
        check("isend/irecv", got, (torch.arange(6.0) + 10 * ((rank - 1) % n)).reshape(2, 3))
        with pytest.raises(ValueError, match="the tensors of one call must be on one device"):
            dist.all_gather_into_tensor(torch.empty(2 * n, device=device), torch.ones(2))
        t = torch.ones(3, device=device)
        dist.all_reduce(t)  # argument errors are raised before anything is sent
        check("after errors", t, torch.full((3,), float(n)))
        torch.cuda.synchronize()
    return failures, calls


@needs_cuda
@pytest.mark.parametrize("backend", ["braid", "cpu:braid,cuda:braid"])
def test_collectives_on_cuda_tensors_through_torch_distributed(backend):
    results = run_ranks(cuda_dist_collectives, 2, backend, deadline_s=400)
    for failures, calls in results:
        assert calls == len(COUNTS) * 2
        assert failures == []


def _fsdp2_params(mesh, device, rank, steps=4):
    """A float64 MLP sharded with fully_shard on ``mesh``, trained on each rank's own batches."""
    from helpers import SmallMLP
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(SmallMLP().to(device, torch.float64), mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g, dtype=torch.float64).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.full_tensor().cpu() for p in model.parameters()]


def cuda_training(rank, n, store_path):
    """test_ddp_hook's runs: torch's DDP and the exact braid hook on a CUDA model over braid
    (float64), and the int8 hook (float32), against gloo DDP on the CPU; FSDP2 on CUDA over
    braid against FSDP2 on a CPU gloo group."""
    from test_ddp_hook import EXACT_STEPS, TRAIN, _train

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    torch.cuda.set_device(rank % torch.cuda.device_count())
    exact = dict(TRAIN, steps=EXACT_STEPS)
    out = {}
    with process_group(rank, n, store_path, "gloo"):
        out["gloo cpu f64"] = _train(rank, "gloo", None, device="cpu", dtype=torch.float64, **exact)[:2]
        out["gloo cpu"] = _train(rank, "gloo", None, device="cpu", **TRAIN)[:2]
    with process_group(rank, n, store_path, "cpu:braid,cuda:braid"):
        out["ddp cuda f64"] = _train(rank, "gloo", None, device="cuda", dtype=torch.float64, **exact)[:2]
        out["hook cuda f64"] = _train(rank, "exact", None, device="cuda", dtype=torch.float64, **exact)[:2]
        out["int8 hook cuda"] = _train(rank, "int8", None, device="cuda", **TRAIN)[:2]
        gloo = dist.new_group(backend="gloo", timeout=timedelta(seconds=COMM_TIMEOUT_S))
        out["fsdp2 cuda"] = _fsdp2_params(init_device_mesh("cuda", (n,)), "cuda", rank)
        out["fsdp2 gloo cpu"] = _fsdp2_params(DeviceMesh.from_group(gloo, "cpu"), "cpu", rank)
    return out


@needs_cuda
def test_ddp_hook_and_fsdp2_on_cuda_model_over_braid():
    results = run_ranks(cuda_training, 2, deadline_s=500)

    def tensors(value):  # (parameters, loss) of a DDP run, or FSDP2's parameter list
        return [value[0]] if isinstance(value, tuple) else value

    for mode in results[0]:  # every rank holds the same model
        pairs = zip(tensors(results[0][mode]), tensors(results[1][mode]))
        assert all(torch.equal(a, b) for a, b in pairs), mode
    r = results[0]
    # float64: CUDA and CPU kernels round differently near 1e-16 relative; a missing or wrong
    # gradient reduction moves parameters by O(lr) = 0.05.
    for mode in ("ddp cuda f64", "hook cuda f64"):
        torch.testing.assert_close(r[mode][0], r["gloo cpu f64"][0], rtol=0, atol=1e-9)
    # test_ddp_hook's bound: the int8 hook within 10% of the exact run's held-out loss.
    assert r["int8 hook cuda"][1] <= 1.10 * r["gloo cpu"][1], (r["int8 hook cuda"][1], r["gloo cpu"][1])
    for a, b in zip(r["fsdp2 cuda"], r["fsdp2 gloo cpu"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def nccl_beside_braid(rank, n, store_path):
    """"cpu:braid,cuda:nccl": CPU tensors on braid, CUDA tensors on NCCL, both exact."""
    torch.cuda.set_device(rank)
    with process_group(rank, n, store_path, "cpu:braid,cuda:nccl"):
        world = dist.group.WORLD
        assert not isinstance(world, _C.ProcessGroup)
        assert isinstance(world._get_backend(torch.device("cpu")), _C.Backend)
        assert isinstance(world._get_backend(torch.device("cuda")), dist.ProcessGroupNCCL)
        for device in ("cpu", "cuda"):
            t = torch.arange(6.0, device=device) * (rank + 1)
            dist.all_reduce(t)
            assert torch.equal(t.cpu(), torch.arange(6.0) * sum(range(1, n + 1))), device
    return True


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_beside_braid():
    assert run_ranks(nccl_beside_braid, 2) == [True, True]
