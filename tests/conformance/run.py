"""Runs PyTorch's distributed test suite against braid and gloo side by side.

    python tests/conformance/run.py [--world-sizes 2 3] [--backends braid gloo] [-k EXPR]
                                    [--timeout S] [--json FILE] [--quick]

For each world size it runs the selected tests of ``DistributedTest._DistTestBase`` (collective,
point-to-point, DDP and object-collective tests, by name) once per backend, each test in fresh
ranks with a per-test timeout, and prints passed / failed / skipped per backend side by side,
every test whose outcome differs between the backends, and the tests that the suite skips on
braid only because it gates them on a backend name. Those gated tests are also run on braid under
gloo's gates (tests/conformance/torch_suite.py explains how) and reported as a third column. The
runs of a world size go side by side (their ranks mostly wait). Exit status 1 when a test that
passes on gloo does not pass on braid (directly or under gloo's gates), else 0.

``--quick`` runs the selection CI uses (tests/test_conformance.py): a few tests of each area.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = HERE / "torch_suite.py"

# The areas of the suite a communication backend answers for, as name fragments.
AREAS = ["all_reduce", "allreduce", "broadcast", "reduce", "all_gather", "allgather", "reduce_scatter",
         "barrier", "send_recv", "isend", "irecv", "batch_isend_irecv", "all_to_all", "scatter", "gather",
         "DistributedDataParallel", "ddp", "_object"]
SELECTION = " or ".join(AREAS)

# CI's share (tests/test_conformance.py): one or a few tests of each area, the ones braid once
# failed among them, at most a minute on a 2-core machine.
QUICK = " or ".join([
    "test_all_reduce_sum", "test_all_reduce_coalesced_sum", "test_broadcast", "test_reduce_sum",
    "test_all_gather", "test_all_gather_coalesced", "test_reduce_scatter", "test_barrier",
    "test_send_recv", "test_isend", "test_irecv", "test_batch_isend_irecv_gloo", "test_scatter",
    "test_gather", "test_all_gather_object", "test_scatter_object_list", "test_broadcast_object_list",
    "test_ddp_logging_data_cpu", "test_DistributedDataParallel_requires_grad",
])

# Tests whose body calls what torch itself refuses to any backend but gloo, before a backend is
# asked (the code that decides is quoted): run on braid under gloo's gates they fail with this
# message, and only then count as torch's limit rather than braid's failure.
TORCH_LIMITS = {
    "test_monitored_barrier_gloo": "monitored_barrier is only implemented for GLOO backend",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier is only implemented for GLOO backend",
}
TORCH_LIMITS_WHY = ("torch.distributed.monitored_barrier: `if get_backend(group) != Backend.GLOO: raise "
                    "ValueError(\"monitored_barrier is only implemented for GLOO backend.\")`")

# A skip message naming a backend (braid, or one it is not): the suite gated the test on a name
# (a skip for the world size or a missing GPU names none).
_GATE = re.compile(r"\b(braid|gloo|nccl|mpi|ucc|xccl|hccl)\b", re.IGNORECASE)


def run_suite(backend: str, world_size: int, select: str, timeout: float,
              gates_as: str | None = None) -> dict:
    """Runs the suite's tests matching ``select`` on ``backend`` at ``world_size`` ranks (under
    ``gates_as``'s name gates when given); returns {test name: (outcome, message)} with outcome
    one of passed, failed, skipped."""
    with tempfile.TemporaryDirectory(prefix="braid-conformance-") as tmp:
        report = Path(tmp) / "report.xml"
        env = dict(os.environ, BACKEND=backend, WORLD_SIZE=str(world_size), TEMP_DIR=tmp)
        env.pop("CONFORMANCE_GATES_AS", None)
        if gates_as:
            env["CONFORMANCE_GATES_AS"] = gates_as
        args = [sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider",
                f"--timeout={timeout}", f"--junitxml={report}", "-o", "junit_family=xunit1",
                "--rootdir", str(HERE), "--confcutdir", str(HERE)]
        args += ["-k", select]
        proc = subprocess.run(args, env=env, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        if not report.exists():
            raise RuntimeError(f"the suite did not run on {backend} (exit {proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}")
        return parse_junit(report)


def parse_junit(path: Path) -> dict:
    """{test name: (outcome, message)} from a pytest JUnit XML report."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                # The ranks' tracebacks sit inside the message: kept whole (a rank's exception
                # is what TORCH_LIMITS matches), shortened only when printed.
                text = (child.get("message") or "") + "\n" + (child.text or "")
                outcome, message = "failed", text[:20000]
                break
            if child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "")[:300]
        results[name] = (outcome, message)
    return results


def counts(results: dict) -> dict:
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome, _ in results.values():
        c[outcome] += 1
    return c


def name_gated(braid: dict, gloo: dict) -> list[str]:
    """Tests that pass on gloo and that the suite skips on braid with a message naming another
    backend: skipped by name, not by what braid can do."""
    return sorted(t for t, (outcome, message) in braid.items()
                  if outcome == "skipped" and gloo.get(t, ("",))[0] == "passed" and _GATE.search(message))


