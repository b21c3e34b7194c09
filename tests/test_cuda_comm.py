"""The braid Communicator on CUDA tensors: collectives device to device between a host's ranks
(CUDA IPC, tests/test_cuda_ipc.py) or staged through pinned host memory, ordered on the caller's
stream (GPU builds), and the errors a build without CUDA gives (every build).

The staging pipeline's scheduling (chunk boundaries, the order of copies and host steps, failures
midway) is tested without a GPU in C++ (csrc/tests/staging_test.cc, ctest suite "staging"). The
fallback path of all_to_all with split sizes and point-to-point (communicator.py's
_through_host) is tested on every build with the CPU standing in for the device (HostStandIn):
what it copies, when, and what the core is handed; on a GPU against exact results.
"""

import pytest
import torch
from braid import comm
from braid.comm.core.build_info import is_cuda_build
from braid.comm.core.communicator import Communicator
from helpers.ranks import environment, make_comm, new_store_path, run_ranks

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
# Every build: the fallback path's logic, the CPU standing in for the device.

SENTINEL = -7  # what a stand-in holds until the core writes it


class HostStandIn:
    """The fallback path's copies (communicator._HostStaging's methods) with the CPU as the
    device: it owns every tensor, its stand-ins are new CPU tensors (holding SENTINEL until
    written), and it logs each step in order: "down" (a copy down), "wait_down", "up" (a copy
    back), ("order", n) (a stream made to wait for the copy back logged n-th), "complete" (a
    future's value set)."""

    def __init__(self):
        self.log: list = []
        self.stand_ins: list = []  # those of written tensors, in order

    def owns(self, t):
        return True

    def host(self, t):
        h = torch.full(t.shape, SENTINEL, dtype=t.dtype)
        self.stand_ins.append(h)
        return h

    def down(self, t):
        self.log.append("down")
        return t.clone(memory_format=torch.contiguous_format)

    def wait_down(self):
        self.log.append("wait_down")

    def up(self, t, h):
        self.log.append("up")
        t.copy_(h)
        return len(self.log)

    def order(self, copied):
        self.log.append(("order", copied))

    def future(self):
        return torch.futures.Future()

    def complete(self, fut, value):
        self.log.append("complete")
        fut.set_result(value)


def _rows(rank: int, n: int, width: int = 2) -> torch.Tensor:
    """Rank ``rank``'s input of the uneven all_to_all: i + j + 1 rows of ``width`` from rank i to
    rank j (integers: exact in float32)."""
    count = sum(rank + j + 1 for j in range(n))
    return torch.arange(count * width, dtype=torch.float32).view(-1, width) + 100_000 * rank


def _uneven_reference(rank: int, n: int, width: int = 2) -> torch.Tensor:
    return torch.cat([_rows(i, n, width)[sum(i + j + 1 for j in range(rank)):][:i + rank + 1]
                      for i in range(n)])


