"""Bad arguments raise TypeError/ValueError naming the argument, before any communication.

Checked on a one-rank communicator in the test process, and on 2-3 ranks where only rank 0 makes
the bad calls: the valid collectives that follow prove that a rejected call neither used a
sequence number nor poisoned the communicator.
"""
import math
import os
import re
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from braid import comm
from helpers import braid_segments, make_input, reduce_reference
from helpers.ranks import make_comm, new_store_path, open_store, run_ranks


def bad_calls(c) -> list:
    """(what, call, error type, regex the message must match) for rank ``c.rank`` of ``c.world_size``."""
    n, r, m = c.world_size, c.rank, 4
    ar, rs, ag, bc = c.all_reduce, c.reduce_scatter, c.all_gather, c.broadcast
    base = torch.zeros(n * m + 1)  # one spare element so that shifted views stay in bounds
    inp, out, part = base[:n * m], torch.zeros(n * m), torch.zeros(m)
    shifted = base[r * m + 1:r * m + 1 + m]  # overlaps rank r's slice of inp without being it
    meta, cplx = torch.ones(3, device="meta"), torch.ones(3, dtype=torch.complex64)
    ones = torch.ones(3)
    calls = [
        ("all_reduce list", lambda: ar([1.0, 2.0]), TypeError, "tensor"),
        ("all_reduce numpy", lambda: ar(np.ones(3)), TypeError, "tensor"),
        ("all_reduce None", lambda: ar(None), TypeError, "tensor"),
        ("all_reduce complex64", lambda: ar(cplx), TypeError, "tensor.*dtype"),
        ("all_reduce bool", lambda: ar(torch.ones(3, dtype=torch.bool)), TypeError, "tensor.*dtype"),
        ("all_reduce int8", lambda: ar(torch.ones(3, dtype=torch.int8)), TypeError, "tensor.*dtype"),
        ("all_reduce meta", lambda: ar(meta), ValueError, "tensor.*CPU"),
        ("all_reduce sparse", lambda: ar(torch.ones(3).to_sparse()), ValueError, "tensor"),
        ("all_reduce op 'mean'", lambda: ar(ones, op="mean"), ValueError, "op"),
        ("all_reduce op None", lambda: ar(ones, op=None), ValueError, "op"),
        ("all_reduce op BAND", lambda: ar(ones, op=dist.ReduceOp.BAND), ValueError, "op"),
        ("async all_reduce complex64", lambda: ar(cplx, async_op=True), TypeError, "tensor.*dtype"),
        ("reduce_scatter output list", lambda: rs([0.0], inp), TypeError, "output"),
        ("reduce_scatter input list", lambda: rs(part, [0.0] * (n * m)), TypeError, "input"),
        ("reduce_scatter output meta", lambda: rs(part.to("meta"), inp), ValueError, "output"),
        ("reduce_scatter input meta", lambda: rs(part, inp.to("meta")), ValueError, "input"),
        ("reduce_scatter dtypes differ", lambda: rs(part.double(), inp), TypeError, "output and input"),
        ("reduce_scatter complex64", lambda: rs(cplx, torch.ones(3 * n, dtype=torch.complex64)),
         TypeError, "output.*dtype"),
        ("reduce_scatter input too long", lambda: rs(part, torch.zeros(n * m + 1)), ValueError, "input"),
        ("reduce_scatter input too short", lambda: rs(part, torch.zeros(n * m - 1)), ValueError, "input"),
        ("reduce_scatter op 'mean'", lambda: rs(part, inp, op="mean"), ValueError, "op"),
        ("reduce_scatter output shifted into input", lambda: rs(shifted, inp), ValueError, "overlaps"),
        ("all_gather output list", lambda: ag([0.0] * (n * m), part), TypeError, "output"),
        ("all_gather input list", lambda: ag(out, [0.0] * m), TypeError, "input"),
        ("all_gather output meta", lambda: ag(out.to("meta"), part), ValueError, "output"),
        ("all_gather input meta", lambda: ag(out, part.to("meta")), ValueError, "input"),
        ("all_gather dtypes differ", lambda: ag(out, part.int()), TypeError, "output and input"),
        ("all_gather output too long", lambda: ag(torch.zeros(n * m + 1), part), ValueError, "output"),
        ("all_gather output too short", lambda: ag(torch.zeros(n * m - 1), part), ValueError, "output"),
        ("all_gather input shifted in output", lambda: ag(inp, shifted), ValueError, "overlaps"),
        ("broadcast src '0'", lambda: bc(ones, src="0"), TypeError, "src"),
        ("broadcast src 0.0", lambda: bc(ones, src=0.0), TypeError, "src"),
        ("broadcast src None", lambda: bc(ones, src=None), TypeError, "src"),
        ("broadcast src world_size", lambda: bc(ones, src=n), ValueError, "src"),
        ("broadcast src -1", lambda: bc(ones, src=-1), ValueError, "src"),
        ("broadcast meta", lambda: bc(meta), ValueError, "tensor"),
        ("broadcast complex64", lambda: bc(cplx), TypeError, "tensor.*dtype"),
        ("all_reduce async_op 'yes'", lambda: ar(ones, async_op="yes"), TypeError, "async_op"),
        ("all_reduce async_op None", lambda: ar(ones, async_op=None), TypeError, "async_op"),
        ("compressed all_reduce async_op 1",
         lambda: ar(ones, compression=comm.Cast(torch.bfloat16), async_op=1), TypeError, "async_op"),
        ("reduce_scatter async_op 'yes'", lambda: rs(part, inp, async_op="yes"), TypeError, "async_op"),
        ("all_gather async_op 'yes'", lambda: ag(out, part, async_op="yes"), TypeError, "async_op"),
        ("broadcast async_op 'yes'", lambda: bc(ones, async_op="yes"), TypeError, "async_op"),
        ("barrier async_op 'yes'", lambda: c.barrier(async_op="yes"), TypeError, "async_op"),
    ]
    rows = torch.zeros(2 * n, 3)
    even = [2] * n

    def a2a(out=None, inp=rows, **splits):
        return c.all_to_all(rows.clone() if out is None else out, inp, **splits)

    calls += [
        ("all_to_all split sizes not a list", lambda: a2a(input_split_sizes=2),
         TypeError, "input_split_sizes"),
        ("all_to_all split sizes of floats", lambda: a2a(output_split_sizes=[2.0] * n),
         TypeError, "output_split_sizes"),
        ("all_to_all split sizes too short", lambda: a2a(input_split_sizes=even[1:] or [1, 1]),
         ValueError, "input_split_sizes must have world_size"),
        ("all_to_all negative split", lambda: a2a(input_split_sizes=([-1, 2 * n + 1] + [0] * n)[:n]),
         ValueError, "input_split_sizes must not be negative"),
        ("all_to_all splits not summing to size(0)", lambda: a2a(input_split_sizes=[3] * n),
         ValueError, "input_split_sizes must sum to input.size"),
        # Entries whose int64 sum wraps around to size(0) (three of them can: it once passed and
        # the rank read past its input); at fewer ranks the same entries overflow too.
        ("all_to_all splits summing past int64", lambda: a2a(
            input_split_sizes=([2**63 - 1, 2**63 - 1, 2 * n + 2] + [0] * n)[:n]),
         ValueError, "input_split_sizes must sum to input.size"),
        ("all_to_all rows of different widths", lambda: a2a(torch.zeros(2 * n, 2), input_split_sizes=even),
         ValueError, "rows"),
        ("all_to_all 0-d", lambda: a2a(torch.zeros(()), torch.zeros(()), input_split_sizes=[0] * n),
         ValueError, "dimension 0"),
        ("all_to_all own piece differs",
         lambda: a2a(torch.zeros(2 * n + 1, 3), input_split_sizes=even,
                     output_split_sizes=[2] * r + [3] + [2] * (n - r - 1)),
         ValueError, "output_split_sizes.rank."),
        ("all_to_all split dtypes differ", lambda: a2a(rows.double(), input_split_sizes=even),
         TypeError, "output and input"),
        ("all_to_all split output overlaps input", lambda: a2a(rows, input_split_sizes=even),
         ValueError, "overlap"),
        ("all_to_all async_op 'yes'", lambda: c.all_to_all(rows.clone(), rows, async_op="yes"),
         TypeError, "async_op"),
        ("all_to_all split async_op 'yes'",
         lambda: c.all_to_all(rows.clone(), rows, async_op="yes", input_split_sizes=even),
         TypeError, "async_op"),
    ]
    if n > 1:
        other = slice(((r + 1) % n) * m, ((r + 1) % n + 1) * m)
        calls += [
            ("all_to_all output rows not a multiple of world_size",
             lambda: a2a(torch.zeros(2 * n + 1, 3), input_split_sizes=even), ValueError, "output.size"),
            ("reduce_scatter output is another rank's slice of input",
             lambda: rs(inp[other], inp), ValueError, "overlaps"),
            ("all_gather input is another rank's slice of output",
             lambda: ag(out, out[other]), ValueError, "overlaps"),
        ]
    return calls


