"""What the model benchmarks share: run options, carriers, a rank's session, timing in turns, uplink bytes.

Implementations take turns (so a slow phase of the machine hits them alike): per round, for each
implementation a gloo barrier, then ``steps`` calls of it timed together; a round's time per call
is the slowest rank's, the result the median over rounds. The order rotates by one place every
round (:func:`order_of_round`): the DDP benchmark measured the mode that ran last in a step a few
percent slower than the same exchange run earlier, so no implementation keeps one place.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from braid import comm

from . import launch, report
from .simhosts import find_tool, tx_bytes


@dataclass(frozen=True)
class RunOptions:
    """How a model benchmark runs, from the command line and the launcher."""

    impls: tuple[str, ...]
    warmup: int
    steps: int
    rounds: int
    threads: int
    timeout: float
    deadline: float  # time.time() by which the whole run must be over
    started: float
    launcher: str
    world_size: int
    bind: str
    machine: dict
    json_path: str | None
    carriers: tuple[str, ...] = ("braid", "gloo")


def parse_dims(cls: type, text: str, spelling: str):
    """``cls`` (a dataclass of positive ints) from ``AxBxC...`` in field order; ``spelling`` shows
    the expected form in the error."""
    parts = text.lower().split("x")
    if len(parts) != len(fields(cls)) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected {spelling} (positive integers), got {text!r}")
    return cls(*map(int, parts))


def format_dims(value) -> str:
    return "x".join(str(getattr(value, f.name)) for f in fields(value))


# What moves a benchmark's bytes: braid's Communicator, the run's gloo group, or an NCCL group (CUDA
# tensors, one GPU per rank). Each implementation names its carrier (None: it moves nothing).
CARRIERS = ("braid", "gloo", "nccl")


def add_carrier_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--carrier", default="braid,gloo",
                   help="comma-separated carriers of the implementations to run, from "
                        f"{','.join(CARRIERS)} (default braid,gloo); nccl runs every implementation on "
                        "CUDA tensors, one GPU per rank")


def with_carriers(parser: argparse.ArgumentParser, args: argparse.Namespace, run: "RunOptions",
                  carrier_of: Mapping[str, str | None]) -> "RunOptions":
    """``run`` keeping the implementations whose carrier ``--carrier`` names (and those that move
    nothing); errors through ``parser``."""
    chosen = tuple(dict.fromkeys(c.strip() for c in args.carrier.split(",") if c.strip()))
    unknown = [c for c in chosen if c not in CARRIERS]
    if unknown or not chosen:
        parser.error(f"--carrier: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(CARRIERS)}")
    if "nccl" in chosen:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < run.world_size and run.launcher != "torchrun":
            parser.error(f"--carrier nccl needs one CUDA device per rank: {run.world_size} ranks, "
                         f"{gpus} GPUs here")
    impls = tuple(i for i in run.impls if carrier_of[i] is None or carrier_of[i] in chosen)
    if not any(carrier_of[i] is not None for i in impls):
        parser.error(f"--impls and --carrier leave nothing that communicates (carriers {', '.join(chosen)})")
    return replace(run, impls=impls, carriers=chosen)


def device_of(run: "RunOptions", rank: int) -> torch.device:
    """Where a rank's tensors live: its GPU when the run has the nccl carrier, else the CPU."""
    if "nccl" not in run.carriers:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def nccl_group(run: "RunOptions"):
    """An NCCL process group over every rank, when the run has the nccl carrier (else None). A
    collective: every rank calls it at the same point."""
    return dist.new_group(backend="nccl") if "nccl" in run.carriers else None