def fallback_path(rank, n, store_path):
    """Every call of the fallback path, through the communicator's own methods, with HostStandIn
    stages (Communicator._staging patched to hand one out per call); returns the failures."""
    stages: list = []

    def staging(self, named):
        stages.append(HostStandIn())
        return stages[-1]

    failures = []

    def check(what, ok):
        if not ok:
            failures.append(f"rank {rank}: {what}: log {stages[-1].log if stages else None}")

    other = 1 - rank
    send, recv = [rank + j + 1 for j in range(n)], [i + rank + 1 for i in range(n)]
    want = _uneven_reference(rank, n)
    with make_comm(rank, n, store_path) as c, pytest.MonkeyPatch.context() as patch:
        patch.setattr(Communicator, "_staging", staging)
        # the host tensors' fast path skips _staging: the stand-ins stand for CUDA tensors
        patch.setattr(Communicator, "_host_tensors", staticmethod(lambda a, b: False))

        # Blocking: the input copied down and waited for, the core writes the output's stand-in,
        # copied back before the call returns.
        out = torch.full(want.shape, -1.0)
        assert c.all_to_all(out, _rows(rank, n), output_split_sizes=recv, input_split_sizes=send) is None
        check("blocking all_to_all", torch.equal(out, want) and torch.equal(stages[-1].stand_ins[0], want)
              and stages[-1].log == ["down", "wait_down", "up"])

        # Async: nothing copied back before wait(); the first wait() copies back and orders the
        # stream after that copy, a second orders it again without copying again.
        out = torch.full(want.shape, -1.0)
        w = c.all_to_all(out, _rows(rank, n), async_op=True, output_split_sizes=recv, input_split_sizes=send)
        check("async all_to_all before wait",
              stages[-1].log == ["down", "wait_down"] and bool((out == -1).all()))
        w.wait()
        w.wait()
        check("async all_to_all", torch.equal(out, want) and isinstance(w, comm.Work)
              and stages[-1].log == ["down", "wait_down", "up", ("order", 3), ("order", 3)])

        # The future: completes once the copy back is done, with the caller's tensor.
        out = torch.full(want.shape, -1.0)
        w = c.all_to_all(out, _rows(rank, n), async_op=True, output_split_sizes=recv, input_split_sizes=send)
        value = w.get_future().wait()
        w.wait()
        check("future", value[0] is out and torch.equal(out, want)
              and stages[-1].log == ["down", "wait_down", "up", "complete", ("order", 3)])

        # A batch: the send copied down, the receive copied back at its own wait() only.
        mine = torch.arange(5, dtype=torch.int64) + 10 * rank
        got = torch.full((5,), -1, dtype=torch.int64)
        works = c.batch_isend_irecv([comm.P2POp("send", mine, other), comm.P2POp("recv", got, other)])
        works[0].wait()
        check("batch, send waited", stages[-1].log == ["down", "wait_down"])
        works[1].wait()
        check("batch", torch.equal(got, torch.arange(5) + 10 * other)
              and stages[-1].log == ["down", "wait_down", "up", ("order", 3)])

        # send_recv into a strided view: its neighbours untouched.
        holder = torch.zeros(4, 2, dtype=torch.float64)
        c.send_recv(mine[:4].double(), other, holder[:, 0], other).wait()
        check("send_recv", torch.equal(holder[:, 0], (torch.arange(4) + 10 * other).double())
              and torch.equal(holder[:, 1], torch.zeros(4, dtype=torch.float64)))

        # Blocking send and recv (rank 0 sends first): the send copies down, the recv copies back.
        got = torch.full((3,), -1.0)
        if rank == 0:
            c.send(torch.ones(3) * 5, other)
            check("blocking send", stages[-1].log == ["down", "wait_down"])
            c.recv(got, other)
        else:
            c.recv(got, other)
            check("blocking recv", stages[-1].log == ["up"])
            c.send(torch.ones(3) * 6, other)
        check("blocking send and recv", torch.equal(got, torch.full((3,), 6.0 if rank == 0 else 5.0)))

        # A failed receive (another size than sent) raises at wait() and copies nothing back.
        if rank == 0:
            c.send(torch.ones(10), other)
        else:
            target = torch.full((12,), -1.0)
            w = c.recv(target, other, async_op=True)
            try:
                w.wait()
                failures.append("rank 1: a receive of the wrong size did not raise")
            except comm.CollectiveMismatch:
                check("failed receive", "up" not in stages[-1].log and bool((target == -1).all()))
    return failures


def test_fallback_path_copies_around_the_core_call():
    """all_to_all with split sizes, send, recv, batch_isend_irecv and send_recv on device tensors
    (the CPU standing in): the core sees host stand-ins, inputs are copied down and waited for
    before it, outputs copied back after it (blocking: before returning; async: at the first
    wait() or the future, once), every wait() orders the stream after the copy back, a failed
    call copies nothing back."""
    assert run_ranks(fallback_path, 2) == [[], []]


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


def cuda_collectives(rank, n, store_path, ipc):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    c = make_comm(rank, n, store_path, device=device, **STAGING)
    failures = []
    with environment({"BRAID_CUDA_IPC": "1" if ipc else "0"}):  # read at the device's first call
        c.all_reduce(torch.zeros(1, device=device))
    path = c._c.device_path(device.index)
    if (path == "ipc") != ipc:
        failures.append(f"rank {rank}: the path is {path!r}")

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
@pytest.mark.parametrize("ipc", [True, False], ids=["device-to-device", "staged"])
def test_collectives_on_cuda_tensors(ipc):
    """The stream semantics and every collective on both paths a host's ranks can take."""
    results = run_ranks(cuda_collectives, 2, ipc, deadline_s=300)
    for failures, calls in results:
        assert calls == len(COUNTS) * 2
        assert failures == []


