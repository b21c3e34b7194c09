"""The planner's measured links (``braid.plan.measure``, ``python -m braid.plan --measure``): the
fit on an exact line, the pairing of ranks by host, the measurement on ranks of simulated
hosts (``BRAID_HOST_ID``) over a gloo group and a braid Communicator, and the command line run by
every rank of a job (rank 0 prints, the measured fields fill what was not given); the measured
overlap of a gradient exchange with compute."""
import contextlib
import io
import json
import math

import pytest
import torch
import torch.distributed as dist
from braid.plan.__main__ import main
from braid.plan.measure import WARMUP, _pairs, fit, measure_links, measure_overlap, overlap_of
from helpers.ranks import environment, make_comm, process_group, run_ranks

SIZES = (1 << 12, 1 << 16, 1 << 20)


def test_the_fit_recovers_an_exact_line():
    """Adaptive's fit_link (tested in test_adaptive.py) on one level: an exact line comes back."""
    exact = [(b, 20e-6 + b / 5e9) for b in (4096, 65536, 1 << 20, 1 << 23)]
    latency, bandwidth = fit(exact)
    assert latency == pytest.approx(20e-6, rel=1e-6) and bandwidth == pytest.approx(5e9, rel=1e-6)


def test_pairs_stay_in_their_host_and_cross_to_the_next_one():
    intra, inter = _pairs([0, 0, 1, 1])
    assert intra == {0: 1, 1: 0, 2: 3, 3: 2} and inter == {0: 2, 2: 0, 1: 3, 3: 1}
    intra, inter = _pairs([0, 0, 0])
    assert intra == {0: 1, 1: 0} and inter == {}
    intra, inter = _pairs([0, 1, 2])  # the third host has no partner host
    assert intra == {} and inter == {0: 1, 1: 0}


def _measure(rank, n, store_path, hosts, carrier):
    with environment({"BRAID_HOST_ID": f"host{hosts[rank]}"}), process_group(rank, n, store_path):
        with contextlib.ExitStack() as stack:
            group = dist.group.WORLD
            if carrier == "communicator":
                group = stack.enter_context(make_comm(rank, n, store_path))
            links = measure_links(group, sizes=SIZES, repeats=2)
            return links.cluster_fields(), links.samples


@pytest.mark.parametrize("hosts,carrier", (((0, 0, 1, 1), "gloo"), ((0, 0, 1, 1), "communicator"),
                                           ((0, 0, 0), "gloo")))
def test_links_are_measured_on_every_level_pairs_cross(hosts, carrier):
    results = run_ranks(_measure, len(hosts), hosts, carrier)
    fields, samples = results[0]
    assert all(r == results[0] for r in results), "every rank returns the same measurement"
    assert fields["hosts"] == len(set(hosts)) and fields["devices_per_host"] == hosts.count(0)
    levels = [("intra", "in a host")] + ([("inter", "between hosts")] if len(set(hosts)) > 1 else [])
    for prefix, name in levels:
        assert math.isfinite(fields[f"{prefix}_bandwidth"]) and fields[f"{prefix}_bandwidth"] > 0, fields
        assert 0 <= fields[f"{prefix}_latency"] < 1, fields
        assert [b for b, _ in samples[name]] == list(SIZES) and all(t > 0 for _, t in samples[name])
    if len(set(hosts)) == 1:
        assert "inter_bandwidth" not in fields and "between hosts" not in samples


def _uneven(rank, n, store_path):
    with environment({"BRAID_HOST_ID": f"host{min(rank, 1)}"}), process_group(rank, n, store_path):
        try:
            measure_links(None, sizes=SIZES, repeats=1)
        except ValueError as e:
            return str(e)
        return None


def test_hosts_of_different_sizes_are_refused_on_every_rank():
    for message in run_ranks(_uneven, 3):
        assert message is not None and "different numbers of ranks ([1, 2])" in message


def _command(rank, n, store_path, extra):
    with environment({"BRAID_HOST_ID": f"host{rank // 2}"}), process_group(rank, n, store_path):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["--measure", "--cluster", "h100x8:1", "--layers", "4", "--hidden", "512", "--heads",
                         "8", "--vocab", "1000", "--seq", "256", "--batch", "8", "--top", "2", *extra])
        return code, out.getvalue()


