"""The collectives benchmark's protocol and a short end-to-end run; the planner benchmark's parts
that need no ranks (no timing is checked)."""
import argparse
import importlib.util
import json
import shutil
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from types import SimpleNamespace

from braid.bench import plan as bench_plan
from braid.bench import protocol
from braid.plan.cost import spans


class LocalBackend:
    """One rank: every collective is the identity (in place) or a copy, optionally corrupted."""

    def __init__(self, name, ops=None, corrupt=False, log=None):
        self.name = name
        if ops is not None:
            self.ops = ops
        self._corrupt = corrupt
        self._log = log if log is not None else []

    def bind(self, op, send, out_count):
        out = send if out_count is None else np.empty(out_count, send.dtype)

        def call():
            self._log.append((self.name, op, send.nbytes))
            if out is not send:
                out[:] = send
            if self._corrupt:
                out[:1] += 1

        return call, lambda: out

    def barrier(self):
        pass

    def reduce(self, values, how):
        return list(values)


TIMING = protocol.Timing(warmup=1, batches=2, time_budget=0.0, iters=1)


def test_backends_take_turns_at_each_size():
    """The backends share each size, batch by batch, before any moves to the next size; ops a
    backend lacks are skipped; planned() counts what run_suite measures."""
    log, seen = [], []
    backends = [LocalBackend("a", log=log), LocalBackend("b", ops=("all_reduce",), log=log)]
    ops, sizes = ("all_reduce", "broadcast"), (64, 256)
    records = protocol.run_suite(backends, ops, sizes, "float32", 0, 1, TIMING,
                                 lambda impl, op, nbytes: seen.append((impl, op, nbytes)))
    assert seen == [("a", "all_reduce", 64), ("b", "all_reduce", 64), ("a", "all_reduce", 256),
                    ("b", "all_reduce", 256), ("a", "broadcast", 64), ("a", "broadcast", 256)]
    assert [(r["impl"], r["op"], r["bytes"]) for r in records] == seen
    assert protocol.planned(backends, ops, sizes) == len(seen)
    assert all(r["wrong"] == 0 and r["iters"] == 1 for r in records)
    # At one size the calls alternate: warm-up, then each timed batch, then the check.
    assert [name for name, op, nbytes in log if (op, nbytes) == ("all_reduce", 64)] == ["a", "b"] * 4


def test_wrong_results_are_counted():
    records = protocol.run_suite([LocalBackend("bad", corrupt=True)], ("all_reduce",), (64,),
                                 "float32", 0, 1, TIMING, lambda *a: None)
    assert records[0]["wrong"] == 1


