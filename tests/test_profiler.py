"""The named ranges braid's communicator calls leave in torch.profiler traces (docs/usage/errors.md:
collective and point-to-point calls "appear as named ranges (`braid::all_reduce`, `braid::send`,
...)" in `torch.profiler` traces).

Each rank issues one call of every kind the binding names a range for (csrc/binding/
torch_binding.cpp), each inside a user range of its own, under torch.profiler on the CPU. Every
call must leave exactly its own range, with its exact name, as a child of the user range around
it: on the calling thread, within the call. A missing, renamed, doubled or misplaced range fails.
"""
import torch
from helpers.ranks import make_comm, run_ranks
from torch.profiler import ProfilerActivity, profile, record_function


def _calls(c):
    """(range name, call) for every call kind, the same sequence on every rank; integer-valued
    payloads so the results are checked exactly."""
    n, r = c.world_size, c.rank
    peer = (r + 1) % n
    source = (r - 1) % n
    rows = torch.arange(n * 2, dtype=torch.float32) + 10 * r
    received = torch.zeros(2)

    def all_reduce():
        t = torch.full((5,), float(r + 1))
        c.all_reduce(t)
        assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2)))

    def all_reduce_async():
        t = torch.full((3,), float(r))
        c.all_reduce(t, op="max", async_op=True).wait()
        assert torch.equal(t, torch.full((3,), float(n - 1)))

    def reduce_scatter():
        out = torch.zeros(2)
        c.reduce_scatter(out, torch.ones(2 * n))
        assert torch.equal(out, torch.full((2,), float(n)))

    def all_gather():
        out = torch.zeros(n)
        c.all_gather(out, torch.tensor([float(r)]))
        assert torch.equal(out, torch.arange(n, dtype=torch.float32))

    def all_to_all():
        out = torch.zeros(2 * n)
        c.all_to_all(out, rows)
        assert torch.equal(out, torch.cat([torch.tensor([2.0 * r, 2.0 * r + 1]) + 10 * j for j in range(n)]))

    def all_to_all_v():
        out = torch.zeros(2 * n)
        c.all_to_all(out, rows, output_split_sizes=[2] * n, input_split_sizes=[2] * n)
        assert torch.equal(out, torch.cat([torch.tensor([2.0 * r, 2.0 * r + 1]) + 10 * j for j in range(n)]))

    def broadcast():
        t = torch.full((4,), float(r))
        c.broadcast(t, src=n - 1)
        assert torch.equal(t, torch.full((4,), float(n - 1)))

    def send():
        c.send(torch.tensor([float(r), 7.0]), peer, async_op=True).wait()

    def recv():
        c.recv(received, source)
        assert torch.equal(received, torch.tensor([float(source), 7.0]))

    # Every rank posts its send async before its blocking receive: a ring that cannot deadlock.
    return [("braid::all_reduce", all_reduce), ("braid::all_reduce", all_reduce_async),
            ("braid::reduce_scatter", reduce_scatter), ("braid::all_gather", all_gather),
            ("braid::all_to_all", all_to_all), ("braid::all_to_all_v", all_to_all_v),
            ("braid::broadcast", broadcast), ("braid::send", send), ("braid::recv", recv),
            ("braid::barrier", lambda: c.barrier())]


def _ranges_of_each_call(rank, world_size, store_path):
    """Runs every call kind under the profiler, call i inside the user range "call{i}"; returns
    the expected range names and, per user range, the names of braid's ranges directly inside it
    (and the braid ranges found anywhere else)."""
    with make_comm(rank, world_size, store_path) as c:
        calls = _calls(c)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i, (_, call) in enumerate(calls):
                with record_function(f"call{i}"):
                    call()
        inside = {f"call{i}": [] for i in range(len(calls))}
        elsewhere = []
        for e in prof.events():
            if not e.name.startswith("braid::"):
                continue
            parent = e.cpu_parent.name if e.cpu_parent is not None else None
            (inside[parent] if parent in inside else elsewhere).append(e.name)
        return [name for name, _ in calls], inside, elsewhere


def test_every_call_kind_leaves_its_named_range_inside_the_call():
    """2 ranks: each of all_reduce (blocking and async), reduce_scatter, all_gather, all_to_all
    (equal and with split sizes), broadcast, send, recv and barrier appears once, under its exact
    name, inside the user range wrapped around the call."""
    for expected, inside, elsewhere in run_ranks(_ranges_of_each_call, 2):
        assert elsewhere == [], f"braid ranges outside any call: {elsewhere}"
        assert [inside[f"call{i}"] for i in range(len(expected))] == [[name] for name in expected], inside

