"""Collectives across simulated hosts: braid vs gloo (and braid's compressed all-reduces) on links
shaped to 1 and 10 Gbit and unshaped, with the plain-TCP floor of the same link measured in the run,
and the DDP step of the ~25M-parameter LM (``python -m braid.bench ddp``, its ranks on the hosts),
and, with ``--sharding-links``, the sharded training step (``python -m braid.bench sharding``: FSDP2
on gloo, braid's ZeRO-3 exact and with ZeRO++'s quantized gathers and reduce-scatters). With
``--hosts 4,8,16``: many hosts, each group's setup and sockets, and 4 KiB and 8 MiB all_reduces of
gloo and of braid with each of its algorithms, against the ring optimum, and the cost model
(bench/costmodel.py) fitted to them; with several ``--scale-link`` settings it is also fitted on
each setting and scored on the others, and ``--from-json`` prints all of it again from an earlier
run's ``--json``.

The hosts are network namespaces joined by a bridge (braid.bench.simhosts), each with its own
/dev/shm and hostname, so only TCP crosses between them; ``tc tbf`` shapes each host's uplink.
Every rank runs braid and gloo in the same process, their batches taking turns in an order that
rotates every round (bench/turns.py), each after a barrier, and reports the nccl-tests columns
plus link use: the bytes that left the host's uplink during the batch (the kernel's counter of
the host's interface), over the batch's time, over the link rate. A group's setup (built and its
first 4-byte all_reduce; gloo's, then braid's) is timed on each rank from a barrier on the store
that every rank has passed, and reported for the slowest rank. Needs root and iproute2; elsewhere
it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from . import costmodel
from .report import (human_bytes, machine_info, output_path, paired_ratios, panel_grid, save_panels,
                     write_json)
from .simhosts import INTERFACE, SimulatedHosts, tx_bytes, unavailable_reason

IMPLS = ("braid", "gloo")
# reduce_scatter beside the all_reduces (--scale-ops): braid's (the ring between hosts from three
# hosts on) and gloo's, each rank's chunk of nbytes / world checked.
RS_IMPLS = ("braid-rs", "gloo-rs")
# name: (braid.comm class, its arguments)
COMPRESSORS = {
    "int8": ("Int8Quantizer", {}),
    "int4": ("Int4Quantizer", {}),
    "topk1%": ("TopK", {"ratio": 0.01}),
}
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
QUICK_SIZES = (4 << 10, 1 << 20, 16 << 20)
SCALE_SIZES = (4 << 10, 8 << 20)  # with --hosts: a latency-bound and a bandwidth-bound message
STORE_PORT = 29517
# Each timed batch lasts at least this long (more iterations for small messages), so that link
# counters and clocks are read over a meaningful span.
MIN_BATCH_S = 0.3


def parse_sizes(text: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = units.get(part[-1:], 1)
        digits = part[:-1] if part[-1:] in units else part
        if not digits.isdigit() or int(digits) <= 0:
            raise argparse.ArgumentTypeError(f"bad size {part!r} (e.g. 4K,1M,64M)")
        out.append(int(digits) * mult)
    return out


def parse_layouts(text: str) -> list[int]:
    """ "2x1,2x2" -> ranks per host for 2 hosts."""
    out = []
    for part in text.split(","):
        hosts, _, per = part.partition("x")
        if hosts != "2" or not per.isdigit() or not 1 <= int(per) <= 4:
            raise argparse.ArgumentTypeError(f"layouts are 2xL with L in 1..4, got {part!r}")
        out.append(int(per))
    return out


def parse_host_counts(text: str) -> list[int]:
    out = []
    for part in filter(None, text.split(",")):
        if not part.strip().isdigit() or not 1 <= int(part) <= 64:
            raise argparse.ArgumentTypeError(f"expected integers in 1..64, got {part!r}")
        out.append(int(part))
    return out


def parse_links(text: str) -> list[int]:
    out = []
    for part in filter(None, text.split(",")):
        if not part.strip().isdigit():
            raise argparse.ArgumentTypeError(f"links are Mbit/s integers (0: unshaped), got {part!r}")
        out.append(int(part))
    return out


# ----------------------------------------------------------------------------------------------
# Inside a simulated host: one rank.


def rank_main(settings: dict) -> int:
    """One rank: times every implementation at every size, alternating, and prints JSON records
    (rank 0 prints the ones of the whole run)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from braid import comm

    from .turns import order_of_round

    # torch 2.13 renamed reduce_scatter_tensor; both spellings take the same arguments.
    _reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    torch.set_num_threads(1)
    rank, world, per_host = settings["rank"], settings["world"], settings["per_host"]
    timeout = timedelta(seconds=settings["timeout"])
    store = dist.TCPStore(settings["master"], STORE_PORT, world, is_master=rank == 0, timeout=timeout)
    # Setup: each library's group built and its first (4-byte) all_reduce done, and the sockets
    # that left this process holding (braid connects on demand: its count grows with what runs).
    # Each is timed from the same starting line, every rank past a barrier on the store: timed
    # from a rank's own start, a setup would also hold how much later the last rank started.
    before = _sockets()
    _line_up(store, world, "gloo")
    t0 = time.perf_counter()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo/", store), rank=rank, world_size=world, timeout=timeout
    )
    dist.all_reduce(torch.ones(1))
    gloo_setup, gloo_sockets = time.perf_counter() - t0, _sockets() - before
    _line_up(store, world, "braid")
    t0 = time.perf_counter()
    c = comm.Communicator(dist.PrefixStore("braid/", store), rank, world, timeout=settings["timeout"])
    c.all_reduce(torch.ones(1))
    braid_setup = time.perf_counter() - t0
    # Each algorithm forced (BRAID_ALGO), beside braid's own choice.
    forced = {f"braid-{algo}": comm.Communicator(dist.PrefixStore(f"braid-{algo}/", store), rank, world,
                                                 timeout=settings["timeout"], algo=algo)
              for algo in settings.get("algos", [])}
    exact = {"braid": c, **forced}  # braid's exact all-reduces, by implementation
    reports_link = c.local_rank == 0
    rs_impls = list(RS_IMPLS) if settings.get("reduce_scatter") else []
    impls = list(IMPLS) + list(forced) + list(settings["compressors"]) + rs_impls
    records = []
    for nbytes in settings["sizes"]:
        count = nbytes // 4
        # Exact all-reduces sum rank + 1 (the result is known, #wrong is checked); compressors get
        # gradient-like values (seeded normal): constant values would be a degenerate input for
        # top-k's selection (every magnitude tied).
        inputs = {impl: torch.full((count,), float(rank + 1)) for impl in [*IMPLS, *forced, *rs_impls]}
        chunk = count // world
        rs_out = torch.empty(chunk)
        noise = torch.randn(count, generator=torch.Generator().manual_seed(rank))
        inputs.update({impl: noise for impl in settings["compressors"]})
        expected = world * (world + 1) / 2
        compressors = {
            name: getattr(comm, COMPRESSORS[name][0])(**COMPRESSORS[name][1])
            for name in settings["compressors"]
        }

        def call(impl: str, t: torch.Tensor, compressors=compressors, nbytes=nbytes, rs_out=rs_out,
                 chunk=chunk) -> None:
            if impl in exact:
                exact[impl].all_reduce(t)
            elif impl == "gloo":
                dist.all_reduce(t)
            elif impl == "braid-rs":
                c.reduce_scatter(rs_out, t[: chunk * world])
            elif impl == "gloo-rs":
                _reduce_scatter_single(rs_out, t[: chunk * world])
            else:
                c.all_reduce(t, compression=compressors[impl], key=nbytes)

        # Warm-up (compressors: past their exact steps) and the iteration count of a batch.
        iters = {}
        for impl in impls:
            t = inputs[impl].clone()
            for _ in range(3):
                call(impl, t)
            c.barrier()
            t0 = time.perf_counter()
            call(impl, t)
            one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(one, op=dist.ReduceOp.MAX)
            iters[impl] = max(2, min(settings["max_iters"], math.ceil(MIN_BATCH_S / max(one.item(), 1e-6))))
        best = {}
        for round_index in range(settings["rounds"]):
            for impl in order_of_round(impls, round_index):
                x = inputs[impl]
                t = x.clone()
                wrong = 0
                c.barrier()
                tx0, t0 = tx_bytes(), time.perf_counter()
                for _ in range(iters[impl]):
                    t.copy_(x)
                    call(impl, t)
                elapsed = time.perf_counter() - t0
                tx = tx_bytes() - tx0
                if impl == "gloo" or impl in exact:
                    wrong = int((t != expected).sum())
                elif impl in rs_impls:
                    wrong = int((rs_out != expected).sum())
                stats = torch.tensor([elapsed, tx if reports_link else 0, wrong], dtype=torch.float64)
                gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
                dist.all_gather(gathered, stats)
                total = max(g[0].item() for g in gathered)
                link = max(g[1].item() for g in gathered)  # the busiest host's uplink
                if impl not in best or total < best[impl]["total"]:
                    best[impl] = {
                        "total": total,
                        "link_bytes": link,
                        "wrong": int(sum(g[2].item() for g in gathered)),
                    }
        for impl in impls:
            b = best[impl]
            sec = b["total"] / iters[impl]
            algbw = nbytes / sec / 1e9
            record = {
                "impl": impl,
                "bytes": nbytes,
                "count": count,
                "hosts": settings.get("hosts", 2),
                "op": "reduce_scatter" if impl in rs_impls else "all_reduce",
                "algorithm": exact[impl].all_reduce_algorithm(nbytes) if impl in exact else None,
                "per_host": per_host,
                "link_mbit": settings["link_mbit"],
                "time_us": sec * 1e6,
                "algbw": algbw,
                "busbw": algbw * (1 if impl in rs_impls else 2) * (world - 1) / world,
                "wrong": b["wrong"] if impl in ("gloo", *exact, *rs_impls) else None,
                "link_bytes_per_call": b["link_bytes"] / iters[impl],
                "iters": iters[impl],
            }
            rate = settings["link_mbit"] * 1e6 / 8
            record["link_use"] = (b["link_bytes"] / b["total"] / rate) if rate else None
            records.append(record)
        if rank == 0:
            print(f"PROGRESS {human_bytes(nbytes)} done", flush=True)
    held = torch.tensor([c.connections()["sockets"], gloo_sockets, braid_setup, gloo_setup],
                        dtype=torch.float64)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    setup = {"hosts": settings.get("hosts", 2), "per_host": per_host, "link_mbit": settings["link_mbit"],
             "braid_sockets": int(held[0]), "gloo_sockets": int(held[1]), "braid_setup_s": held[2].item(),
             "gloo_setup_s": held[3].item()}
    for other in forced.values():
        other.close()
    c.close()
    dist.destroy_process_group()
    if rank == 0:
        print("RECORDS " + json.dumps(records), flush=True)
        print("SETUP " + json.dumps(setup), flush=True)
    return 0


