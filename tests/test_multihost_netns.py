"""braid between simulated hosts: network namespaces joined through a bridge, each host with its own
hostname and /dev/shm (braid.bench.simhosts), so only TCP crosses between them and the ranks find
their hosts from their real host identity (no BRAID_HOST_ID). The rank functions are
test_multihost's; here they run as processes started inside the namespaces, sharing a FileStore on
the common file system. Skipped, with the reason, where namespaces cannot be made (not root, no
iproute2); test_multihost covers the same paths over loopback everywhere.
"""

import json
import os
import sys
import time
from datetime import timedelta

import pytest
from braid.bench.simhosts import SimulatedHosts, unavailable_reason
from helpers.ranks import new_store_path, open_store

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"simulated hosts unavailable: {REASON}")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
RANK_TIMEOUT_S = 150

# A rank: runs a test module's functions (fn, store path, args) in turn, each as
# fn(rank, n, store_path, *args), and prints each result as JSON (one process start for several).
_RANK_MAIN = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import {module} as functions
for fn, store, args in {calls!r}:
    print("RESULT " + json.dumps(getattr(functions, fn)({rank}, {n}, store, *args)), flush=True)
"""


def start_ranks(hosts, layout, fn, store_path, *args, env=None, module="test_multihost"):
    """One process per rank, on the host ``layout`` names, running ``module``'s ``fn``; returns
    the Popen objects."""
    return start_rank_calls(hosts, layout, [(fn, store_path, list(args))], env=env, module=module)


def start_rank_calls(hosts, layout, calls, env=None, module="test_multihost"):
    """One process per rank, on the host ``layout`` names, running ``calls`` ((fn, store path, args)
    each, a store per call; fn one of ``module``'s functions) in turn; returns the Popen objects."""
    procs = []
    for rank, h in enumerate(layout):
        code = _RANK_MAIN.format(tests=TESTS_DIR, module=module, rank=rank, n=len(layout),
                                 calls=[list(c) for c in calls])
        procs.append(
            hosts.popen(
                h,
                [sys.executable, "-c", code],
                cwd=TESTS_DIR,
                env={"BRAID_TEST_REAL_HOSTS": "1", **(env or {})},
                stdout=__import__("subprocess").PIPE,
                stderr=__import__("subprocess").PIPE,
                text=True,
            )
        )
    return procs


def results_of(procs, timeout_s=RANK_TIMEOUT_S, calls=1):
    """Every rank's JSON result; a rank that fails or hangs fails the test with its stderr. With
    ``calls`` > 1 (ranks started by start_rank_calls), one such list per call, in call order."""
    deadline = time.monotonic() + timeout_s
    out = []
    for rank, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a hang: kill everyone, report
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {rank} did not finish within {timeout_s} s") from None
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and len(lines) >= calls, (
            f"rank {rank} exited {p.returncode}:\n{stderr[-3000:]}")
        out.append([json.loads(ln[len("RESULT ") :]) for ln in lines[-calls:]])
    if calls == 1:
        return [r[0] for r in out]
    return [[r[i] for r in out] for i in range(calls)]


def assert_agree(summaries, min_cases):
    failures = [f"rank {r}: {f}" for r, s in enumerate(summaries) for f in s["failures"]]
    assert not failures, "\n".join(failures[:20])
    assert len({s["digest"] for s in summaries}) == 1, "ranks hold different bits"
    assert min(s["cases"] for s in summaries) >= min_cases


@pytest.mark.timeout(300)
# Hosts of one rank between namespaces are in 2+1+1 (two of its hosts), and 2x1 runs over
# loopback in test_multihost.py.
@pytest.mark.parametrize("layout", [[0, 0, 1, 1], [0, 0, 1, 2]], ids=["2x2", "2+1+1"])
@pytest.mark.slow
def test_collectives_between_namespaces(layout):
    """Exact all_reduce (every dtype and op, every path), data movement and compressed
    all-reduces between hosts that share nothing but a network."""
    with SimulatedHosts(max(layout) + 1) as hosts:
        calls = [("all_reduce_across_hosts", new_store_path(), [layout, 21]),
                 ("data_movement_across_hosts", new_store_path(), [layout, 22])]
        exact, movement = results_of(start_rank_calls(hosts, layout, calls), calls=2)
        assert_agree(exact, 100)
        assert_agree(movement, 50)


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    unavailable_reason(ipv6=True) is not None, reason=f"no IPv6 hosts: {unavailable_reason(ipv6=True)}"
)
@pytest.mark.slow
def test_collectives_between_namespaces_over_ipv6():
    """BRAID_SOCKET_IFNAME and BRAID_SOCKET_FAMILY=AF_INET6: the ranks listen on their interface's
    IPv6 address and the same collectives are exact."""
    layout = [0, 0, 1]
    env = {"BRAID_SOCKET_IFNAME": "eth", "BRAID_SOCKET_FAMILY": "AF_INET6"}
    with SimulatedHosts(2, ipv6=True) as hosts:
        calls = [("data_movement_across_hosts", new_store_path(), [layout, 23]),
                 ("tcp_endpoint", new_store_path(), [layout])]
        movement, endpoints = results_of(start_rank_calls(hosts, layout, calls, env=env), calls=2)
        assert_agree(movement, 50)
        assert all(e.startswith("[fd00:") for e in endpoints), endpoints


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_ddp_fsdp2_dtensor_between_namespaces():
    """torch.distributed on braid between namespaces (and gloo in the same processes, as the
    reference) trains DDP, FSDP2 and DTensor models to the same parameters."""
    layout = [0, 1]
    with SimulatedHosts(2) as hosts:
        store = new_store_path()
        results = results_of(
            start_ranks(hosts, layout, "backend_across_hosts", store, layout, "_run_ddp_fsdp_dtensor")
        )
        assert all(r is not False for r in results), results


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_link_down_times_out_naming_the_ranks_behind_it():
    """Host 1's link goes down between two collectives: the ranks of host 0 raise CommTimeout at
    their deadline, naming a rank of host 1 (none hangs, none raises anything else)."""
    layout = [0, 0, 1, 1]
    with SimulatedHosts(2) as hosts:
        store_path = new_store_path()
        procs = start_ranks(hosts, layout, "link_cut", store_path, layout)
        store = open_store(store_path)
        store.wait([f"cut/ready{r}" for r in range(len(layout))], timedelta(seconds=90))
        hosts.set_link(1, False)
        store.set("cut/go", "1")
        results = results_of(procs)
    for r in (0, 1):
        seen = results[r]
        assert seen["type"] == "CommTimeout", (r, seen)
        assert "rank 2" in seen["message"] or "rank 3" in seen["message"], (r, seen)
    for r in (2, 3):
        assert results[r]["type"] in ("CommTimeout", "PeerError"), (r, results[r])