def compare(world_size: int, backends: list[str], select: str, timeout: float, log) -> dict:
    """Runs one world size on each backend (and braid under gloo's gates); returns the report.

    The runs go side by side: the suite's processes spend most of their time waiting for the
    ranks they spawn (on 2 cores a run keeps them about a quarter busy), so three at once take
    little longer than one. braid runs under gloo's gates over the whole selection, of which the
    report keeps the tests the suite skips on braid by name."""
    jobs = {backend: (backend, None) for backend in backends}
    gated_run = "braid" in jobs and "gloo" in jobs
    if gated_run:
        jobs["braid as gloo"] = ("braid", "gloo")
    log(f"world size {world_size}: running the suite on {', '.join(jobs)} side by side ...")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(run_suite, backend, world_size, select, timeout, gates_as=gates)
                   for name, (backend, gates) in jobs.items()}
        done = {name: f.result() for name, f in futures.items()}
    results = {backend: done[backend] for backend in backends}
    for backend in backends:
        c = counts(results[backend])
        log(f"  {backend}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
    log(f"  in {time.monotonic() - start:.0f} s")
    report = {"world_size": world_size, "results": results, "gated": [], "gated_results": {}}
    if gated_run:
        report["gated"] = name_gated(results["braid"], results["gloo"])
        if report["gated"]:
            log(f"  braid under gloo's gates: {len(report['gated'])} tests the suite skips on braid by name")
            report["gated_results"] = {t: done["braid as gloo"][t] for t in report["gated"]
                                       if t in done["braid as gloo"]}
    return report


def torch_limited(report: dict) -> list[str]:
    """Gated tests that failed on braid only where torch refuses every backend but gloo."""
    return sorted(t for t in report["gated"] if t in TORCH_LIMITS and report["gated_results"].get(t, ("",))[0]
                  == "failed" and TORCH_LIMITS[t] in report["gated_results"][t][1])


def regressions(report: dict) -> list[str]:
    """Tests that pass on gloo and do not pass on braid (the gated ones judged by their run under
    gloo's gates), except those torch itself refuses to any backend but gloo."""
    limited = set(torch_limited(report))
    braid, gloo = report["results"].get("braid"), report["results"].get("gloo")
    if braid is None or gloo is None:
        return []
    bad = []
    for test, (outcome, _) in sorted(gloo.items()):
        if outcome != "passed":
            continue
        mine = report["gated_results"].get(test) if test in report["gated"] else braid.get(test)
        if (mine is None or mine[0] != "passed") and test not in limited:
            bad.append(test)
    return bad


def print_report(report: dict, out=sys.stdout) -> None:
    results, ws = report["results"], report["world_size"]
    names = list(results)
    print(f"\nworld size {ws}: " + "   ".join(
        f"{b}: {counts(r)['passed']} passed / {counts(r)['failed']} failed / {counts(r)['skipped']} skipped"
        for b, r in results.items()), file=out)
    if report["gated"]:
        g = counts(report["gated_results"])
        print(f"  braid under gloo's name gates ({len(report['gated'])} tests): {g['passed']} passed / "
              f"{g['failed']} failed / {g['skipped']} skipped", file=out)
    tests = sorted(set().union(*[set(r) for r in results.values()]))
    differing = [t for t in tests if len({results[b].get(t, ("absent",))[0] for b in names}) > 1]
    if differing:
        width = max(len(t) for t in differing)
        print(f"  {'outcome differs':<{width}}  " + "  ".join(f"{b:>8}" for b in names)
              + ("  gloo-gates" if report["gated"] else ""), file=out)
        for t in differing:
            row = "  ".join(f"{results[b].get(t, ('absent',))[0]:>8}" for b in names)
            gated = report["gated_results"].get(t, ("",))[0]
            print(f"  {t:<{width}}  {row}  {gated}", file=out)
    for t in torch_limited(report):
        print(f"  torch's limit, not braid's: {t}", file=out)
    if torch_limited(report):
        print(f"    ({TORCH_LIMITS_WHY})", file=out)
    bad = regressions(report)
    for t in bad:
        mine = report["gated_results"].get(t) or results["braid"].get(t, ("absent", ""))
        print(f"  NOT ON BRAID: {t}: {mine[0]} {mine[1][:200]}", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--backends", nargs="+", default=["braid", "gloo"], choices=["braid", "gloo"])
    p.add_argument("-k", dest="select", default=None, help="pytest -k expression (default: the areas' names)")
    p.add_argument("--quick", action="store_true", help="the small selection CI runs")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per test (default 120)")
    p.add_argument("--json", help="write every outcome here")
    args = p.parse_args(argv)
    for ws in args.world_sizes:
        if ws < 2:
            p.error(f"--world-sizes: {ws} is below 2 (the suite needs two ranks)")
    select = args.select or (QUICK if args.quick else SELECTION)

    def log(msg):
        print(msg, flush=True)

    reports = [compare(ws, args.backends, select, args.timeout, log) for ws in args.world_sizes]
    for r in reports:
        print_report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    return 1 if any(regressions(r) for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
