"""Fault-tolerance benchmark: what a lost worker costs with braid.ft against torchrun's elastic
restart from a checkpoint, and what braid.ft's per-step quorum costs when nothing fails.

- **Recovery**: 3 replicas (braid.bench.ft_replica) of a small MLP; replica 1 is SIGKILLed in its
  backward at step ``--die-at`` and restarted at once (as torchrun --max-restarts restarts a
  replica's own job). Reported: seconds from the kill to the survivors' next committed step,
  from the restart to the restarted replica's first committed step, and steps lost (committed
  steps thrown away plus the one in flight).
- **Peer**: the same model, data and optimizer under ``torchrun --max-restarts 1`` with DDP over
  gloo and a checkpoint every ``--checkpoint-every`` steps (braid.bench.ft_baseline): the kill
  makes torchrun restart every worker, which resume from the last checkpoint. Reported: seconds
  from the kill to the first step after the restart, and steps lost.
- **Overhead**: 2 ranks on this host, an MLP of ``--hidden`` x 4 layers; torch DDP with braid's
  hook over a Communicator against braid.ft's DDP and Optimizer (same hook, plus the vote and
  the store's compare-and-set per step), in turns (the order alternating between rounds). The
  ratio of the median step times is braid.ft's overhead; between simulated hosts the step is
  longer and the per-step cost the same, so the one-host ratio bounds it from above.

    python -m braid.bench ft --trials 3 --json ft.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import torch
import torch.distributed as dist

from . import launch
from .report import machine_info


def _records(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _ft_trial(args: argparse.Namespace, workdir: str) -> dict:
    store = os.path.join(workdir, "store")
    common = [
        "--replicas",
        "3",
        "--store",
        store,
        "--out",
        workdir,
        "--steps",
        str(args.steps),
        "--step-sleep",
        str(args.step_sleep),
    ]

    def start(replica: int, die: str = "") -> subprocess.Popen:
        argv = [sys.executable, "-m", "braid.bench.ft_replica", "--replica", str(replica)] + common
        err = open(os.path.join(workdir, f"stderr{replica}.txt"), "a")
        return subprocess.Popen(argv + (["--die", die] if die else []), stdout=err, stderr=err)

    procs = {r: start(r, f"{args.die_at}:backward" if r == 1 else "") for r in range(3)}
    restarted_at = None
    deadline = time.monotonic() + args.deadline
    try:
        while any(p.poll() is None for p in procs.values()) or restarted_at is None:
            if procs[1].poll() is not None and restarted_at is None:
                if procs[1].returncode == 0:
                    raise RuntimeError("replica 1 finished without being killed")
                restarted_at = time.time()
                procs[1] = start(1)
            for r, p in procs.items():
                if p.poll() not in (None, 0, -9):
                    raise RuntimeError(
                        f"replica {r} failed: " + open(os.path.join(workdir, f"stderr{r}.txt")).read()[-2000:]
                    )
            if time.monotonic() > deadline:
                raise RuntimeError("the braid.ft trial did not finish before --deadline")
            time.sleep(0.01)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    logs = {r: _records(os.path.join(workdir, f"replica{r}.jsonl")) for r in range(3)}
    dying = next(rec["dying"] for rec in logs[1] if "dying" in rec)
    survivor_commit = min(rec["time"] for rec in logs[0] if "step" in rec and rec["time"] > dying)
    back = min(rec["time"] for rec in logs[1] if "step" in rec and rec["time"] > restarted_at)
    events = next(rec["events"] for rec in logs[0] if "events" in rec)
    discarded = sum(1 for e in events if e["kind"] == "discard")
    return {
        "kill_to_next_step_s": survivor_commit - dying,
        "restart_to_first_step_s": back - restarted_at,
        "steps_lost": discarded,
        "steps_discarded": discarded,
        "committed_steps_thrown_away": 0,
    }


def _torchrun_trial(args: argparse.Namespace, workdir: str) -> dict:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        "-m",
        "braid.bench.ft_baseline",
        "--out",
        workdir,
        "--steps",
        str(args.steps),
        "--die-at",
        str(args.die_at),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--step-sleep",
        str(args.step_sleep),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.deadline)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}): {done.stderr[-2000:]}")
    logs = {r: _records(os.path.join(workdir, f"rank{r}.jsonl")) for r in range(3)}
    dying = next(rec["dying"] for rec in logs[1] if "dying" in rec)
    after = min(rec["time"] for r in range(3) for rec in logs[r] if "step" in rec and rec["time"] > dying)
    resumed = next(rec["resumed"] for rec in logs[0] if rec.get("restarts") == 1)
    thrown = args.die_at - resumed
    return {
        "kill_to_next_step_s": after - dying,
        "restart_to_first_step_s": after - dying,
        "steps_lost": thrown + 1,
        "steps_discarded": 1,
        "committed_steps_thrown_away": thrown,
    }


# -- overhead --------------------------------------------------------------------------------
def _overhead_rank(rank: int, world: int, store_port: int, args: argparse.Namespace) -> int:
    from braid import comm, ft
    from braid.comm import ddp as braid_ddp
    from braid.ft.ddp import local_group

    torch.set_num_threads(1)
    if store_port is None:  # started as torchrun would (the simulated hosts): rank 0 hosts it
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=rank == 0)
    else:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False)

    def mlp():
        torch.manual_seed(0)
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
        return torch.nn.Sequential(*layers)

    c = comm.Communicator(dist.PrefixStore("plain/", store), rank, world)
    plain_model = mlp()
    plain = torch.nn.parallel.DistributedDataParallel(plain_model, process_group=local_group())
    state, hook = braid_ddp.comm_hook(c)
    plain.register_comm_hook(state, hook)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=1e-3)

    ft_model = mlp()
    opt = torch.optim.SGD(ft_model.parameters(), lr=1e-3)
    manager = ft.Manager(
        lambda: {"m": ft_model.state_dict()},
        lambda s: ft_model.load_state_dict(s["m"]),
        replica_id=rank,
        num_replicas=world,
        store=dist.PrefixStore("ft/", store),
    )
    ft_ddp = ft.DistributedDataParallel(manager, ft_model)
    ft_opt = ft.Optimizer(manager, opt)
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(rank))

    def step_plain():
        plain_opt.zero_grad()
        plain(x).square().mean().backward()
        plain_opt.step()

    def step_ft():
        ft_opt.zero_grad()
        ft_ddp(x).square().mean().backward()
        assert ft_opt.step()

    steps = {"ddp+braid-hook": step_plain, "braid.ft": step_ft}
    for fn in steps.values():
        for _ in range(3):
            fn()
    times = {k: [] for k in steps}
    for round_index in range(args.rounds):
        order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
        for name in order:
            c.barrier()
            start = time.perf_counter()
            for _ in range(args.overhead_steps):
                steps[name]()
            times[name].append((time.perf_counter() - start) / args.overhead_steps)
    t = torch.tensor([statistics.median(times[k]) for k in steps], dtype=torch.float64)
    c.all_reduce(t, op="max")
    if rank == 0:
        with open(args.overhead_out, "w") as f:
            json.dump({"step_s": dict(zip(steps, t.tolist())), "rounds": times}, f)
    manager.shutdown()
    c.close()
    if rank != 0:
        store.set(f"overhead-done/{rank}", "1")
    elif store_port is None:  # this rank hosts the store: the others finish with it first
        store.wait([f"overhead-done/{r}" for r in range(1, world)])
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3, help="kills per implementation (default 3)")
    p.add_argument("--steps", type=int, default=60, help="steps per recovery trial")
    p.add_argument("--die-at", type=int, default=25, help="the step in whose backward the worker is killed")
    p.add_argument("--checkpoint-every", type=int, default=10, help="the torchrun peer's checkpoint interval")
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds of other work per step")
    p.add_argument("--hidden", type=int, default=1024, help="overhead model width")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--overhead-steps", type=int, default=20, help="steps per turn")
    p.add_argument("--rounds", type=int, default=6, help="turns of each implementation")
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        choices=(1, 2),
        help="overhead ranks on this host, or one on each of 2 simulated hosts (root)",
    )
    p.add_argument("--link-mbit", type=float, default=0, help="simulated link shaping (0: none)")
    p.add_argument("--overhead-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip", default="", help="comma list of parts to skip: recovery, torchrun, overhead")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds any part may take")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.trials < 1 or not 0 < args.die_at < args.steps:
        p.error("need --trials >= 1 and 0 < --die-at < --steps")
    skip = {s for s in args.skip.split(",") if s}
    if skip - {"recovery", "torchrun", "overhead"}:
        p.error(f"--skip takes recovery, torchrun, overhead; got {sorted(skip)}")
    results: dict = {"machine": machine_info(), "settings": vars(args).copy()}
    for part, trial in (("recovery", _ft_trial), ("torchrun", _torchrun_trial)):
        if part in skip:
            continue
        runs = []
        for i in range(args.trials):
            with tempfile.TemporaryDirectory(prefix=f"braid-ft-{part}-") as d:
                runs.append(trial(args, d))
            print(
                f"{part} trial {i + 1}/{args.trials}: "
                + ", ".join(f"{k} {v:.3g}" for k, v in runs[-1].items()),
                flush=True,
            )
        results[part] = runs
    if launch.launcher() == "torchrun":  # a rank of the overhead part, on a simulated host
        return _overhead_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
    if "overhead" not in skip:
        with tempfile.TemporaryDirectory(prefix="braid-ft-overhead-") as d:
            args.overhead_out = os.path.join(d, "overhead.json")
            if args.hosts == 1:
                status = launch.spawn(_overhead_rank, 2, 60.0, time.time() + args.deadline, args)
                if status != 0:
                    return status
            else:
                status = _overhead_on_simulated_hosts(args)
                if status is not None:
                    return status
            with open(args.overhead_out) as f:
                results["overhead"] = json.load(f)
            results["overhead"].update(hosts=args.hosts, link_mbit=args.link_mbit)
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _overhead_on_simulated_hosts(args: argparse.Namespace):
    """The overhead part with one rank on each of 2 simulated hosts; None when it ran."""
    from .multihost import STORE_PORT, run_bench_ranks
    from .simhosts import SimulatedHosts, unavailable_reason

    why = unavailable_reason(rate=bool(args.link_mbit))
    if why is not None:
        print(f"braid.bench ft: no simulated hosts here ({why})", file=sys.stderr)
        return launch.EXIT_FAILED
    argv = [
        "ft",
        "--skip",
        "recovery,torchrun",
        "--overhead-out",
        args.overhead_out,
        "--hidden",
        str(args.hidden),
        "--batch",
        str(args.batch),
        "--overhead-steps",
        str(args.overhead_steps),
        "--rounds",
        str(args.rounds),
    ]
    with SimulatedHosts(2, rate_mbit=args.link_mbit or None) as hosts:
        run_bench_ranks(hosts, 1, argv, STORE_PORT + 7, args.deadline, "ft overhead")
    return None


def _median(runs: list, key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _print(results: dict) -> None:
    if "recovery" in results or "torchrun" in results:
        print("\n| | braid.ft (survivors go on) | torchrun restart from checkpoint |")
        print("|---|---:|---:|")
        for key, label in (
            ("kill_to_next_step_s", "kill -> next committed step (s)"),
            ("restart_to_first_step_s", "restart -> restarted worker's first step (s)"),
            ("steps_lost", "steps lost (thrown away + in flight)"),
        ):
            cells = [
                f"{_median(results[p], key):.3g}" if p in results else "-" for p in ("recovery", "torchrun")
            ]
            print(f"| {label} | {cells[0]} | {cells[1]} |")
    if "overhead" in results:
        s = results["overhead"]["step_s"]
        ratio = s["braid.ft"] / s["ddp+braid-hook"]
        o = results["overhead"]
        where = "one host"
        if o["hosts"] == 2:
            where = "2 simulated hosts, " + (f"{o['link_mbit']:g} Mbit/s" if o["link_mbit"] else "unshaped")
        print(
            f"\nper-step quorum: braid.ft step {s['braid.ft'] * 1e3:.2f} ms vs DDP with braid's hook "
            f"{s['ddp+braid-hook'] * 1e3:.2f} ms: {100 * (ratio - 1):+.1f}% (2 ranks, {where})"
        )