def short_collectives_run(tmp_path, impls: tuple, ops: tuple) -> tuple:
    """A 2-rank run of ``impls`` on ``ops`` at 4 and 16 KiB that must succeed, with every record
    present and right and the braid/peer ratios printed; returns (process, JSON document)."""
    out = tmp_path / "c.json"
    proc = subprocess.run(
        [sys.executable, "-m", "braid.bench", "collectives", "--nproc", "2", "--impls", ",".join(impls),
         "--ops", ",".join(ops), "--max-bytes", "16K", "--iters", "2", "--batches", "2",
         "--warmup", "1", "--timeout", "60", "--deadline", "200", "--json", str(out)],
        capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    keys = sorted((r["impl"], r["op"], r["bytes"]) for r in doc["records"])
    assert keys == sorted((impl, op, b) for impl in impls for op in ops for b in (4096, 16384))
    assert all(r["wrong"] == 0 for r in doc["records"])
    for peer in impls[1:]:
        assert f"# busbw ratio braid / {peer}" in proc.stdout
    return proc, doc


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_collectives_benchmark_runs(tmp_path):
    """Two spawned ranks, braid and gloo, tiny sizes: JSON with every record checked and right."""
    short_collectives_run(tmp_path, ("braid", "gloo"), ("all_reduce", "all_gather"))


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None,
                    reason="needs Open MPI and mpi4py (make bench-peers)")
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_open_mpi_is_measured_in_the_same_ranks(tmp_path):
    """With Open MPI present the ranks start under mpirun and run braid, gloo and MPI side by side:
    records of all three, checked and right, the launcher and the MPI library in the JSON."""
    _, doc = short_collectives_run(tmp_path, ("braid", "gloo", "mpi"), ("all_reduce", "reduce_scatter"))
    assert doc["config"]["launcher"] == "mpirun" and "Open MPI" in doc["machine"]["mpi_library"], doc


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_multihost_benchmark_runs(tmp_path):
    """Two simulated hosts on an unshaped link, the smallest run: braid's and gloo's records,
    checked and right, the TCP floor, a PNG; where hosts cannot be simulated it says why and
    exits 0."""
    from braid.bench.simhosts import unavailable_reason

    out, png = tmp_path / "m.json", tmp_path / "m.png"
    proc = subprocess.run(
        [sys.executable, "-m", "braid.bench", "multihost", "--links", "0", "--layouts", "2x1",
         "--sizes", "4K,1M",
         "--compressors", "int8", "--iters", "3", "--rounds", "1", "--ddp-links", "", "--json", str(out),
         "--plot", str(png)],
        capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if unavailable_reason(rate=True) is not None:
        assert "cannot be made here" in proc.stdout
        return
    doc = json.loads(out.read_text())
    assert sorted((r["impl"], r["bytes"]) for r in doc["records"]) == [
        ("braid", 4096), ("braid", 1 << 20), ("gloo", 4096), ("gloo", 1 << 20),
        ("int8", 4096), ("int8", 1 << 20)]
    assert all(r["wrong"] == 0 for r in doc["records"] if r["impl"] in ("braid", "gloo"))
    assert doc["tcp_floor"]["0"]["1"] > 0 and png.stat().st_size > 0
    assert "plain TCP between the two hosts" in proc.stdout


@pytest.mark.skipif(not os.path.exists("/sys/class/net/lo/statistics/tx_bytes"), reason="no loopback counter")
def test_uplink_counter_counts_what_a_step_sends():
    """The model benchmarks' uplink counter (bench/turns.py): bytes a step sends through the
    interface (here 1 MiB over loopback) are counted for that step of that implementation only,
    and a rank that does not read (not its host's first) counts nothing."""
    import socket

    from braid.bench.turns import UplinkCounter

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    payload = bytes(1 << 20)

    def step():
        client.sendall(payload)
        got = 0
        while got < len(payload):
            got += len(peer.recv(1 << 20))

    counter = UplinkCounter("lo", reads=True)
    counter.wrap("a", step)()
    counter.wrap("b", lambda: None)()
    idle = UplinkCounter("lo", reads=False)
    idle.wrap("a", step)()
    for s in (client, peer, server):
        s.close()
    (sent_a,), (sent_b,) = counter.sent["a"], counter.sent["b"]
    assert len(payload) <= sent_a < 2 * len(payload), counter.sent
    assert sent_b < 64 << 10 and idle.sent == {}, (counter.sent, idle.sent)


def test_turns_rotate_and_each_follows_a_barrier(monkeypatch):
    """time_in_turns: every round runs each implementation once, in an order rotated by one place
    per round (each in every place once over three rounds), each turn after its own barrier and
    timed over --steps calls."""
    from types import SimpleNamespace

    from braid.bench import report, turns

    log = []
    monkeypatch.setattr(turns.dist, "barrier", lambda: log.append("|"))
    monkeypatch.setattr(turns, "max_over_ranks", lambda values: values)  # one rank
    steps = {name: (lambda name=name: log.append(name)) for name in "abc"}
    run = SimpleNamespace(rounds=3, steps=2)
    seconds = turns.time_in_turns(steps, run, report.Progress(9, enabled=False), 0)
    assert "".join(log) == "|aa|bb|cc" "|bb|cc|aa" "|cc|aa|bb"
    assert sorted(seconds) == ["a", "b", "c"] and all(t >= 0 for t in seconds.values())
    assert turns.order_of_round(["x", "y"], 0) == ["x", "y"]
    assert turns.order_of_round(["x", "y"], 1) == ["y", "x"]
    assert turns.order_of_round(["x", "y"], 2) == ["x", "y"]


def test_link_floor_of_rounds_by_hand(monkeypatch):
    """The uplink counter's floor: per round, the busiest host's bytes less the shaper's bucket
    at its rate, over the round's steps; the median over rounds. A rank that does not read
    reports zeros, and no link rate means no floor."""
    from braid.bench import turns

    monkeypatch.setattr(turns, "max_over_ranks", lambda values: values)  # one rank
    counter = turns.UplinkCounter(None, reads=False)
    counter.shape = turns.LinkShape(bytes_per_s=1e6, bucket=100_000)
    counter.link_mbit = 8
    # Two steps a round, three rounds: 0.6, 0.1 (all within the bucket) and 1.1 MB per round.
    counter.sent = {"a": [300_000, 300_000, 50_000, 50_000, 600_000, 500_000]}
    per_step, floor = counter.busiest(["a", "b"], rounds=3, steps=2)
    assert per_step == {"a": pytest.approx(1_800_000 / 6), "b": 0.0}
    # Rounds: (0.6 - 0.1) / 2 = 0.25 s, 0, (1.1 - 0.1) / 2 = 0.5 s: median 0.25 s.
    assert floor == {"a": pytest.approx(0.25), "b": 0.0}
    counter.link_mbit = 0
    assert counter.busiest(["a"], rounds=3, steps=2)[1] == {"a": None}
    assert turns.LinkShape(1e6, 0).floor_s(2e6) == pytest.approx(2.0)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_link_shape_read_from_the_interfaces_tbf():
    """LinkShape.of reads rate and bucket from the interface's tbf qdisc (in a network namespace
    of its own, as a simulated host's uplink), and takes the given rate with no bucket from an
    interface without one."""
    from braid.bench.simhosts import find_tool, unavailable_reason

    if unavailable_reason(rate=True) is not None:
        pytest.skip(f"no network namespaces with tbf here: {unavailable_reason(rate=True)}")
    ip, tc = find_tool("ip"), find_tool("tc")
    name = f"braid-test-shape-{os.getpid()}"
    subprocess.run([ip, "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run([ip, "-n", name, "link", "add", "up0", "type", "veth", "peer", "name", "up1"],
                       check=True, timeout=30)
        subprocess.run([tc, "-n", name, "qdisc", "add", "dev", "up0", "root", "tbf", "rate", "250mbit",
                        "burst", "40000", "latency", "50ms"], check=True, timeout=30)
        probe = ("from braid.bench.turns import LinkShape; "
                 "print(LinkShape.of('up0', 1000)); print(LinkShape.of('up1', 1000))")
        done = subprocess.run([ip, "netns", "exec", name, sys.executable, "-c", probe], capture_output=True,
                              text=True, timeout=90)
    finally:
        subprocess.run([ip, "netns", "del", name], timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["LinkShape(bytes_per_s=31250000.0, bucket=40000)",
                                        "LinkShape(bytes_per_s=125000000.0, bucket=0)"]


def test_moe_output_checks_bitwise_and_sum_order(monkeypatch):
    """The MoE benchmark's check of outputs against gloo's: at top-2 one ulp apart fails (bitwise);
    at top-3 other summation orders of float32 terms pass and twice their bound fails; int8
    dispatch is reported, not checked."""
    import torch
    from braid.bench import moe

    monkeypatch.setattr(moe.turns, "max_over_ranks", lambda values: values)  # one rank
    g = torch.Generator().manual_seed(3)
    terms = torch.randn(3, 64, 32, generator=g) * torch.logspace(-3, 3, 32)

    class Gloo:
        def term_magnitudes(self, x):
            return terms.double().abs().sum(0)

    layers = {"gloo": Gloo(), "braid": None, "braid-hier": None, "braid-hier-int8": None}
    in_order = (terms[0] + terms[1]) + terms[2]
    other_order = terms[0] + (terms[1] + terms[2])
    assert not torch.equal(in_order, other_order)  # the case must round differently
    first = {"gloo": in_order, "braid": in_order.clone(), "braid-hier": other_order,
             "braid-hier-int8": in_order + 0.01}
    checks = moe._check_outputs(first, layers, None, top_k=3)
    assert checks["braid"] == ("sum order", 0.0, False)
    assert checks["braid-hier"][0] == "sum order" and not checks["braid-hier"][2]
    assert checks["braid-hier-int8"] == (None, pytest.approx(0.01, rel=1e-2), False)
    gamma = 2 * 2.0 ** -24 / (1 - 2 * 2.0 ** -24)
    beyond = in_order.double() + 4 * gamma * terms.double().abs().sum(0)
    first["braid-hier"] = beyond.float()
    assert moe._check_outputs(first, layers, None, top_k=3)["braid-hier"][2]

    two = terms[0] + terms[1]
    first = {"gloo": two, "braid": terms[1] + terms[0], "braid-hier": torch.nextafter(two, two + 1)}
    checks = moe._check_outputs(first, {k: None for k in first}, None, top_k=2)
    assert checks["braid"] == ("bitwise", 0.0, False)
    assert checks["braid-hier"][0] == "bitwise" and checks["braid-hier"][2]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_moe_benchmark_runs_and_checks(tmp_path):
    """A short MoE run at top-3 on 2 ranks, then on 2 simulated hosts where they can be made: every
    implementation's record, each exact one held to its check and passing, and across hosts a
    link floor under every step."""
    from braid.bench.simhosts import unavailable_reason

    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "braid.bench", "moe", "--shape", "128x32x32x4x3", "--nproc", "2",
         "--warmup", "1", "--steps", "1", "--rounds", "2", "--timeout", "60", "--json", str(out)],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    one_host = [r for r in records if r["hosts"] == 1]
    assert sorted(r["impl"] for r in one_host) == sorted(("local", "gloo", "braid", "braid-on-gloo"))
    assert all(r["check"] == "sum order" and not r["check_failed"] for r in one_host if r["impl"] != "gloo")
    across = [r for r in records if r["hosts"] == 2]
    if unavailable_reason(rate=True) is not None:
        assert not across and "cannot be made here" in proc.stdout
        return
    assert sorted(r["impl"] for r in across) == sorted(("local", "gloo", "braid", "braid-hier",
                                                         "braid-hier-int8"))
    assert all(r["link_floor_ms"] is not None and not r["below_link_floor"] for r in across)
    assert [r["check"] for r in across if r["impl"] == "braid-hier-int8"] == [None]


def test_cost_model_counts_and_fit():
    """The many-hosts cost model: each algorithm's latencies, messages and uplink bytes as its
    docstring states them (worked out by hand at 5 and 8 hosts), and a fit that recovers alpha,
    gamma and a contention factor from times the model itself produced (to 0.1%: the contention
    factor is read off large messages whole, their small latency share included)."""
    from braid.bench import costmodel as cm

    assert [cm.rounds(a, 5) for a in cm.ALGORITHMS] == [1, 4, 8, 2]  # doubling: 2 rounds + fold in/out
    assert [cm.rounds(a, 8) for a in cm.ALGORITHMS] == [1, 3, 14, 2]
    assert [cm.messages(a, 8) for a in cm.ALGORITHMS] == [7, 3, 14, 14]
    assert [cm.uplink_bytes(a, 8, 800) for a in cm.ALGORITHMS] == [5600, 2400, 1400, 1400]
    truth = cm.Model(alpha=50e-6, gamma=5e-6, contention={"oneshot": 1.2, "leaders": 1.5})
    points = [(a, h, s, 12.5e6, truth.time(a, h, s, 12.5e6))
              for a in cm.ALGORITHMS for h in (4, 8, 16) for s in (4096, 8 << 20)]
    got = cm.fit(points)
    assert (got.alpha, got.gamma) == pytest.approx((50e-6, 5e-6), rel=1e-3)
    assert got.contention == pytest.approx({"oneshot": 1.2, "leaders": 1.5}, rel=1e-3)
    assert got.best(1024, 4096, 12.5e9) == "doubling"


def test_cost_model_scored_on_a_link_it_was_not_fitted_on():
    """The model fitted on one link's records and scored on another's: records of 100 Mbit made
    by a known model, those of an unshaped link (its rate the measured one the record carries)
    taking exactly twice the known model's time. Fitted on 100 Mbit the model is exact there (0%)
    and off by exactly 50% on the other link everywhere, yet names every cell's fastest algorithm
    (the doubling keeps their order); records the model cannot use are left out."""
    from braid.bench import costmodel as cm
    from braid.bench.multihost import cost_model_text

    truth = cm.Model(alpha=50e-6, gamma=5e-6, contention={"oneshot": 1.2, "leaders": 1.5})
    records = []
    for link, rate, slower in ((100, 12.5e6, 1), (0, 1.25e9, 2)):
        for a in cm.ALGORITHMS:
            for h in (4, 8):
                for s in (4096, 8 << 20):
                    records.append({"impl": f"braid-{a}", "algorithm": a, "hosts": h, "bytes": s,
                                    "link_mbit": link, "rate_bytes_s": rate,
                                    "time_us": slower * truth.time(a, h, s, rate) * 1e6})
    # Left out: braid's own choice (it repeats a forced one), one host, an unshaped link's record
    # without its measured rate.
    others = [dict(records[0], impl="braid"), dict(records[0], hosts=1),
              dict(records[-1], rate_bytes_s=None)]
    assert len(cm.points_of(records + others)) == len(records) == 32
    assert cm.splits(["a", "b", "c"]) == [(("a",), ("b", "c")), (("b", "c"), ("a",)), (("b",), ("a", "c")),
                                          (("a", "c"), ("b",)), (("c",), ("a", "b")), (("a", "b"), ("c",))]
    lines = cost_model_text(records + others).splitlines()
    fitted_on_100 = next(i for i, line in enumerate(lines) if line.startswith("100 Mbit "))
    # The scored columns: setting, points, median, worst, fastest named in cells.
    assert lines[fitted_on_100].split()[-7:] == ["(fit)", "16", "0%", "0%", "4", "of", "4"]
    assert lines[fitted_on_100 + 1].split() == ["unshaped", "16", "50%", "50%", "4", "of", "4"]
    one_link = {"100 Mbit": cm.points_of(records)}
    assert "it needs measurements at two link settings" in cm.scored_report(one_link)


def test_cost_model_reprinted_from_an_earlier_runs_json(tmp_path, capsys):
    """``multihost --from-json`` prints the tables and the scored model of a ``--hosts`` run's JSON
    without measuring; the JSON of another benchmark is a usage error naming it."""
    from braid.bench import costmodel as cm
    from braid.bench.__main__ import main
    from braid.bench.report import write_json

    truth = cm.Model(alpha=50e-6, gamma=5e-6)
    records = [{"impl": f"braid-{a}", "algorithm": a, "hosts": 4, "bytes": 4096, "per_host": 1,
                "op": "all_reduce", "link_mbit": link, "rate_bytes_s": link * 1e6 / 8,
                "time_us": truth.time(a, 4, 4096, link * 1e6 / 8) * 1e6}
               for link in (100, 1000) for a in ("ring", "doubling")]
    records += [dict(r, impl="gloo", algorithm=None, time_us=1000.0) for r in records[::2]]
    setups = [{"hosts": 4, "per_host": 1, "link_mbit": link, "braid_sockets": 6, "gloo_sockets": 4,
               "braid_setup_s": 0.01, "gloo_setup_s": 0.4} for link in (100, 1000)]
    write_json(str(tmp_path / "scale.json"), {"benchmark": "multihost-scale", "records": records,
                                              "setup": setups})
    assert main(["multihost", "--from-json", str(tmp_path / "scale.json")]) == 0
    out = capsys.readouterr().out
    assert "1 Gbit (fit)" in out and "100 Mbit (fit)" in out, out
    write_json(str(tmp_path / "two.json"), {"benchmark": "multihost", "records": []})
    with pytest.raises(SystemExit) as stopped:
        main(["multihost", "--from-json", str(tmp_path / "two.json")])
    assert stopped.value.code == 2
    assert "not the --json of a `multihost --hosts` run (benchmark 'multihost')" in capsys.readouterr().err


def test_ddp_link_floor_against_a_hand_computation():
    """The DDP benchmark's link floor: the hooks stamp every gradient of a real backward, and the
    floor of given ready times packs DDP's buckets in ready order and serializes them on the link
    as worked out by hand."""
    import torch
    from braid.bench.ddp import LinkFloor

    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.ones(1 << 20))  # 4 MiB each for a and b, 8 MiB for c
    model.b = torch.nn.Parameter(torch.ones(1 << 20))
    model.c = torch.nn.Parameter(torch.ones(2 << 20))
    probe = LinkFloor(model)
    t0 = time.perf_counter()
    (model.a.sum() + model.b.sum() * 2 + model.c.sum()).backward()
    t_backward = time.perf_counter()
    probe.record(t0, t_backward, t_backward)
    ready, _, _ = probe.steps.pop()
    assert len(ready) == 3 and all(0 <= r <= t_backward - t0 for r in ready), ready

    # c ready at 0.1 s, a at 0.2 s, b at 0.5 s; backward ends at 0.5 s, the step at 0.55 s. Buckets
    # of 6 MiB in ready order: [c] (8 MiB, closed at once), then [a, b]. A 80 MiB/s link, 2 hosts
    # (each bucket's bytes once through an uplink): c 0.1 -> 0.2 s, [a, b] from 0.5 s (b ready)
    # to 0.6 s, then the optimizer's 0.05 s. Four hosts: 1.5x the bytes, 0.15 s a bucket.
    probe.stamps.update({0: 0.2, 1: 0.5, 2: 0.1})
    probe.record(0.0, 0.5, 0.55)
    mib = 1 << 20
    assert probe.floors(6 * mib, 80 * mib, 2) == pytest.approx([0.65])
    assert probe.floors(6 * mib, 80 * mib, 4) == pytest.approx([0.70])
    # One bucket for all: it starts when b is ready, 16 MiB at 80 MiB/s.
    assert probe.floors(64 * mib, 80 * mib, 2) == pytest.approx([0.5 + 0.2 + 0.05])
    # A link fast enough that the step's own end is the floor.
    assert probe.floors(6 * mib, 1e6 * mib, 2) == pytest.approx([0.55], abs=1e-4)


def test_auto_summary_pairs_steps_against_drift():
    """multihost's "auto" line compares step by step: on a machine that slows down 2x during the
    run, a mode whose steps are all 1% slower than exact's shows 1.01x, and the best fixed choice is
    the one auto is slowest against; the ratio of the medians would mislead here."""
    from braid.bench.multihost import _auto_summary
    from braid.bench.report import paired_ratios

    drift = [1.0, 1.0, 1.0, 2.0, 2.0]
    exact = drift
    int8 = [t * 0.98 for t in drift]
    auto = [1.01 * t for t in drift[:3]] + [2.02, 2.02]
    assert paired_ratios({"auto": auto, "braid": exact}, "auto") == pytest.approx({"braid": 1.01})
    rows = [{"link_mbit": 0, "batch": 1, "seq": 32, "mode": m, "step_times": t, "step_s": sorted(t)[2],
             **({"decisions": {"0": ["exact", "why"]}} if m == "auto" else {})}
            for m, t in (("auto", auto), ("braid", exact), ("int8", int8), ("compute", [0.5] * 5))]
    (line,) = _auto_summary(rows)
    assert "1.031x the best fixed choice (int8" in line and "1.010x exact" in line and "chose exact" in line


def test_pipeline_schedule_floor_against_hand_computations():
    """The pipeline benchmark's floor replays recorded actions with instant transfers: GPipe at
    P = 2, M = 2 (forward 1, backward 2) takes the textbook (M + P - 1)(F + B) = 9; a split
    backward lets the last stage's weight gradient overlap the first stage's input gradient;
    actions recorded in an order that cannot run are refused."""
    from braid.bench.pipeline import schedule_floor

    gpipe = [[("F", s, 0, 1.0), ("F", s, 1, 1.0), ("B", s, 0, 2.0), ("B", s, 1, 2.0)] for s in (0, 1)]
    assert schedule_floor(gpipe, 2) == 9.0
    assert schedule_floor(gpipe, 2, cores=2) == 9.0  # 12 s of actions on 2 cores: 6 s, below 9
    assert schedule_floor(gpipe, 2, cores=1) == 12.0
    split = [[("F", s, 0, 1.0), ("I", s, 0, 1.0), ("W", s, 0, 1.0)] for s in (0, 1)]
    assert schedule_floor(split, 2) == 5.0  # rank 1: F 1-2, I 2-3, W 3-4; rank 0: I 3-4, W 4-5
    # Two stages per rank (stages 0 and 2 on rank 0, 1 and 3 on rank 1), one microbatch.
    looped = [[("F", 0, 0, 1.0), ("F", 2, 0, 1.0), ("B", 2, 0, 1.0), ("B", 0, 0, 1.0)],
              [("F", 1, 0, 1.0), ("F", 3, 0, 1.0), ("B", 3, 0, 1.0), ("B", 1, 0, 1.0)]]
    assert schedule_floor(looped, 4) == 8.0
    with pytest.raises(RuntimeError, match="wait for each other"):
        schedule_floor([[("B", 0, 0, 1.0), ("F", 0, 0, 1.0)], [("F", 1, 0, 1.0), ("B", 1, 0, 1.0)]], 2)
    # The schedule's own work before an action (fifth field) overlaps the wait for the previous
    # stage, never the rank's previous action: rank 1's 2 s of Python run while rank 0 computes.
    host = [[("F", 0, 0, 1.0, 0.5), ("E", -1, -1, 0.0, 0.25)],
            [("F", 1, 0, 1.0, 2.0), ("E", -1, -1, 0.0, 0.0)]]
    assert schedule_floor(host, 2) == 3.0
    assert schedule_floor(host, 2, cores=1) == 4.75  # all 4.75 s of work on one core
    # Four stages on two cores: rank r forwards after rank r - 1, then has 3 s of its own. With
    # free cores the step is the last rank's 4 + 3 s; on two, only rank 0 can work in the first
    # second, so the other 15 s of work take 7.5 s after it: 8.5, above all 16 s over two cores (8).
    chain = [[("F", r, 0, 1.0), ("W", r, 0, 3.0)] for r in range(4)]
    assert schedule_floor(chain, 4) == 7.0
    assert schedule_floor(chain, 4, cores=2) == 8.5


@pytest.mark.slow
def test_collectives_benchmark_reports_what_it_measured_before_its_deadline(tmp_path):
    """A run too long for its --deadline stops measuring shortly before it on every rank, prints
    and writes what it has, and exits with a failure (it once lost everything when stopped)."""
    out = tmp_path / "c.json"
    proc = subprocess.run(
        [sys.executable, "-m", "braid.bench", "collectives", "--nproc", "2", "--impls", "braid,gloo",
         "--max-bytes", "256M", "--deadline", "12", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "stopped before the deadline" in proc.stderr, proc.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    assert 0 < len(records) < 2 * 4 * 17 and all(r["wrong"] == 0 for r in records)
    assert "# busbw ratio braid / gloo" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["collectives", "--min-bytes", "1", "--max-bytes", "3"], "less than one float32 element per rank"),
    (["collectives", "--ops", "reduce_scatter", "--dtype", "float64", "--min-bytes", "8"], "use at least 16"),
    (["collectives", "--json", "."], "is a directory"),
    (["collectives", "--plot", "out.pdf"], "must end in .png"),
    (["collectives", "--json", "/proc/braid-missing/x.json"], "cannot write"),
    (["ddp", "--warmup", "1"], "--warmup must be at least 2"),
    (["ddp", "--nproc", "0"], "--nproc must be at least 1"),
    (["ddp", "--dim", "30", "--heads", "4"], "must be a multiple of --heads"),
    (["ddp", "--modes", ""], "none given"),
    (["ddp", "--modes", "gloo", "--link-mbit", "1000"], "--link-mbit needs the compute mode"),
    (["tp", "--nproc", "-1"], "--nproc must be at least 1"),
    (["sharding", "--timeout", "0"], "must be positive"),
    (["sharding", "--warmup", "1"], "--warmup must be at least 2"),
    (["sharding", "--link-mbit", "1000"], "--link-mbit needs --uplink"),
    (["sharding", "--uplink", "braid-nosuch0"], "no such network interface"),
    (["compression", "--numel", ""], "expected a count"),
    (["compression", "--repeats", "0"], "--repeats must be at least 1"),
    (["multihost", "--layouts", "3x1"], "layouts are 2xL"),
    (["multihost", "--sizes", "4Q"], "bad size"),
    (["multihost", "--compressors", "zip"], "unknown 'zip'"),
    (["multihost", "--iters", "1"], "--iters must be >= 2"),
    (["multihost", "--plot", "x.pdf"], "must end in .png"),
    (["multihost", "--hosts", "4,0"], "expected integers in 1..64"),
    (["multihost", "--hosts", "4", "--algos", "tree"], "unknown 'tree'"),
    (["multihost", "--hosts", "4", "--scale-link", "100,-1"], "links are Mbit/s integers"),
    (["multihost", "--hosts", "4", "--scale-link", ""], "--scale-link: none given"),
    (["multihost", "--hosts", "4", "--scale-link", "100,1000,100"], "a setting given twice"),
    (["multihost", "--from-json", "/proc/braid-missing/x.json"], "--from-json: cannot read"),
    (["multihost", "--from-json", "/proc/self/status"], "--from-json: cannot read"),
    (["staging", "--sizes", "0"], "--sizes takes positive integers"),
    (["cuda", "--nprocs", "1"], "--nprocs takes rank counts of at least 2"),
    (["cuda", "--sizes", "4Q"], "a size is a positive integer with K, M or G"),
    (["cuda", "--ops", "gather"], "invalid choice: 'gather'"),
    (["cuda", "--rounds", "0"], "--rounds must be at least 1"),
    (["staging", "--nproc", "1"], "--nproc must be at least 2"),
])
@pytest.mark.timeout(60)
def test_bad_benchmark_arguments_stop_before_running(argv, message, capsys):
    """Bad options are usage errors (exit status 2) before anything runs, instead of tracebacks
    from the ranks or an output path that fails after the whole run. The command line's own
    entry point, in this process (``python -m braid.bench`` runs the same main; starting a
    Python per case would cost seconds each)."""
    from braid.bench.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2, (stopped.value.code, err[-2000:])
    assert message in err, err[-2000:]


