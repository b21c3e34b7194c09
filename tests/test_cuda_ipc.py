"""CUDA tensors between the ranks of one host, device to device (CUDA IPC): every collective exact
against a locally computed result from one element to 256 MiB, uneven all-to-alls, the path
chosen and reported, the staged path when IPC is off, and a killed peer. GPU only; several ranks
share one GPU here, as users with one GPU per process run the same code.

The schedules and their ordering protocol are tested without a GPU (csrc/tests/ipc_test.cc, ctest
suite "ipc"), and the reduction kernel bit for bit through the host emulation (suite
"cuda_kernels")."""

import time
from datetime import timedelta

import pytest
import torch
from braid.comm.core.build_info import is_cuda_build
from helpers.ranks import FreshRanks, environment, make_comm, open_store, process_group, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not is_cuda_build(),
                       reason="needs a CUDA device and a braid build with CUDA"),
]

MiB = 1 << 20
# Elements per rank: 1, a prime, around the one-shot limit (256 KiB of float32 = 65536) and a
# scratch area (16 MiB = 4 Mi float32), and 256 MiB of float32.
COUNTS = (1, 7919, 65535, 65536, 65537, 4 * MiB - 1, 4 * MiB + 3, 64 * MiB)


def _device(rank: int) -> torch.device:
    d = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(d)
    return d


def _ints(rank: int, count: int, salt: int, dtype=torch.float32) -> torch.Tensor:
    """Small integers: float32 sums over a few ranks are exact, so any order gives the same bits."""
    return ((torch.arange(count, dtype=torch.int64) * (rank + 3) + salt) % 17 - 8).to(dtype)


def ipc_collectives(rank, n, store_path, counts):
    device = _device(rank)
    c = make_comm(rank, n, store_path, device=device)
    failures = []

    def check(name, got, want):
        if not torch.equal(got.cpu(), want):
            wrong = (got.cpu() != want).sum().item()
            failures.append(f"rank {rank}: {name}: {wrong} of {want.numel()} differ")

    try:
        c.all_reduce(torch.zeros(1, device=device))
        path = c._c.device_path(device.index)
        for salt, count in enumerate(counts):
            dtypes = (torch.float32, torch.bfloat16, torch.int64) if count < MiB else (torch.float32,)
            for dtype in dtypes:
                what = f"{count} {dtype}"
                inputs = [_ints(r, count, salt, dtype) for r in range(n)]
                total = sum(x.double() for x in inputs).to(dtype)
                t = inputs[rank].to(device)
                c.all_reduce(t)
                check(f"all_reduce {what}", t, total)
                t = inputs[rank].to(device)
                c.all_reduce(t, op="max", async_op=True).wait()
                check(f"all_reduce max {what}", t, torch.stack(inputs).max(0).values)
                out = torch.empty(count * n, dtype=dtype, device=device)
                c.all_gather(out, inputs[rank].to(device))
                check(f"all_gather {what}", out, torch.cat(inputs))
                whole = [_ints(r, count * n, salt + 1, dtype) for r in range(n)]
                part = torch.empty(count, dtype=dtype, device=device)
                c.reduce_scatter(part, whole[rank].to(device))
                want = sum(x.double() for x in whole).to(dtype)[rank * count:(rank + 1) * count]
                check(f"reduce_scatter {what}", part, want)
                a2a = torch.empty(count * n, dtype=dtype, device=device)
                c.all_to_all(a2a, whole[rank].to(device))
                mine = torch.cat([w[rank * count:(rank + 1) * count] for w in whole])
                check(f"all_to_all {what}", a2a, mine)
                b = inputs[rank].to(device)
                c.broadcast(b, src=n - 1)
                check(f"broadcast {what}", b, inputs[n - 1])
        torch.cuda.synchronize()
    finally:
        c.close()
    return path, failures


@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_exact_device_to_device(n):
    counts = COUNTS if n == 2 else COUNTS[:-1]  # 4 ranks x 256 MiB x 3 tensors outgrow a shared GPU's share
    for path, failures in run_ranks(ipc_collectives, n, counts, deadline_s=300):
        assert path == "ipc"
        assert failures == []


