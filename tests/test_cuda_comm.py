"""The braid Communicator on CUDA tensors: collectives staged through pinned host memory, ordered
on the caller's stream (GPU builds), and the errors a build without CUDA gives (every build).

The staging pipeline's scheduling (chunk boundaries, the order of copies and host steps, failures
midway) is tested without a GPU in C++ (csrc/tests/staging_test.cc, ctest suite "staging").
"""

import pytest
import torch
from braid.comm.build_info import is_cuda_build
from helpers.ranks import make_comm, new_store_path, run_ranks

CUDA_BUILD = is_cuda_build()

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not CUDA_BUILD,
    reason="needs a CUDA device and a braid build with CUDA",
)
cpu_only_build = pytest.mark.skipif(CUDA_BUILD, reason="this braid build has CUDA")


@pytest.fixture
def comm1():
    c = make_comm(0, 1, new_store_path())
    yield c
    c.close()


# ---------------------------------------------------------------------------------------------
# Every build: tensors braid cannot take are refused naming the argument.


@cpu_only_build
def test_non_cpu_tensor_without_cuda_build_is_named(comm1):
    """A tensor off the CPU (a meta tensor stands in for a CUDA one on this CPU-only torch) gets
    the build's limitation, naming the argument and the device, before anything is sent."""
    t = torch.empty(8, device="meta")
    cpu = torch.zeros(8)
    with pytest.raises(ValueError, match="tensor is on meta, but this braid build takes CPU tensors only"):
        comm1.all_reduce(t)
    with pytest.raises(ValueError, match="tensor is on meta, but this braid build takes CPU tensors only"):
        comm1.broadcast(t, 0, async_op=True)
    with pytest.raises(ValueError, match="input is on meta"):
        comm1.all_gather(cpu, t)
    with pytest.raises(ValueError, match="output is on meta"):
        comm1.reduce_scatter(t, cpu)
    with pytest.raises(ValueError, match="output is on meta"):
        comm1.all_to_all(t, cpu)
    assert comm1.all_reduce(cpu) is None  # the communicator is still usable


@cpu_only_build
def test_cuda_tensor_without_cuda_build_is_named(comm1):
    """A tensor that says it is on cuda:0 (a fake tensor: this torch has no CUDA) is refused by
    the same check, naming the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.empty(8, device="cuda")
        with pytest.raises(ValueError, match="tensor is on cuda:0, but this braid build takes CPU tensors"):
            comm1.all_reduce(t, async_op=True)


@cpu_only_build
def test_cuda_device_argument_without_cuda_build_is_named():
    with pytest.raises(ValueError, match="device='cuda' needs braid built with CUDA"):
        make_comm(0, 1, new_store_path(), device="cuda")


def test_bad_device_and_staging_arguments_are_named():
    for device in ("meta", "mps:0", "not-a-device"):
        with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:<index>'"):
            make_comm(0, 1, new_store_path(), device=device)
    with pytest.raises(ValueError, match="staging_chunk_bytes must be >= 1"):
        make_comm(0, 1, new_store_path(), staging_chunk_bytes=0)
    with pytest.raises(TypeError, match="staging_slots must be an int"):
        make_comm(0, 1, new_store_path(), staging_slots=2.0)
    c = make_comm(0, 1, new_store_path(), device="cpu", staging_chunk_bytes=4096, staging_slots=2)
    c.close()


@pytest.mark.skipif(not CUDA_BUILD, reason="the check of a CUDA build")
def test_other_devices_with_cuda_build_are_named(comm1):
    with pytest.raises(ValueError, match="tensor must be a CPU or CUDA tensor, got a tensor on meta"):
        comm1.all_reduce(torch.empty(8, device="meta"))


# ---------------------------------------------------------------------------------------------
# GPU: every collective on CUDA tensors against exact references, several chunks, blocking and
# async, ordered on the caller's stream both ways.

# 4 KiB chunks and two slots: a 5000-element float32 tensor is five chunks, reusing each slot.
STAGING = {"staging_chunk_bytes": 4096, "staging_slots": 2}
COUNTS = (0, 1, 1023, 1024, 1025, 5000)


def _input(rank: int, count: int, call: int, dtype=torch.float32) -> torch.Tensor:
    """Small integers, so that sums are exact in float32 and bfloat16 whatever the order."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randint(-8, 9, (count,), generator=g).to(dtype)