def check_bad_calls(c) -> list:
    """Runs every bad call; returns a description of each that did not raise as expected."""
    wrong = []
    for what, call, error, pattern in bad_calls(c):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - judged below
            if not isinstance(e, error) or isinstance(e, comm.CommError) or not re.search(pattern, str(e)):
                wrong.append(f"{what}: expected {error.__name__} matching {pattern!r}, "
                             f"got {type(e).__name__}: {e}")
        else:
            wrong.append(f"{what}: no error")
    return wrong


def check_closed(c) -> list:
    """Every collective of a closed communicator, sync and async, raises CommClosed."""
    m, n = 3, c.world_size
    calls = {
        "all_reduce": lambda a: c.all_reduce(torch.ones(m), async_op=a),
        "reduce_scatter": lambda a: c.reduce_scatter(torch.zeros(m), torch.ones(n * m), async_op=a),
        "all_gather": lambda a: c.all_gather(torch.zeros(n * m), torch.ones(m), async_op=a),
        "broadcast": lambda a: c.broadcast(torch.ones(m), async_op=a),
        "barrier": lambda a: c.barrier(async_op=a),
    }
    wrong = []
    for name, call in calls.items():
        for async_op in (False, True):
            try:
                call(async_op)
            except comm.CommClosed as e:
                if not (isinstance(e, comm.CommError) and isinstance(e, ValueError) and "close" in str(e)):
                    wrong.append(f"{name} async={async_op}: {e!r}")
            except Exception as e:  # noqa: BLE001 - judged here
                wrong.append(f"{name} async={async_op}: {type(e).__name__}: {e}")
            else:
                wrong.append(f"{name} async={async_op}: no error")
    return wrong