# 20 Mbit/s: 2.5 MB/s of frames, so an exact 512 KiB bucket takes over 200 ms against a window of
# ~10-40 ms (Adaptive predicted 257 ms). Unshaped, between two namespaces of the 2-core machine at
# load 10, it measured 18-22 ms (19-33 MB/s) in two runs.
SLOW_LINK_MBIT = 20
# tbf's bucket (16 KiB here: simhosts' floor, over its 4 ms of rate) lets that much through at
# once, so a 128 KiB transfer may end up to 128 / 112 sooner than the rate allows.
BURST_ALLOWANCE = 128 / 112


@pytest.mark.timeout(120)
@pytest.mark.skipif(unavailable_reason(rate=True) is not None,
                    reason=f"no rate-limited hosts: {unavailable_reason(rate=True)}")
@pytest.mark.slow
def test_auto_hook_compresses_across_a_measured_slow_link():
    """DDP's "auto" hook over a braid communicator between two hosts whose link a tbf qdisc holds
    to 20 Mbit/s, with no link figure given: the bandwidth Adaptive fits from its own exact
    warm-up calls is the shaped link's (at most its rate; unshaped it is several times more), and
    from it every bucket it decides is compressed, the same choice and reason on both ranks; the
    last step's buckets travel compressed."""
    with SimulatedHosts(2, rate_mbit=SLOW_LINK_MBIT) as hosts:
        procs = start_ranks(hosts, [0, 1], "auto_hook_on_measured_link", new_store_path(), 4,
                            module="test_adaptive")
        results = results_of(procs, timeout_s=60)
    rate = SLOW_LINK_MBIT * 1e6 / 8
    for r in results:
        assert r["hosts"] == 2, r
        assert 0 < r["across_hosts_bytes_per_s"] <= rate * BURST_ALLOWANCE, r
        # The two large buckets; the small one stays under the hook's minimum, outside the choice.
        assert len(r["decisions"]) == 2 and all(c != "exact" for c, _ in r["decisions"].values()), r
        assert r["last_step"]["sent"] * 4 < r["last_step"]["dense"], r
    assert results[0]["decisions"] == results[1]["decisions"], "ranks decided differently"