def _line_up(store, world: int, name: str) -> None:
    """Returns once all ``world`` ranks have called it with ``name``: a barrier on the store, the
    starting line of a timed setup (the last rank to arrive opens it; the store tells the others)."""
    if store.add(f"line/{name}", 1) == world:
        store.set(f"line/{name}/open", "1")
    store.wait([f"line/{name}/open"])


def _sockets() -> int:
    """Socket descriptors this process holds."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


# ----------------------------------------------------------------------------------------------
# The plain-TCP floor: what `streams` TCP connections carry from host 1 to host 0.

_FLOOR_SERVER = """
import socket, sys, threading
n, total = int(sys.argv[1]), int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 29518)); srv.listen(64); print("ready", flush=True)
def drain(c):
    left = total // n
    while left > 0:
        got = c.recv(min(left, 1 << 20))
        if not got: break
        left -= len(got)
    c.sendall(b"k"); c.close()
ts = [threading.Thread(target=drain, args=(srv.accept()[0],)) for _ in range(n)]
[t.start() for t in ts]; [t.join() for t in ts]
"""
_FLOOR_CLIENT = """
import socket, sys, threading, time
host, n, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = bytes(1 << 20)
socks = [socket.create_connection((host, 29518)) for _ in range(n)]
def pump(s):
    left = total // n
    while left > 0:
        k = min(left, len(buf)); s.sendall(buf[:k]); left -= k
    s.recv(1)