def bad_calls_on_rank_zero(rank, n, store_path):
    c = make_comm(rank, n, store_path)
    wrong = check_bad_calls(c) if rank == 0 else []
    # Every rank now issues the same valid collectives: they must match up and succeed.
    inputs = [make_input(5, r, 100, torch.float32) for r in range(n)]
    t = inputs[rank].clone()
    c.all_reduce(t)
    if not torch.equal(t, reduce_reference(inputs, "sum", n)):
        wrong.append("all_reduce after the bad calls gave a wrong result")
    c.barrier()
    c.close()
    return wrong + check_closed(c)


@pytest.fixture
def solo():
    """A one-rank communicator in the test process."""
    c = comm.Communicator(open_store(new_store_path()), 0, 1, timeout=20)
    yield c
    c.close()


def test_bad_calls_rejected_on_one_rank(solo):
    """Every bad tensor, dtype, device, size, overlap, op and src on a one-rank communicator raises
    the documented TypeError/ValueError (never a CommError) whose message names the argument."""
    assert check_bad_calls(solo) == []


@pytest.mark.parametrize("n", (2, 3))
def test_bad_calls_do_not_desynchronize_ranks(n):
    """Only rank 0 makes the bad calls: each raises before communicating, so the valid all_reduce and
    barrier that follow on every rank match up; after close() every call raises CommClosed."""
    for r, wrong in enumerate(run_ranks(bad_calls_on_rank_zero, n)):
        assert wrong == [], (r, wrong)


def test_use_after_close_raises_comm_closed(solo):
    """After close() (idempotent) every collective raises CommClosed, which is both a CommError and a
    ValueError; the properties still answer."""
    solo.close()
    solo.close()
    assert solo.closed and (solo.rank, solo.world_size) == (0, 1)
    assert check_closed(solo) == []