def cuda_fallback(rank, n, store_path):
    """all_to_all with split sizes and point-to-point on CUDA tensors (the fallback path): exact,
    the copies down after the caller's stream's work, the copies back before its later work, and
    an async call waited on another stream ordered after its copy back."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    c = make_comm(rank, n, store_path, device=device)
    failures = []

    def check(name, got, want):
        if not torch.equal(got.cpu(), want):
            failures.append(f"rank {rank}: {name}: {(got.cpu() != want).sum().item()} elements differ")

    other = 1 - rank
    send, recv = [rank + j + 1 for j in range(n)], [i + rank + 1 for i in range(n)]
    try:
        for width in (2, 1000):
            want = _uneven_reference(rank, n, width)
            x = torch.full((sum(send), width), 99.0, device=device)
            _slow_fill(x, _rows(rank, n, width).to(device, non_blocking=True))
            out = torch.empty(want.shape, device=device)
            c.all_to_all(out, x, output_split_sizes=recv, input_split_sizes=send)
            out.mul_(2)
            check(f"blocking all_to_all, width {width}", out, want * 2)

            # Issued on a side stream kept busy after the call: the copy back queued there at
            # wait() runs late, and the default stream must wait for it.
            side = torch.cuda.Stream(device)
            with torch.cuda.stream(side):
                out = torch.full(want.shape, -1.0, device=device)
                w = c.all_to_all(out, _rows(rank, n, width).to(device), async_op=True,
                                 output_split_sizes=recv, input_split_sizes=send)
                torch.cuda._sleep(20_000_000)
            w.wait()
            check(f"async all_to_all, width {width}", out * 2, want * 2)

        for count in COUNTS:
            mine, theirs = _input(rank, count, 900), _input(other, count, 900)
            payload = torch.full((count,), 99.0, device=device)
            _slow_fill(payload, mine.to(device, non_blocking=True))
            holder = torch.zeros(count, 2, device=device)
            c.send_recv(payload, other, holder[:, 0], other).wait()
            check(f"send_recv {count} into a strided view", holder,
                  torch.stack([theirs, torch.zeros(count)], 1))

            got = torch.empty(count, device=device)
            if rank == 0:
                c.send(payload, other)
                c.recv(got, other)
            else:
                c.recv(got, other)
                c.send(payload, other)
            check(f"blocking send and recv {count}", got + 1, theirs + 1)

            got = torch.empty(count, device=device)
            works = c.batch_isend_irecv([comm.P2POp("recv", got, other), comm.P2POp("send", payload, other)])
            value = works[0].get_future().wait()
            works[1].wait()
            check(f"future of a batched recv {count}", value[0] * 2, theirs * 2)
        torch.cuda.synchronize()
    finally:
        c.close()
    return failures


@needs_cuda
def test_uneven_all_to_all_and_p2p_on_cuda_tensors():
    assert run_ranks(cuda_fallback, 2, deadline_s=300) == [[], []]


@needs_cuda
def test_cuda_argument_errors(comm1):
    t = torch.zeros(8, device="cuda")
    with pytest.raises(ValueError, match="output must be on cuda:0"):
        comm1.all_gather(torch.zeros(8), t)
    with pytest.raises(TypeError, match="has unsupported dtype"):
        comm1.all_reduce(torch.zeros(8, dtype=torch.complex64, device="cuda"))
    with pytest.raises(ValueError, match="input_split_sizes"):
        comm1.all_to_all(t, t.clone(), output_split_sizes=[8], input_split_sizes=[7])
    out = torch.empty(8, device="cuda")
    comm1.all_to_all(out, t + 1, output_split_sizes=[8], input_split_sizes=[8])  # still usable
    assert torch.equal(out.cpu(), torch.ones(8))