def uneven_all_to_all(rank, n, store_path):
    """Rank i sends (i + j) % 3 * 1000 + j rows to rank j (some pieces empty), rows of 3 elements."""
    device = _device(rank)
    c = make_comm(rank, n, store_path, device=device)
    try:
        sends = [[(i + j) % 3 * 1000 + j if (i + j) % 3 else 0 for j in range(n)] for i in range(n)]
        rows = [torch.cat([_ints(i, sends[i][j] * 3, 10 * j).reshape(-1, 3) for j in range(n)])
                for i in range(n)]
        out = torch.empty(sum(sends[i][rank] for i in range(n)), 3, device=device)
        c.all_to_all(out, rows[rank].to(device), output_split_sizes=[sends[i][rank] for i in range(n)],
                     input_split_sizes=sends[rank])
        offsets = [[sum(sends[i][:j]) for j in range(n)] for i in range(n)]
        want = torch.cat([rows[i][offsets[i][rank]:offsets[i][rank] + sends[i][rank]] for i in range(n)])
        return torch.equal(out.cpu(), want), c._c.device_path(device.index)
    finally:
        c.close()


@pytest.mark.parametrize("n", [2, 3])
def test_uneven_all_to_all_device_to_device(n):
    for exact, path in run_ranks(uneven_all_to_all, n, deadline_s=120):
        assert path == "ipc"
        assert exact


def staged_when_off(rank, n, store_path):
    device = _device(rank)
    with environment({"BRAID_CUDA_IPC": "0"}):
        c = make_comm(rank, n, store_path, device=device)
        try:
            t = _ints(rank, 1000, 0).to(device)
            c.all_reduce(t)
            exact = torch.equal(t.cpu(), sum(_ints(r, 1000, 0) for r in range(n)))
            return exact, c._c.device_path(device.index)
        finally:
            c.close()


def test_ipc_off_falls_back_to_staging_and_says_so():
    for exact, path in run_ranks(staged_when_off, 2, deadline_s=120):
        assert exact
        assert path.startswith("staged: rank 0 of the host could not set up CUDA IPC"), path


def backend_collectives(rank, n, store_path):
    """The c10d backend's calls on CUDA tensors take the same path: all_reduce and
    all_to_all_single with split sizes."""
    import torch.distributed as dist

    device = _device(rank)
    with process_group(rank, n, store_path, backend="cpu:braid,cuda:braid"):
        t = _ints(rank, 5000, 3).to(device)
        dist.all_reduce(t)
        ok = torch.equal(t.cpu(), sum(_ints(r, 5000, 3) for r in range(n)))
        sizes = [[1 + i + 2 * j for j in range(n)] for i in range(n)]
        src = _ints(rank, sum(sizes[rank]), 5).to(device)
        out = torch.empty(sum(sizes[i][rank] for i in range(n)), device=device)
        dist.all_to_all_single(out, src, [sizes[i][rank] for i in range(n)], sizes[rank])
        pieces = []
        for i in range(n):
            start = sum(sizes[i][:rank])
            pieces.append(_ints(i, sum(sizes[i]), 5)[start:start + sizes[i][rank]])
        return ok and torch.equal(out.cpu(), torch.cat(pieces))


def test_backend_on_cuda_tensors_device_to_device():
    assert all(run_ranks(backend_collectives, 2, deadline_s=120))


def killed_while_waiting(rank, n, store_path):
    from braid import comm

    device = _device(rank)
    c = make_comm(rank, n, store_path, device=device, timeout=30)
    t = torch.ones(4 * MiB, device=device)
    c.all_reduce(t)  # the channel is up
    torch.cuda.synchronize()
    if rank == 1:
        open_store(store_path).set("channel up", "1")
        time.sleep(60)  # killed by the test meanwhile
    began = time.monotonic()
    try:
        for _ in range(3):
            c.all_reduce(t)
        torch.cuda.synchronize()
    except comm.PeerError as e:
        return "PeerError", time.monotonic() - began, str(e)
    return "none", time.monotonic() - began, ""


def test_killed_peer_raises_peer_error_not_a_hang():
    with FreshRanks(2) as ranks:
        ranks.start(killed_while_waiting)
        open_store(ranks.store_path).wait(["channel up"], timedelta(seconds=120))
        ranks.kill(1)
        outcome = ranks.outcomes(deadline_s=60)[0]
    assert outcome[0] == "ok", outcome
    kind, waited, message = outcome[1]
    assert kind == "PeerError", message
    assert waited < 10, waited  # detection is about a second after the kill, not the 30 s timeout