CONSTRUCTOR_ERRORS = [
    # (id, positional args after the store, keyword args, error, pattern)
    ("store_none", None, (0, 1), {}, TypeError, "store"),
    ("world_size_0", "store", (0, 0), {}, ValueError, "world_size"),
    ("world_size_negative", "store", (0, -1), {}, ValueError, "world_size"),
    ("world_size_float", "store", (0, 1.0), {}, TypeError, "world_size"),
    ("world_size_str", "store", (0, "2"), {}, TypeError, "world_size"),
    ("rank_negative", "store", (-1, 1), {}, ValueError, "rank"),
    ("rank_equals_world_size", "store", (1, 1), {}, ValueError, "rank"),
    ("rank_float", "store", (0.0, 1), {}, TypeError, "rank"),
    ("rank_none", "store", (None, 1), {}, TypeError, "rank"),
    ("rank_bool", "store", (True, 2), {}, TypeError, "rank must be an int, got True"),
    ("timeout_str", "store", (0, 2), {"timeout": "10"}, TypeError, "timeout"),
    ("timeout_0", "store", (0, 2), {"timeout": 0}, ValueError, "timeout"),
    ("timeout_negative", "store", (0, 2), {"timeout": -1.0}, ValueError, "timeout"),
    ("timeout_timedelta_0", "store", (0, 2), {"timeout": timedelta(0)}, ValueError, "timeout"),
    ("timeout_nan", "store", (0, 2), {"timeout": math.nan}, ValueError, "timeout"),
    ("slot_bytes_10", "store", (0, 2), {"slot_bytes": 10}, ValueError, "slot_bytes"),
    ("slot_bytes_1023", "store", (0, 2), {"slot_bytes": 1023}, ValueError, "slot_bytes"),
    ("slot_bytes_2GiB", "store", (0, 2), {"slot_bytes": 2 << 30}, ValueError, "slot_bytes"),
    ("nslots_0", "store", (0, 2), {"nslots": 0}, ValueError, "nslots"),
    ("nslots_1", "store", (0, 2), {"nslots": 1}, ValueError, "nslots"),
    ("nslots_65", "store", (0, 2), {"nslots": 65}, ValueError, "nslots"),
    ("nslots_2e32", "store", (0, 2), {"nslots": 2**32 + 4}, ValueError, "nslots .* between 2 and 64"),
    ("oneshot_max_bytes_2e70", "store", (0, 2), {"oneshot_max_bytes": 2**70}, ValueError,
     "oneshot_max_bytes"),
    ("oneshot_max_bytes_2GiB", "store", (0, 2), {"oneshot_max_bytes": 2 << 30}, ValueError,
     "oneshot_max_bytes"),
    ("yield_us_negative", "store", (0, 2), {"yield_us": -1.0}, ValueError, "yield_us"),
    ("algo_bogus", "store", (0, 2), {"algo": "bogus"}, ValueError, "(?i)algo"),
    ("device_cuda", "store", (0, 2), {"device": "cuda"}, ValueError, "device"),
]


@pytest.mark.parametrize("store, args, kwargs, error, pattern",
                         [c[1:] for c in CONSTRUCTOR_ERRORS], ids=[c[0] for c in CONSTRUCTOR_ERRORS])
def test_constructor_rejects_bad_arguments(store, args, kwargs, error, pattern):
    """Invalid rank, world_size, timeout, tunables or device raise at once (world_size 2 with no peer:
    a check that came after the bootstrap would time out instead) and leave no segment behind."""
    if store == "store":
        store = open_store(new_store_path())
    kwargs = {"timeout": 5.0, **kwargs}
    with pytest.raises(error, match=pattern) as raised:
        comm.Communicator(store, *args, **kwargs)
    assert not isinstance(raised.value, comm.CommError)
    assert braid_segments([os.getpid()]) == []