t0 = time.perf_counter()
ts = [threading.Thread(target=pump, args=(s,)) for s in socks]
[t.start() for t in ts]; [t.join() for t in ts]
print(total / (time.perf_counter() - t0))
"""


def tcp_floor(hosts: SimulatedHosts, streams: int, total: int) -> float:
    """Bytes per second that ``streams`` plain TCP connections carry from host 1 to host 0."""
    server = hosts.popen(
        0, [sys.executable, "-c", _FLOOR_SERVER, str(streams), str(total)], stdout=subprocess.PIPE, text=True
    )
    server.stdout.readline()
    out = hosts.run(
        1, [sys.executable, "-c", _FLOOR_CLIENT, hosts.addresses[0], str(streams), str(total)], timeout=300
    )
    server.wait(timeout=60)
    return float(out.stdout.strip())


# ----------------------------------------------------------------------------------------------
# The launcher.


def run_config(hosts: SimulatedHosts, per_host: int, link: int, args, algos: Sequence[str] = ()) -> tuple:
    """The collectives on ``hosts`` x ``per_host`` ranks (``algos``: braid's all_reduce algorithms
    also timed forced); returns (records, setup)."""
    n_hosts = len(hosts.addresses)
    world = n_hosts * per_host
    procs = []
    for rank in range(world):
        settings = {
            "rank": rank,
            "world": world,
            "hosts": n_hosts,
            "algos": list(algos),
            "per_host": per_host,
            "master": hosts.addresses[0],
            "sizes": args.sizes,
            "max_iters": args.iters,
            "rounds": args.rounds,
            "link_mbit": link,
            "compressors": args.compressors,
            "reduce_scatter": "reduce_scatter" in getattr(args, "scale_ops", ()),
            "timeout": args.timeout,
        }
        procs.append(
            hosts.popen(
                rank // per_host,
                [sys.executable, "-m", "braid.bench.multihost", "--rank-main", json.dumps(settings)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    records = setup = None
    deadline = time.monotonic() + args.deadline
    for line in procs[0].stdout:
        if line.startswith("PROGRESS "):
            print(f"  {line[len('PROGRESS ') :].strip()}", flush=True)
        elif line.startswith("RECORDS "):
            records = json.loads(line[len("RECORDS ") :])
        elif line.startswith("SETUP "):
            setup = json.loads(line[len("SETUP ") :])
        if time.monotonic() > deadline:
            break
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"rank {rank} exited {p.returncode}:\n{err[-3000:]}")
    if records is None:
        raise RuntimeError("rank 0 reported no results")
    return records, setup


DDP_MODES = "compute,gloo,braid,bf16,int8,int4,topk,auto"
# The fixed choices "auto" is measured against (braid's hook over its communicator); top-k is outside
# its default error budget, so it is not among them.
FIXED_DDP_MODES = ("braid", "bf16", "int8", "int4")


def run_ddp(hosts: SimulatedHosts, per_host: int, link: int, args) -> list[dict]:
    """The DDP benchmark (``python -m braid.bench ddp``, ~25M-parameter LM) with its ranks on the
    simulated hosts, started as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    world = 2 * per_host
    with tempfile.TemporaryDirectory(prefix="braid-multihost-ddp-") as tmp:
        return _ddp_rows(hosts, per_host, link, args, world, os.path.join(tmp, "ddp.json"))