def synchronized(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``step`` followed by a wait for the device (a timed CUDA step must include its kernels)."""
    if device.type != "cuda":
        return step

    def run_and_wait():
        out = step()
        torch.cuda.synchronize(device)
        return out
    return run_and_wait


def add_run_arguments(p: argparse.ArgumentParser, impls: Sequence[str], *, warmup: int, steps: int,
                      rounds: int, timeout: float, deadline: float, nproc_help: str) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help=f"{nproc_help} (default 2); ignored under torchrun")
    p.add_argument("--impls", default=",".join(impls),
                   help=f"comma-separated, from {','.join(impls)} (default: all)")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps per impl (default {warmup})")
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps per round (default {steps})")
    p.add_argument("--rounds", type=int, default=rounds,
                   help=f"rounds; the median is reported (default {rounds})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (default 1: with 2 ranks on 2 cores, one core each)")
    p.add_argument("--timeout", type=float, default=timeout,
                   help=f"seconds any wait may take (default {timeout:g})")
    p.add_argument("--deadline", type=float, default=deadline,
                   help=f"seconds the whole run may take (default {deadline:g})")
    p.add_argument("--bind", choices=("auto", "core", "none"), default="auto",
                   help="rank placement, as for the collectives benchmark (default auto)")
    p.add_argument("--json", metavar="PATH", type=report.output_path(), help="write the records as JSON")


def run_options(parser: argparse.ArgumentParser, args: argparse.Namespace, impls: Sequence[str],
                started: float) -> RunOptions:
    """Checks the options of :func:`add_run_arguments` (errors through ``parser``)."""
    chosen = tuple(dict.fromkeys(i.strip() for i in args.impls.split(",") if i.strip()))
    unknown = [i for i in chosen if i not in impls]
    if unknown or not chosen:
        parser.error(f"--impls: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(impls)}")
    for name in ("warmup", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if not args.timeout > 0 or not args.deadline > 0:
        parser.error("--timeout and --deadline must be positive")
    launcher = launch.launcher()
    world_size = int(os.environ["WORLD_SIZE"]) if launcher == "torchrun" else (args.nproc or 2)
    return RunOptions(chosen, args.warmup, args.steps, args.rounds, args.threads, args.timeout,
                      started + args.deadline, started, launcher, world_size,
                      launch.resolve_bind(args.bind, world_size), report.machine_info(), args.json)


def start(rank_fn: Callable[..., int], config, run: RunOptions, name: str) -> int:
    """Runs ``rank_fn(rank, world_size, store_port, config)`` here (torchrun) or on spawned ranks."""
    if run.launcher == "torchrun":
        return launch.run_rank_reporting(rank_fn, int(os.environ["RANK"]), run.world_size, None, config)
    print(f"# braid.bench {name}: {run.world_size} ranks ({run.launcher}), {run.threads} torch thread(s) "
          f"per rank, impls {' '.join(run.impls)}", flush=True)
    return launch.spawn(rank_fn, run.world_size, run.timeout, run.deadline, config)


@contextmanager
def rank_session(rank: int, world_size: int, store_port: int | None, run: RunOptions) -> Iterator:
    """Placement and threads of this rank, the run's gloo group and a braid communicator on it.
    ``run`` needs only ``bind``, ``threads`` and ``timeout`` (the DDP benchmark passes its
    argparse namespace)."""
    launch.start_rank(rank, world_size, store_port, bind=run.bind, threads=run.threads, timeout_s=run.timeout)
    try:
        c = comm.init(timeout=run.timeout)
        yield c
        c.close()
        launch.end_gloo_use()
    finally:
        dist.destroy_process_group()


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise maximum over the ranks (through gloo, outside any timed region)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def order_of_round(impls: Sequence[str], round_index: int) -> list[str]:
    """The order in which ``impls`` run in round ``round_index``: rotated by one place per round, so
    over ``len(impls)`` rounds each runs once in every place (two alternate)."""
    turn = round_index % len(impls) if impls else 0
    return [*impls[turn:], *impls[:turn]]


def time_in_turns(steps: Mapping[str, Callable[[], object]], run: RunOptions, progress: report.Progress,
                  nbytes: int) -> dict[str, float]:
    """Seconds per call of each ``steps[impl]``: the median over rounds of the slowest rank. Each
    round runs the implementations in :func:`order_of_round`'s order, each after a barrier."""
    per_step: dict[str, list[float]] = {impl: [] for impl in steps}
    for round_index in range(run.rounds):
        for impl in order_of_round(list(steps), round_index):
            step = steps[impl]
            progress(impl, "step", nbytes)
            dist.barrier()
            begin = time.perf_counter()
            for _ in range(run.steps):
                step()
            per_step[impl].append((time.perf_counter() - begin) / run.steps)
    return {impl: statistics.median(max_over_ranks(times)) for impl, times in per_step.items()}


@dataclass(frozen=True)
class LinkShape:
    """What bounds the bytes a host's uplink passes: its rate, and the bucket of a token-bucket
    shaper (bytes it passes at once after an idle spell; 0 for a plain link). In any span of T
    seconds the link passes at most ``bucket + bytes_per_s * T`` bytes."""

    bytes_per_s: float
    bucket: int

    @classmethod
    def of(cls, interface: str, mbit: float) -> "LinkShape":
        """The shaping of ``interface`` in this network namespace: the rate and bucket of its root
        tbf qdisc where it has one (simulated hosts shape their uplinks so; the bucket holds 4 ms
        of traffic there, 0.5 MB at 1 Gbit), else ``mbit`` with no bucket (a physical link)."""
        tc = find_tool("tc")
        if tc is not None:
            shown = subprocess.run([tc, "-j", "qdisc", "show", "dev", interface], capture_output=True,
                                   text=True, timeout=30)
            if shown.returncode != 0:
                raise RuntimeError(f"--uplink {interface}: tc cannot show its qdisc: {shown.stderr.strip()}")
            for qdisc in json.loads(shown.stdout or "[]"):
                if qdisc.get("kind") == "tbf" and qdisc.get("root"):
                    options = qdisc["options"]
                    return cls(float(options["rate"]), int(options["burst"]))
        return cls(mbit * 1e6 / 8, 0)

    def floor_s(self, nbytes: float) -> float:
        """The least seconds in which the link passes ``nbytes``: the bucket at once, the rest at
        the rate."""
        return max(0.0, nbytes - self.bucket) / self.bytes_per_s


class UplinkCounter:
    """Bytes that leave this host through ``interface`` during each of an implementation's timed
    steps, read by one rank per host (``reads``) around every step: the host's ranks step
    together, so the host's traffic of a round lies between the first and last reads, inside the
    reading rank's timed round. With ``link_mbit`` the reading rank also knows the link's
    :class:`LinkShape`, which turns a round's bytes into the least time the round can take."""

    def __init__(self, interface: str | None, reads: bool, link_mbit: float = 0):
        self.interface = interface if reads else None
        self.link_mbit = link_mbit
        self.shape = LinkShape.of(interface, link_mbit) if self.interface and link_mbit else None
        self.sent: dict[str, list[int]] = {}

    def wrap(self, impl: str, step: Callable[[], object]) -> Callable[[], object]:
        """``step``, counting what the host sends during each call (as is where this rank does not
        read)."""
        if self.interface is None:
            return step
        sent = self.sent.setdefault(impl, [])

        def counted():
            before = tx_bytes(self.interface)
            out = step()
            sent.append(tx_bytes(self.interface) - before)
            return out
        return counted

    def busiest(self, impls: Sequence[str], rounds: int, steps: int) -> tuple[dict, dict]:
        """Over every host (a collective: every rank passes the same arguments): each
        implementation's uplink bytes per step, the mean over its timed steps, and the floor of its
        step time, None without ``link_mbit``.

        The floor: per round, the busiest host's bytes less the bucket at the link's rate, over
        ``steps``; the median over ``rounds``. Every rank's round time bounds the reading rank's,
        which bounds the time its host's link needed for those bytes, so each round's time per step
        (slowest rank) is at least that round's floor, and :func:`time_in_turns`'s median at least
        the median floor."""
        mean, floors = [], []
        for impl in impls:
            sent = self.sent.get(impl, [])
            mean.append(sum(sent) / len(sent) if sent else 0.0)
            per_round = [sum(sent[r * steps:(r + 1) * steps]) for r in range(rounds)]
            floors += [self.shape.floor_s(b) / steps if self.shape else 0.0 for b in per_round]
        mean = max_over_ranks(mean)
        per_step = dict(zip(impls, mean))
        if not self.link_mbit:
            return per_step, dict.fromkeys(impls)
        floors = max_over_ranks(floors)
        return per_step, {impl: statistics.median(floors[i * rounds:(i + 1) * rounds])
                          for i, impl in enumerate(impls)}


def finish(run: RunOptions, benchmark: str, settings: dict, records: list[dict], bad: list[dict],
           bad_text: str) -> int:
    """The end of a benchmark's report: ``bad_text`` when some records failed their check, the
    wall time, the JSON (``write_json``) where asked; returns the exit status (EXIT_FINDINGS when
    ``bad``)."""
    if bad:
        print(bad_text)
    print(f"# wall time {time.time() - run.started:.1f} s", flush=True)
    if run.json_path:
        write_json(run, benchmark, settings, records)
    return launch.EXIT_FINDINGS if bad else 0


def write_json(run: RunOptions, benchmark: str, settings: dict, records: list[dict]) -> None:
    """``{"benchmark", "date", "machine", "config", "records"}`` at ``run.json_path``."""
    config = {"world_size": run.world_size, "launcher": run.launcher, **settings, "impls": list(run.impls),
              "warmup": run.warmup, "steps": run.steps, "rounds": run.rounds, "threads": run.threads,
              "bind": run.bind}
    report.write_json(run.json_path, {
        "benchmark": benchmark, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": dict(run.machine, torch=torch.__version__, loadavg=os.getloadavg()),
        "config": config, "records": records})