@pytest.mark.slow
def test_the_command_line_reports_usage_errors():
    """``python -m braid.bench`` itself: a bad option is exit status 2 with the message."""
    proc = subprocess.run([sys.executable, "-m", "braid.bench", "sharding", "--warmup", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "--warmup must be at least 2" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.parametrize("name", ["staging", "cuda", "gpufloor"])
@pytest.mark.slow
def test_gpu_benchmark_without_a_gpu_says_so(name):
    proc = subprocess.run([sys.executable, "-m", "braid.bench", name], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "needs a CUDA device" in proc.stderr, proc.stderr[-2000:]


def test_gpufloor_argument_checks(capsys):
    from braid.bench import gpufloor

    for argv, message in ((["--nprocs", "1"], "--nprocs must be at least 2, got 1"),
                          (["--round-trips", "0"], "--round-trips must be at least 1, got 0")):
        with pytest.raises(SystemExit):
            gpufloor.main(argv, prog="gpufloor")
        assert message in capsys.readouterr().err


def test_cuda_benchmark_floor_is_the_bytes_an_in_place_algorithm_moves():
    """The floor's device-memory bytes per rank at nccl-tests size S among N ranks."""
    from braid.bench.cuda import floor_bytes

    assert floor_bytes("all_reduce", 1000, 4) == 3 * 1000 - 250
    assert floor_bytes("reduce_scatter", 1000, 4) == 1000 + 250
    assert floor_bytes("all_gather", 1000, 4) == floor_bytes("all_to_all", 1000, 4) == 2000
    with pytest.raises(ValueError, match="op must be one of"):
        floor_bytes("gather", 1000, 4)


@pytest.mark.slow
def test_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL of the process that spawned the ranks stops them too (they would otherwise run the
    whole benchmark with nobody to enforce its deadline)."""
    import os
    import signal
    import threading
    import time

    launcher = subprocess.Popen(
        [sys.executable, "-m", "braid.bench", "collectives", "--nproc", "2", "--impls", "braid",
         "--ops", "all_reduce", "--max-bytes", "256M", "--deadline", "300"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    measuring = threading.Event()

    def watch_progress():  # the progress line of the first size: both ranks are up and measuring
        seen = b""
        while not measuring.is_set():
            chunk = os.read(launcher.stderr.fileno(), 4096)
            if not chunk:
                return
            seen = (seen + chunk)[-4096:]
            if b"braid all_reduce" in seen:
                measuring.set()

    threading.Thread(target=watch_progress, daemon=True).start()
    try:
        deadline = time.time() + 60
        ranks = []
        while time.time() < deadline and len(ranks) < 2:
            out = subprocess.run(["pgrep", "-P", str(launcher.pid), "-f", "spawn_main"],
                                 capture_output=True, text=True).stdout.split()
            ranks = [int(p) for p in out]
            time.sleep(0.2)
        assert len(ranks) == 2, "the ranks did not start"
        assert measuring.wait(max(0.0, deadline - time.time())), "the ranks did not start measuring"
        launcher.kill()
        launcher.wait()

        def alive():
            return [p for p in ranks if os.path.exists(f"/proc/{p}") and
                    open(f"/proc/{p}/stat").read().split()[2] != "Z"]

        gone_by = time.time() + 30  # the ranks notice the launcher's death and exit
        while alive() and time.time() < gone_by:
            time.sleep(0.05)
        alive = alive()
        for p in alive:
            os.kill(p, signal.SIGKILL)
        assert alive == [], "ranks outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def deepspeed_agreement(rank, n, store_path):
    """Each rank in turn fails alone; every rank must raise, the failing one with its reason."""
    from braid.bench import deepspeed_peer
    from helpers.ranks import process_group

    seen = []
    with process_group(rank, n, store_path):
        deepspeed_peer._agreed(None)  # nobody failed: returns on every rank
        for failing in range(n):
            try:
                deepspeed_peer._agreed("boom" if rank == failing else None)
                seen.append(None)
            except RuntimeError as e:
                seen.append(str(e))
    return seen


def test_deepspeed_peer_failures_reach_every_rank():
    """The DeepSpeed peer's ranks agree on a failure before DeepSpeed's own handshake (which has
    no deadline): one rank's failure makes every rank give up."""
    from helpers.ranks import run_ranks

    results = run_ranks(deepspeed_agreement, 3)
    for rank, seen in enumerate(results):
        assert seen[rank] == "boom"
        assert all(s is not None and "another rank" in s for j, s in enumerate(seen) if j != rank)


def test_deepspeed_peer_availability_named():
    """Why the peer cannot run: deepspeed missing, or a dtype its kernels lack."""
    import importlib.util

    from braid.bench import deepspeed_peer

    installed = importlib.util.find_spec("deepspeed") is not None
    for dtype in ("int32", "float64"):
        why = deepspeed_peer.unavailable(dtype)
        assert why is not None and (f"no {dtype} kernel" if installed else "not installed") in why
    assert (deepspeed_peer.unavailable("float32") is None) == installed


@pytest.mark.parametrize("name", sorted(importlib.import_module("braid.bench.__main__").BENCHMARKS))
def test_every_benchmark_prints_its_help(name, capsys):
    """`python -m braid.bench NAME --help` works for every registered benchmark (argparse formats
    help strings lazily, so a stray '%' in one only shows here)."""
    from braid.bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_optim_benchmark_reports_every_implementation(tmp_path, capsys):
    """`python -m braid.bench optim` at a small size: a row per thread count and copy mode, each
    with braid's ratio to the floor and to both torch implementations, and the JSON records."""
    import json

    from braid.bench.__main__ import main

    out = tmp_path / "optim.json"
    assert main(["optim", "--sizes", "100K", "--threads", "1", "--repeats", "1", "--iters", "1",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("braid/torch-fused") == 2 and text.count("braid/floor") == 2, text
    records = json.loads(out.read_text())["records"]
    assert [r["bf16_copy"] for r in records] == [False, True]
    assert all(r[i]["gbps"] > 0 for r in records for i in ("braid", "torch-fused", "torch-foreach"))


def test_delayed_benchmark_trains_both_updates(tmp_path, capsys):
    """`python -m braid.bench delayed` at its shortest: a row per update, the JSON with every loss;
    the two runs start from the same parameters and batches, so their first losses agree, and the
    second does not (the delayed run computes it still with the first parameters)."""
    import json

    from braid.bench.__main__ import main

    out = tmp_path / "delayed.json"
    assert main(["delayed", "--lrs", "1e-2", "--steps", "50", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "usual" in text and "delayed" in text, text
    usual, delayed = json.loads(out.read_text())["records"]
    assert (usual["update"], delayed["update"]) == ("usual", "delayed")
    assert usual["losses"][0] == delayed["losses"][0]
    assert usual["losses"][1] != delayed["losses"][1]
    assert usual["loss_100"] is None and usual["loss_last_50"] < usual["losses"][0]  # it trains


@pytest.mark.slow
def test_ft_benchmark_measures_both_recoveries_and_the_overhead(tmp_path, capsys):
    """`python -m braid.bench ft` at its smallest: one kill under braid.ft and one under torchrun,
    each measured from the logs (kill time, next step, steps lost), and the overhead in turns."""
    import json

    from braid.bench.__main__ import main

    out = tmp_path / "ft.json"
    assert main(["ft", "--trials", "1", "--steps", "24", "--die-at", "12", "--checkpoint-every", "5",
                 "--step-sleep", "0.01", "--hidden", "64", "--overhead-steps", "3", "--rounds", "2",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kill -> next committed step" in text and "per-step quorum" in text, text
    results = json.loads(out.read_text())
    ft, peer = results["recovery"][0], results["torchrun"][0]
    assert ft["steps_lost"] == 1 and ft["committed_steps_thrown_away"] == 0, ft
    assert peer["committed_steps_thrown_away"] == 2 and peer["steps_lost"] == 3, peer  # from step 10
    assert ft["kill_to_next_step_s"] > 0 and peer["kill_to_next_step_s"] > 0
    assert set(results["overhead"]["step_s"]) == {"ddp+braid-hook", "braid.ft"}


# -- python -m braid.bench plan: its setups, its rank numbering against the planner's, Kendall's
# tau, the memory tracker and the comparison (no timing is checked) ------------------------------
def test_setups_parse_and_refuse():
    assert bench_plan.parse_setups("2x2:1000,4x1:0") == [(2, 2, 1000), (4, 1, 0)]
    assert bench_plan.parse_setups("1x4") == [(1, 4, 0)]
    for bad in ("2x3:1000", "2x2:-1", "two", "", "2x2:fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_plan.parse_setups(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown layout"):
        bench_plan.parse_layouts("ddp,zero4")


@pytest.mark.parametrize("layout", bench_plan.LAYOUTS, ids=bench_plan.LAYOUT_NAMES)
@pytest.mark.parametrize("per_host", [1, 2, 4])
def test_groups_are_the_planners(layout, per_host):
    """Each group the benchmark makes spans the hosts the planner charges it for (the mesh
    (pp, dp, cp, tp), tp fastest), and every group of a dimension partitions the ranks."""
    world = 4
    assert layout.dp * layout.tp * layout.pp * layout.cp == world
    assert layout.dp % layout.ep == 0 and layout.dpe * layout.ep == layout.dp
    want = spans(layout.tp, layout.cp, layout.dp, layout.ep, layout.pp, per_host)
    for dims, key in ((("tp",), "tp"), (("cp",), "cp"), (("pp",), "pp"), (("dp", "cp"), "dense"),
                      (("ep",), "ep"), (("dpe", "cp", "tp"), "expert")):
        groups = bench_plan.group_members(layout, dims, world)
        assert sorted(r for g in groups for r in g) == list(range(world))
        size = 1
        for d in dims:
            size *= getattr(layout, d)
        assert all(len(g) == size for g in groups)
        for g in groups:
            hosts = {r // per_host for r in g}
            local = max(sum(1 for r in g if r // per_host == h) for h in hosts)
            assert (local, len(hosts)) == want[key], (dims, g)


def test_kendall_tau():
    assert bench_plan.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench_plan.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # 5 concordant and 1 discordant pair of 6: (5 - 1) / 6
    assert bench_plan.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # a tie in one sequence: tau-b's denominator sqrt((6 - 0) * (6 - 1))
    assert bench_plan.kendall_tau([1, 2, 3, 4], [1, 1, 3, 4]) == pytest.approx(5 / (6 * 5) ** 0.5)


def test_peak_memory_by_hand():
    """Roots count from the start; a temporary counts while it lives; resize_ moves the count."""
    root = torch.zeros(1000)  # 4,000 bytes
    with bench_plan.PeakMemory([root]) as tracker:
        a = torch.ones(2000)  # 8,000
        b = a * 2  # 8,000 more: 20,000 at once
        del a, b
        c = torch.ones(500)  # 2,000
        c.untyped_storage().resize_(0)
        d = torch.ones(100)  # 400
    assert tracker.peak == 4000 + 8000 + 8000
    assert tracker.current == 4000 + 0 + 400
    del c, d
    assert tracker.current == 4000  # freed after the block too: the count follows the storages


def test_compare_names_the_first_choice_and_the_best():
    def layout(step, total):
        return SimpleNamespace(step=step, memory=SimpleNamespace(total=total))

    measured = {"step": {"a": 1.0, "b": 2.0, "c": 3.0}, "peak": {"a": 100, "b": 100, "c": 100}}
    predicted = {"a": layout(2.0, 100), "b": layout(1.0, 110), "c": layout(3.0, 130)}
    c = bench_plan.compare(measured, predicted)
    assert c["choices"] == {"dense": {"first_choice": "b", "measured_best": "a", "first_over_best": 2.0}}
    assert c["kendall_tau"] == pytest.approx(1 / 3)
    assert c["memory_within_15"] == 2
    # per model: the first choice and the best among that model's layouts only; tau over all
    measured["step"]["d"], measured["peak"]["d"], predicted["d"] = 0.5, 100, layout(0.1, 100)
    c = bench_plan.compare(measured, predicted, {"a": "dense", "b": "dense", "c": "moe", "d": "moe"})
    assert c["choices"]["dense"]["first_choice"] == "b" and c["choices"]["dense"]["measured_best"] == "a"
    assert c["choices"]["moe"] == {"first_choice": "d", "measured_best": "d", "first_over_best": 1.0}
    assert c["kendall_tau"] == pytest.approx(bench_plan.kendall_tau([2, 1, 3, 0.1], [1, 2, 3, 0.5]))
    assert c["rounds_tau"] == []  # no rounds recorded
    # the measurement against itself: tau between every two rounds
    measured["step_rounds"] = {"a": [1, 1, 3], "b": [2, 3, 2], "c": [3, 2, 1], "d": [4, 4, 4]}
    c = bench_plan.compare(measured, predicted)
    assert c["rounds_tau"] == pytest.approx([bench_plan.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]),
                                             bench_plan.kendall_tau([1, 2, 3, 4], [3, 2, 1, 4]),
                                             bench_plan.kendall_tau([1, 3, 2, 4], [3, 2, 1, 4])])


def test_moe_parameter_count_by_hand():
    """The MoE model's whole parameter count the planner is given, against the modules themselves:
    the dense GPT with each block's MLP traded for a router and the experts."""
    from braid.comm import moe

    dense = bench_plan._model()
    swapped = bench_plan._model()
    for block in swapped.blocks:
        block.mlp = torch.nn.ModuleList(
            [torch.nn.Linear(bench_plan.MODEL["dim"], bench_plan.MOE["experts"], bias=False)]
            + [moe.ExpertMLP(bench_plan.MODEL["dim"], bench_plan.MOE["expert_hidden"])
               for _ in range(bench_plan.MOE["experts"])])
    assert bench_plan.moe_parameters(dense) == sum(p.numel() for p in swapped.parameters())
    shape = bench_plan._shape(moe=True)
    # the planner's own count from the shape agrees with the modules (biases aside: within 1%)
    assert shape.param_count() == pytest.approx(bench_plan.moe_parameters(dense), rel=0.01)