@pytest.mark.parametrize("name, value, pattern", [
    ("BRAID_ALGO", "fastest", "BRAID_ALGO"),
    ("BRAID_SLOT_BYTES", "1kb", "BRAID_SLOT_BYTES"),
    ("BRAID_SLOT_BYTES", "2T", "BRAID_SLOT_BYTES"),
    ("BRAID_SLOT_BYTES", "99999999999999999999", "BRAID_SLOT_BYTES"),
    ("BRAID_SLOT_BYTES", "M", "BRAID_SLOT_BYTES"),
    ("BRAID_STREAM_MIN_BYTES", "-1", "BRAID_STREAM_MIN_BYTES"),
    ("BRAID_STREAM_MIN_BYTES", "17179869184G", "BRAID_STREAM_MIN_BYTES"),
    ("BRAID_SLOT_BYTES", "100", "BRAID_SLOT_BYTES"),
    ("BRAID_NSLOTS", "0", "BRAID_NSLOTS"),
    ("BRAID_NSLOTS", "4294967300", "BRAID_NSLOTS"),  # once wrapped to 4 through an int cast
    ("BRAID_ONESHOT_MAX_BYTES", "18446744073709551615", "BRAID_ONESHOT_MAX_BYTES"),  # once read as unset
    ("BRAID_ONESHOT_MAX_BYTES", "-5", "BRAID_ONESHOT_MAX_BYTES"),
    ("BRAID_SPIN_US", "fast", "BRAID_SPIN_US"),
    ("BRAID_YIELD_US", "-1", "BRAID_YIELD_US"),
    ("BRAID_SKEW_ROUNDS", "2", "BRAID_SKEW_ROUNDS"),
    ("BRAID_SKEW_ROUNDS", "yes", "BRAID_SKEW_ROUNDS"),
])
def test_bad_environment_tunable_named(monkeypatch, name, value, pattern):
    """A malformed or out-of-range BRAID_* variable raises ValueError naming the variable."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=pattern):
        comm.Communicator(open_store(new_store_path()), 0, 1, timeout=5.0)


# ----------------------------------------------------------------------------------------------
# Regressions: each of these once failed.

@pytest.mark.parametrize("kwargs, name", [
    ({"slot_bytes": -1}, "slot_bytes"),
    ({"oneshot_max_bytes": -1}, "oneshot_max_bytes"),
    ({"nslots": 1.5}, "nslots"),
    ({"algo": 3}, "algo"),
    ({"skew_rounds": 1}, "skew_rounds"),
], ids=("slot_bytes_negative", "oneshot_max_bytes_negative", "nslots_float", "algo_int", "skew_rounds_int"))
def test_constructor_names_mistyped_tunable(kwargs, name):
    """A negative or mistyped tunable raises TypeError/ValueError whose message names it."""
    with pytest.raises((TypeError, ValueError), match=name):
        comm.Communicator(open_store(new_store_path()), 0, 1, timeout=5.0, **kwargs)


def test_broadcast_huge_src_is_out_of_range(solo):
    """src = 2**40 is an out-of-range rank: ValueError naming src, like src = world_size."""
    with pytest.raises(ValueError, match="src"):
        solo.broadcast(torch.ones(3), src=2 ** 40)


def test_reduce_op_instance_is_accepted(solo):
    """op=dist.ReduceOp(dist.ReduceOp.SUM), a ReduceOp object rather than the RedOpType enum, sums."""
    t = torch.ones(3)
    solo.all_reduce(t, op=dist.ReduceOp(dist.ReduceOp.SUM))
    assert torch.equal(t, torch.ones(3))


@pytest.mark.parametrize("collective", ("all_reduce", "broadcast", "all_gather", "reduce_scatter"))
def test_self_overlapping_output_rejected_up_front(solo, collective):
    """An output whose elements share memory (torch.ones(1).expand(4)) cannot receive a result:
    ValueError naming it, before any communication."""
    expanded = torch.ones(1).expand(4)
    call = {"all_reduce": lambda: solo.all_reduce(expanded),
            "broadcast": lambda: solo.broadcast(expanded),
            "all_gather": lambda: solo.all_gather(expanded, torch.ones(4)),
            "reduce_scatter": lambda: solo.reduce_scatter(expanded, torch.ones(4))}[collective]
    with pytest.raises(ValueError, match="tensor|output"):
        call()


def test_more_than_64_ranks_on_one_host_is_refused():
    """65 ranks are legal across hosts; on one host the shared memory holds at most 64. The core
    refuses that layout before it maps anything (the host layout is known after the ranks have
    published their host identities, so this is checked on the core directly)."""
    from braid.comm import _C

    tun = _C.Tunables.from_env()
    with pytest.raises(ValueError, match="at most 64 ranks may share one host"):
        _C.Communicator(0, 65, tun, 10.0, [0] * 65)
    with pytest.raises(ValueError, match="host_ids needs one entry per rank"):
        _C.Communicator(0, 65, tun, 10.0, [0] * 3)