def _slow_fill(t: torch.Tensor, value: torch.Tensor) -> None:
    """Writes ``value`` into ``t`` on the current stream behind a long kernel: a call that did not
    wait for the caller's stream would read ``t`` before the write."""
    torch.cuda._sleep(20_000_000)
    t.copy_(value, non_blocking=True)


def cases(n: int, counts):
    """(call number, count, dtype, every rank's input, their sum) for each count in float32 and
    bfloat16."""
    call = 0
    for count in counts:
        for dtype in (torch.float32, torch.bfloat16):
            call += 1
            inputs = [_input(r, count, call, dtype) for r in range(n)]
            yield call, count, dtype, inputs, torch.stack([x.float() for x in inputs]).sum(0).to(dtype)


def check_all_reduce_ordering(check, all_reduce, avg, mine, total, n, device, what):
    """The stream semantics of ``all_reduce(tensor, op=..., async_op=...)`` (a Communicator's or
    torch.distributed's; ``avg`` its average op) on ``mine``, whose sum over the ranks is
    ``total``: a blocking call sees a write queued before it and a kernel queued after it sees
    the sum; an async one on a side stream orders that stream after the result at wait()."""
    dtype = mine.dtype
    t = torch.full((mine.numel(),), 99, dtype=dtype, device=device)
    _slow_fill(t, mine.to(device, non_blocking=True))
    all_reduce(t)
    t.mul_(2)
    check(f"all_reduce {what}", t, total * 2)

    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        t = mine.to(device)
        all_reduce(t, op=avg, async_op=True).wait()
        doubled = t * 2
    side.synchronize()
    check(f"async avg {what}", doubled, (total.float() / n).to(dtype) * 2)


def cuda_collectives(rank, n, store_path):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    c = make_comm(rank, n, store_path, device=device, **STAGING)
    failures = []

    def check(name, got, want):
        if not torch.equal(got.cpu(), want):
            failures.append(f"rank {rank}: {name}: {(got.cpu() != want).sum().item()} elements differ")

    call = 0
    try:
        for call, count, dtype, inputs, total in cases(n, COUNTS):
            mine = inputs[rank]
            what = f"{count} {dtype}"
            check_all_reduce_ordering(check, c.all_reduce, "avg", mine, total, n, device, what)

            # The future completes stream-ordered: a callback's result and a then() chain.
            t = mine.to(device)
            fut = c.all_reduce(t, async_op=True).get_future()
            chained = fut.then(lambda f: f.value()[0] + 1)
            check(f"future {count} {dtype}", chained.wait(), total + 1)

            # all_gather into a non-contiguous output, reduce_scatter, all_to_all, broadcast.
            out = torch.zeros(count, n, dtype=dtype, device=device).t()
            c.all_gather(out, mine.to(device))
            check(f"all_gather {count} {dtype}", out, torch.stack(inputs))
            whole = [_input(r, count * n, call + 500, dtype) for r in range(n)]
            part = torch.empty(count, dtype=dtype, device=device)
            c.reduce_scatter(part, whole[rank].to(device), async_op=True).wait()
            want = torch.stack([x.float() for x in whole]).sum(0).to(dtype)
            want = want[rank * count:(rank + 1) * count]
            check(f"reduce_scatter {count} {dtype}", part, want)
            a2a = torch.empty(count * n, dtype=dtype, device=device)
            c.all_to_all(a2a, whole[rank].to(device))
            want = torch.cat([whole[r][rank * count:(rank + 1) * count] for r in range(n)])
            check(f"all_to_all {count} {dtype}", a2a, want)
            b = mine.to(device)
            c.broadcast(b, src=n - 1, async_op=True).wait()
            check(f"broadcast {count} {dtype}", b, inputs[n - 1])
        torch.cuda.synchronize()
    finally:
        c.close()
    return failures, call


@needs_cuda
def test_collectives_on_cuda_tensors():
    results = run_ranks(cuda_collectives, 2, deadline_s=300)
    for failures, calls in results:
        assert calls == len(COUNTS) * 2
        assert failures == []


@needs_cuda
def test_cuda_argument_errors(comm1):
    t = torch.zeros(8, device="cuda")
    with pytest.raises(ValueError, match="output must be on cuda:0"):
        comm1.all_gather(torch.zeros(8), t)
    with pytest.raises(TypeError, match="has unsupported dtype"):
        comm1.all_reduce(torch.zeros(8, dtype=torch.complex64, device="cuda"))
    with pytest.raises(ValueError, match="split sizes takes CPU tensors only"):
        comm1.all_to_all(t, t.clone(), input_split_sizes=[8])
    comm1.all_reduce(t)  # still usable