def test_the_command_measures_on_every_rank_and_rank0_prints():
    results = run_ranks(_command, 4, ["--json", "--inter-gbps", "12.5"])
    assert [code for code, _ in results] == [0] * 4
    assert all(text == "" for _, text in results[1:]), "only rank 0 prints"
    printed = json.loads(results[0][1])
    cluster, measured = printed["cluster"], printed["measured"]
    # The job's shape and the in-host link come from the measurement, the given --inter-gbps wins.
    assert (cluster["hosts"], cluster["devices_per_host"]) == (2, 2) == (measured["hosts"],
                                                                          measured["devices_per_host"])
    assert cluster["intra_bandwidth"] == pytest.approx(measured["intra_bandwidth"])
    assert cluster["inter_bandwidth"] == 12.5e9 != measured["inter_bandwidth"]
    # the overlap: measured beside matrix products, and the planner's unless given
    overlap = measured["overlap"]
    assert 0 <= overlap["overlap"] <= 1 and overlap["products"] >= 1
    assert overlap == overlap_of(overlap["compute_s"], overlap["comm_s"], overlap["both_s"]) | {
        "products": overlap["products"]}
    assert printed["assumptions"]["overlap"] == round(overlap["overlap"], 2)
    given = json.loads(run_ranks(_command, 2, ["--json", "--overlap", "0.5"])[0][1])
    assert given["assumptions"]["overlap"] == 0.5 and "overlap" in given["measured"]
    text = run_ranks(_command, 2, [])[0][1]
    assert "in a host: " in text and "between hosts: not measured" in text
    assert "overlap: " in text and "matrix products" in text
    assert "(measured where a pair of ranks crossed the level, else given)" in text


def test_overlap_from_its_three_times():
    # half of a 100 ms compute hides 50 ms of an 80 ms exchange: 130 ms both
    assert overlap_of(0.1, 0.08, 0.13) == {"overlap": pytest.approx(0.5), "compute_s": 0.1, "comm_s": 0.08,
                                           "both_s": 0.13, "bound": 0.0}
    # nothing hidden (or worse: the two slow each other down): 0
    assert overlap_of(0.1, 0.08, 0.2)["overlap"] == 0.0
    # the exchange hid whole: 0.3 or more, a lower bound
    o = overlap_of(0.1, 0.03, 0.1)
    assert o["overlap"] == pytest.approx(0.3) and o["bound"] == 1.0
    assert overlap_of(0.1, 0.3, 0.2)["overlap"] == 1.0  # held within [0, 1]


def _overlap(rank, n, store_path, carrier):
    with process_group(rank, n, store_path), contextlib.ExitStack() as stack:
        group = dist.group.WORLD
        if carrier == "communicator":
            group = stack.enter_context(make_comm(rank, n, store_path))
        calls = {"prepare": 0, "compute": 0}
        a = torch.randn(64, 64)

        def prepare():
            calls["prepare"] += 1
            return a

        def compute(x):
            assert x is a  # prepare's result
            calls["compute"] += 1
            (x @ x).sum()

        with pytest.raises(ValueError, match="nbytes"):
            measure_overlap(group, compute, 2)
        with pytest.raises(ValueError, match="repeats"):
            measure_overlap(group, compute, 1 << 16, repeats=0)
        out = measure_overlap(group, compute, 1 << 16, prepare=prepare, bucket_bytes=1 << 14, repeats=2)
        return out, calls


@pytest.mark.parametrize("carrier", ("gloo", "communicator"))
def test_overlap_is_measured_on_every_rank(carrier):
    results = run_ranks(_overlap, 2, carrier)
    assert results[0][0] == results[1][0], "every rank returns the same (the slowest rank's) times"
    out, calls = results[0]
    runs = WARMUP + 2
    # prepare before every timed run (compute alone, exchange alone, both); compute in two of them
    assert calls == {"prepare": 3 * runs, "compute": 2 * runs}
    assert all(out[k] > 0 for k in ("compute_s", "comm_s", "both_s"))
    assert out == overlap_of(out["compute_s"], out["comm_s"], out["both_s"])