def _ddp_rows(hosts: SimulatedHosts, per_host: int, link: int, args, world: int, out: str) -> list[dict]:
    argv = ["ddp", "--modes", args.ddp_modes, "--steps", str(args.ddp_steps), "--warmup", "3",
            "--shapes", args.ddp_shapes, "--timeout", str(args.timeout), "--json", out]
    if link and "compute" in args.ddp_modes.split(","):
        argv += ["--link-mbit", str(link)]  # the row 'floor': what no exchange can beat on this link
    run_bench_ranks(hosts, per_host, argv, STORE_PORT + 2, args.deadline, "DDP")
    with open(out) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        r.update(link_mbit=link, per_host=per_host, hosts=2)
    return rows


def run_bench_ranks(hosts: SimulatedHosts, per_host: int, argv: list, port: int, deadline: float,
                    what: str, ok: tuple = (0,)) -> None:
    """``python -m braid.bench ARGV`` with 2 x ``per_host`` ranks on the simulated hosts, started
    as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...); prints rank 0's output
    (progress lines left out) and raises if a rank misses ``deadline`` or exits with a status not
    in ``ok``."""
    world = 2 * per_host
    procs = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_host),
               "LOCAL_WORLD_SIZE": str(per_host), "MASTER_ADDR": hosts.addresses[0], "MASTER_PORT": str(port)}
        procs.append(hosts.popen(rank // per_host, [sys.executable, "-m", "braid.bench", *argv], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for rank, p in enumerate(procs):
        try:
            stdout, err = p.communicate(timeout=deadline)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{what} rank {rank} did not finish within {deadline} s") from None
        if p.returncode not in ok:
            raise RuntimeError(f"{what} rank {rank} exited {p.returncode}:\n{err[-3000:]}")
        if rank == 0:
            print("\n".join("  " + line for line in stdout.splitlines() if not line.startswith("[")),
                  flush=True)


SHARDING_IMPLS = ("fsdp2-gloo,braid-zero3,braid-zero3-int8-weights,braid-zero3-int4-grads,"
                  "braid-zero3-int8-weights-int4-grads,braid-zero3-hpz,braid-zero3-int8-weights-int4-grads-hpz")


def run_sharding(hosts: SimulatedHosts, per_host: int, link: int, args) -> list[dict]:
    """The sharding benchmark (``python -m braid.bench sharding``) with its ranks on the simulated
    hosts, started as torchrun would."""
    with tempfile.TemporaryDirectory(prefix="braid-multihost-sharding-") as tmp:
        out = os.path.join(tmp, "sharding.json")
        argv = ["sharding", "--impls", args.sharding_impls, "--model", args.sharding_model, "--rounds", "3",
                "--timeout", str(args.timeout), "--json", out, "--uplink", INTERFACE]
        if link:
            argv += ["--link-mbit", str(link)]
        # 3: the run finished with findings (a loss off), which its table shows.
        run_bench_ranks(hosts, per_host, argv, STORE_PORT + 3, args.deadline, "sharding", ok=(0, 3))
        with open(out) as f:
            rows = json.load(f)["records"]
    for r in rows:
        r.update(link_mbit=link, per_host=per_host, hosts=2)
    return rows


def link_name(link: int) -> str:
    return "unshaped" if link == 0 else (f"{link // 1000} Gbit" if link % 1000 == 0 else f"{link} Mbit")


def table(records: Sequence[dict], floor: dict) -> str:
    by = {}
    for r in records:
        by.setdefault((r["link_mbit"], r["per_host"], r["bytes"]), {})[r["impl"]] = r
    impls = []
    for r in records:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    head = (
        f"{'link':>9} {'layout':>6} {'size':>7} "
        + " ".join(f"{i + ' us':>12}" for i in impls)
        + f" {'braid busbw':>11} {'braid link':>10} {'gloo link':>9} "
        + " ".join(f"{'gloo/' + i:>11}" for i in impls if i != "gloo")
        + f" {'#wrong':>6}"
    )
    lines = [head]
    for (link, per, nbytes), row in sorted(by.items()):

        def use(impl, row=row):
            v = row.get(impl, {}).get("link_use")
            return "-" if v is None else f"{100 * v:.0f}%"

        gloo = row["gloo"]["time_us"]
        lines.append(
            f"{link_name(link):>9} {'2x' + str(per):>6} {human_bytes(nbytes):>7} "
            + " ".join(f"{row[i]['time_us']:>12.1f}" for i in impls)
            + f" {row['braid']['busbw']:>11.3f} {use('braid'):>10} {use('gloo'):>9} "
            + " ".join(f"{gloo / row[i]['time_us']:>10.2f}x" for i in impls if i != "gloo")
            + f" {row['braid']['wrong'] + row['gloo']['wrong']:>6}"
        )
    if floor:
        lines.append("")
        lines.append("plain TCP between the two hosts (the floor braid's link use is measured against):")
        for link, (one, four) in sorted(floor.items()):
            lines.append(
                f"  {link_name(link):>9}: 1 stream {one / 1e9:.3f} GB/s, 4 streams {four / 1e9:.3f} GB/s"
            )
    return "\n".join(lines)


def plot(path: str, records: Sequence[dict]) -> None:
    """PNG: time per all_reduce against size, one panel per link and layout, one line per
    implementation (the compressed ones against gloo's exact time, as in the table)."""
    configs = sorted({(r["link_mbit"], r["per_host"]) for r in records}, key=lambda c: (c[0] == 0, c))
    fig, axes = panel_grid(len(configs), 2, (6.4, 4.4))
    for (link, per), ax in zip(configs, axes):
        rows = [r for r in records if (r["link_mbit"], r["per_host"]) == (link, per)]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["bytes"])
            ax.plot(
                [r["bytes"] for r in mine],
                [r["time_us"] / 1e3 for r in mine],
                marker="o",
                markersize=4,
                label=impl,
            )
        sizes = sorted({r["bytes"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [human_bytes(x).replace(" ", "") for x in sizes], rotation=45, fontsize=8)
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(f"{link_name(link)} link, 2 hosts x {per}")
        ax.set_xlabel("all_reduce size (bytes)")
        ax.set_ylabel("time per call (ms)")
        ax.legend(fontsize=8)
    save_panels(fig, axes, path, "braid vs gloo all_reduce between two simulated hosts (lower is better)")


SCALE_ALGOS = "oneshot,doubling,leaders,ring"


def scale_table(records: Sequence[dict], setups: Sequence[dict]) -> str:
    """Many hosts: setup and sockets per rank, then each size's times beside gloo's and the ring
    optimum over the link's rate (all_reduce 2 (H - 1) / H x S, reduce_scatter (H - 1) / H x S)."""
    lines = ["Many hosts (setup: the group built and its first 4-byte all_reduce, slowest rank; sockets: "
             "the most a rank holds at the end):",
             f"{'hosts':>9} {'link':>9} {'braid setup':>12} {'sockets':>8} {'gloo setup':>11} {'sockets':>8}"]
    for u in setups:
        lines.append(f"{str(u['hosts']) + 'x' + str(u['per_host']):>9} {link_name(u['link_mbit']):>9} "
                     f"{u['braid_setup_s']:>11.3f}s {u['braid_sockets']:>8} {u['gloo_setup_s']:>10.3f}s "
                     f"{u['gloo_sockets']:>8}")
    lines.append(f"{'hosts':>9} {'link':>9} {'size':>8} {'impl':<18} {'algorithm':<13} {'ms':>9} "
                 f"{'vs gloo':>8} {'vs ring opt':>11}")
    gloo = {(r["hosts"], r["per_host"], r["link_mbit"], r["bytes"], r.get("op")): r["time_us"]
            for r in records if r["impl"] in ("gloo", "gloo-rs")}
    for r in records:
        key = (r["hosts"], r["per_host"], r["link_mbit"], r["bytes"], r.get("op"))
        h = r["hosts"]
        # The ring's bytes through each uplink: 2 (H - 1) / H of the message for all_reduce,
        # half that for reduce_scatter.
        factor = (1 if r.get("op") == "reduce_scatter" else 2) * (h - 1) / h
        optimum = factor * r["bytes"] / (r["link_mbit"] * 1e6 / 8) if r["link_mbit"] else None
        vs_opt = f"{r['time_us'] / 1e6 / optimum:.2f}x" if optimum and r["bytes"] >= 1 << 20 else "-"
        lines.append(f"{str(h) + 'x' + str(r['per_host']):>9} {link_name(r['link_mbit']):>9} "
                     f"{human_bytes(r['bytes']):>8} {r['impl']:<18} "
                     f"{r.get('algorithm') or '-':<13} {r['time_us'] / 1e3:>9.2f} "
                     f"{r['time_us'] / gloo[key]:>7.2f}x {vs_opt:>11}")
    return "\n".join(lines)


def run_scale(args) -> tuple:
    """Every --hosts x --ranks-per-host layout on every --scale-link: (records, setups). Each
    record and setup carries the link's rate in bytes/s for the cost model: the shaper's, or on an
    unshaped link what one TCP stream carries between two of the hosts, measured after the
    collectives (nothing else running on the bridge)."""
    records, setups = [], []
    for link in args.scale_link:
        for n_hosts in args.hosts:
            for per in args.ranks_per_host:
                print(f"{n_hosts} hosts x {per} rank(s), {link_name(link)} links:", flush=True)
                with SimulatedHosts(n_hosts, rate_mbit=link or None) as hosts:
                    got, setup = run_config(hosts, per, link, args, args.algos)
                    rate = link * 1e6 / 8 if link or n_hosts < 2 else tcp_floor(hosts, 1, 256 << 20)
                if not link and rate:
                    print(f"  one TCP stream between two of the hosts: {rate / 1e9:.3f} GB/s", flush=True)
                for r in (*got, setup):
                    r["rate_bytes_s"] = rate
                records += got
                setups.append(setup)
    return records, setups


def cost_model_text(records: Sequence[dict]) -> str:
    """The cost model fitted to every record, and, with several link settings, fitted on some and
    scored on the others."""
    links = dict.fromkeys(r["link_mbit"] for r in records)
    groups = {link_name(link): costmodel.points_of([r for r in records if r["link_mbit"] == link])
              for link in links}
    return costmodel.report(records) + "\n\n" + costmodel.scored_report(groups)


def read_scale_json(path: str) -> dict:
    """The JSON an earlier ``--hosts ... --json`` run wrote; ValueError saying why not."""
    try:
        with open(path) as f:
            document = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path!r}: {e}") from None
    kind = document.get("benchmark") if isinstance(document, dict) else None
    if kind != "multihost-scale":
        raise ValueError(f"{path!r} is not the --json of a `multihost --hosts` run (benchmark {kind!r})")
    return document


def ddp_table(rows: Sequence[dict]) -> str:
    lines = [f"{'link':>9} {'shape':>7} {'mode':<8} {'step ms':>9} {'vs gloo':>8} {'loss':>9}"]
    gloo = {(r["link_mbit"], r["batch"], r["seq"]): r["step_s"] for r in rows if r["mode"] == "gloo"}
    for r in rows:
        base = gloo.get((r["link_mbit"], r["batch"], r["seq"]))
        vs = f"{r['step_s'] / base:.2f}x" if base else "-"
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        lines.append(
            f"{link_name(r['link_mbit']):>9} {str(r['batch']) + 'x' + str(r['seq']):>7} {r['mode']:<8} "
            f"{r['step_s'] * 1e3:>9.0f} {vs:>8} {loss:>9}"
        )
    lines += _auto_summary(rows)
    return "DDP step of the ~25M-parameter LM (median of the slowest rank):\n" + "\n".join(lines)


def _auto_summary(rows: Sequence[dict]) -> list:
    """Per link and shape: "auto" against the best fixed choice of the same run (target <= 1.05x)
    and against exact (target <= 1.03x), with what it chose. The ratios are paired (bench ddp's
    ``paired_ratios``: auto's step over the other mode's in the same step, the median over steps),
    so the machine's drift during the run does not enter them; the best fixed choice is the one
    auto is slowest against."""
    out = []
    by = {}
    for r in rows:
        by.setdefault((r["link_mbit"], r["batch"], r["seq"]), {})[r["mode"]] = r
    for (link, batch, seq), modes in by.items():
        if "auto" not in modes:
            continue
        times = {m: modes[m]["step_times"] for m in ("auto", *FIXED_DDP_MODES) if m in modes}
        ratios = paired_ratios(times, "auto")
        if not ratios:
            continue
        best = max(ratios, key=ratios.get)
        chose = sorted({c for c, _ in modes["auto"].get("decisions", {}).values()})
        text = (f"auto at {link_name(link)}, {batch}x{seq}: {ratios[best]:.3f}x the best fixed choice "
                f"({best}; target <= 1.05x)")
        if "braid" in ratios:
            text += f", {ratios['braid']:.3f}x exact (target <= 1.03x)"
        out.append(text + f"; chose {', '.join(chose) or '-'} (medians of per-step ratios)")
    return out


def main(argv: Sequence[str] | None = None, prog: str = "python -m braid.bench multihost") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--links",
        type=parse_links,
        default=[1000, 10000, 0],
        help="link rates in Mbit/s, 0 for unshaped (default 1000,10000,0)",
    )
    parser.add_argument("--layouts", type=parse_layouts, default=[1, 2], help="2xL layouts (default 2x1,2x2)")
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="all_reduce sizes in bytes (default 4K,64K,1M,16M,64M; with --hosts 4K,8M)",
    )
    parser.add_argument(
        "--compressors",
        default=None,
        help=f"compressed all-reduces to time ({', '.join(COMPRESSORS)}; empty for none; default "
             f"int8,int4,topk1%, none with --hosts)".replace("%", "%%"),
    )
    parser.add_argument("--iters", type=int, default=50, help="most iterations of a timed batch (default 50)")
    parser.add_argument(
        "--rounds", type=int, default=2,
        help="rounds, the implementations' order rotating every round; the best counts (default 2)"
    )
    parser.add_argument("--quick", action="store_true", help="the short run of `make bench`")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="braid's and gloo's deadline per wait (s)"
    )
    parser.add_argument("--deadline", type=float, default=1800.0, help="deadline of one configuration (s)")
    parser.add_argument(
        "--ddp-links",
        type=parse_links,
        default=[1000],
        help="links on which the DDP step is measured too, 2 hosts x 1 rank (default 1000; empty for none)",
    )
    parser.add_argument("--ddp-modes", default=DDP_MODES, help=f"modes of the DDP step (default {DDP_MODES})")
    parser.add_argument("--ddp-steps", type=int, default=5, help="timed DDP steps per mode (default 5)")
    parser.add_argument(
        "--ddp-shapes",
        default="1x32,4x128",
        help="batch x sequence per rank of the DDP step, one table each (default 1x32,4x128: "
        "what communication costs a step depends on the compute it can hide behind)",
    )
    parser.add_argument(
        "--sharding-links", type=parse_links, default=[],
        help="links on which the sharded training step is measured (default none; e.g. 1000,10000)")
    parser.add_argument("--sharding-layouts", type=parse_layouts, default=[1, 2],
                        help="2xL layouts of the sharded step (default 2x1,2x2)")
    parser.add_argument("--sharding-impls", default=SHARDING_IMPLS,
                        help=f"implementations of the sharded step (default {SHARDING_IMPLS})")
    parser.add_argument("--sharding-model", default="8192x256x4x1024x4",
                        help="VOCABxDIMxHEADSxHIDDENxLAYERS of the sharded step (default 8192x256x4x1024x4, "
                             "6M parameters)")
    parser.add_argument("--hosts", type=parse_host_counts, default=[],
                        help="many hosts: numbers of hosts to measure (e.g. 4,8,16; default none), each "
                             "with --ranks-per-host ranks, on --scale-link links, at --sizes (default then "
                             "4K,8M)")
    parser.add_argument("--ranks-per-host", type=parse_host_counts, default=[1],
                        help="ranks on each of --hosts (default 1)")
    parser.add_argument("--scale-link", type=parse_links, default=[100],
                        help="Mbit/s of each host's uplink with --hosts, several to measure each and score "
                             "the cost model fitted on one on the others (default 100; 0: unshaped; "
                             "e.g. 100,1000,0)")
    parser.add_argument("--scale-ops", type=lambda t: [x for x in t.split(",") if x], default=["all_reduce"],
                        help="with --hosts, collectives timed: all_reduce and/or reduce_scatter "
                             "(braid's and gloo's; default all_reduce)")
    parser.add_argument("--algos", default=SCALE_ALGOS,
                        help=f"with --hosts, braid's all_reduce algorithms timed forced beside its own "
                             f"choice (default {SCALE_ALGOS})")
    parser.add_argument("--from-json", metavar="PATH",
                        help="measure nothing: print the many-hosts tables and the cost model (fitted, and "
                             "scored across link settings) of the --json an earlier --hosts run wrote")
    parser.add_argument("--json", type=output_path(), help="write the records as JSON to this path")
    parser.add_argument(
        "--plot", type=output_path(".png"), help="write a PNG of time against size to this path"
    )
    parser.add_argument("--rank-main", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main is None and not set(args.scale_ops) <= {"all_reduce", "reduce_scatter"}:
        parser.error(f"--scale-ops takes all_reduce and/or reduce_scatter, got {','.join(args.scale_ops)!r}")
    if args.rank_main:
        return rank_main(json.loads(args.rank_main))
    if args.from_json is not None:
        try:
            earlier = read_scale_json(args.from_json)
        except ValueError as e:
            parser.error(f"--from-json: {e}")
        print(scale_table(earlier["records"], earlier["setup"]))
        print()
        print(cost_model_text(earlier["records"]))
        return 0
    if args.compressors is None:
        args.compressors = "" if args.hosts else "int8,int4,topk1%"
    args.compressors = [c for c in args.compressors.split(",") if c]
    for name in args.compressors:
        if name not in COMPRESSORS:
            parser.error(f"--compressors: unknown {name!r} (choose from {', '.join(COMPRESSORS)})")
    if args.iters < 2 or args.rounds < 1:
        parser.error("--iters must be >= 2 and --rounds >= 1")
    args.algos = [a for a in args.algos.split(",") if a]
    for name in args.algos:
        if name not in ("oneshot", "doubling", "leaders", "hierarchical", "ring"):
            parser.error(f"--algos: unknown {name!r} (oneshot, doubling, leaders, hierarchical, ring)")
    if args.hosts and not args.scale_link:
        parser.error("--scale-link: none given (Mbit/s, 0: unshaped)")
    if len(set(args.scale_link)) < len(args.scale_link):
        parser.error(f"--scale-link: a setting given twice in {','.join(map(str, args.scale_link))}")
    if args.sizes is None:
        args.sizes = list(SCALE_SIZES if args.hosts else DEFAULT_SIZES)
    if args.quick:
        args.sizes, args.links, args.layouts, args.iters, args.ddp_steps = (
            list(QUICK_SIZES),
            [1000, 0],
            [1, 2],
            10,
            3,
        )
    reason = unavailable_reason(rate=True)
    if reason is not None:
        print(f"multihost: simulated hosts cannot be made here ({reason}); nothing measured")
        return 0
    if args.hosts:
        records, setups = run_scale(args)
        print()
        print(scale_table(records, setups))
        print()
        print(cost_model_text(records))
        if args.json:
            write_json(args.json, {"benchmark": "multihost-scale", "machine": machine_info(),
                                   "records": records, "setup": setups})
        return 1 if sum((r["wrong"] or 0) for r in records) else 0
    records, floor = [], {}
    configs = [(link, per) for link in args.links for per in args.layouts]
    for i, (link, per) in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] {link_name(link)} link, 2 hosts x {per} rank(s):", flush=True)
        with SimulatedHosts(2, rate_mbit=link or None) as hosts:
            if link not in floor:
                total = 256 << 20 if link in (0, 10000) else 64 << 20
                floor[link] = (tcp_floor(hosts, 1, total), tcp_floor(hosts, 4, total))
            records += run_config(hosts, per, link, args)[0]
    ddp_rows = []
    for link in args.ddp_links:
        print(f"DDP step, {link_name(link)} link, 2 hosts x 1 rank:", flush=True)
        with SimulatedHosts(2, rate_mbit=link or None) as hosts:
            ddp_rows += run_ddp(hosts, 1, link, args)
    sharding_rows = []
    for link in args.sharding_links:
        for per in args.sharding_layouts:
            print(f"Sharded step, {link_name(link)} link, 2 hosts x {per} rank(s):", flush=True)
            with SimulatedHosts(2, rate_mbit=link or None) as hosts:
                sharding_rows += run_sharding(hosts, per, link, args)
    if records:
        print()
        print(table(records, floor))
    if ddp_rows:
        print()
        print(ddp_table(ddp_rows))
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "multihost",
                "machine": machine_info(),
                "records": records,
                "tcp_floor": {str(k): {"1": v[0], "4": v[1]} for k, v in floor.items()},
                "ddp": ddp_rows,
                "sharding": sharding_rows,
            },
        )
    if args.plot and records:
        plot(args.plot, records)
    wrong = sum((r["wrong"] or 0) for r in records)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
