"""The flight recorder's cost: a small all_reduce with the recorder on (its default, 2000 calls)
against the same call with recording paused, on the same communicator, taking turns.

    python -m braid.bench recorder                       # 2 ranks, 4 KiB
    python -m braid.bench recorder --sizes 4K,64K --nproc 4 --json results/recorder.json

One braid Communicator over the run's store, its recorder switched between rounds
(``Communicator.trace_enabled``): ``traced`` records every call (a ring-buffer entry written when
the call is issued, started and completed), ``untraced`` keeps none. The two share everything
else (segments, threads, buffers), so the difference is the recorder's alone. Reported:
microseconds per blocking all_reduce of each (the median over rounds, and the best round, of the
slowest rank; the order of the two alternates between rounds), and ``overhead`` = traced /
untraced - 1 of each: on a machine shared with other work the best rounds are the ones it
disturbed least; ``paired``: the median over rounds of each round's traced / untraced (the two ran
back to back, under the same load) - 1. Rounds are short (200 calls, about a millisecond each) and
many (1001): on a shared machine, whose other work comes in bursts of milliseconds, a short pair
mostly runs under one load, and the median of many pairs moves by about 0.1% between runs where
30 long rounds' moved by 1%. The target is an overhead of at most 2% of a 4 KiB
all_reduce (DESIGN section 15). Results are checked (every rank's input is its rank + 1, so every
element of the sum is known).

--json writes {"benchmark": "recorder", "date", "machine", "config", "records": [{"bytes",
"traced_us", "untraced_us", "overhead", "traced_best_us", "untraced_best_us", "overhead_best",
"overhead_paired", "wrong"}]}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import report, turns
from .multihost import parse_sizes

IMPLS = ("traced", "untraced")
DEFAULT_SIZES = (4 << 10,)
TARGET = 0.02  # the recorder may cost at most this share of a 4 KiB all_reduce
BATCH_S = 0.05  # a timed round of one implementation lasts at most about this long
SIZE_BUDGET_S = 5.0  # the rounds of one size last about this long, at least MIN_ROUNDS of them
MIN_ROUNDS = 31
WARMUP_S = 1.0  # each implementation's warm-up lasts at most about this long (at least 3 calls)


@dataclass(frozen=True)
class Config:
    run: turns.RunOptions
    sizes: tuple[int, ...]


def _run_rank(rank: int, world_size: int, store_port: int | None, config: Config) -> int:
    run = config.run
    with turns.rank_session(rank, world_size, store_port, run) as c:
        progress = report.Progress(len(config.sizes) * len(run.impls) * run.rounds, enabled=rank == 0)
        records = []
        expected = world_size * (world_size + 1) / 2
        for nbytes in config.sizes:
            x = torch.full((nbytes // 4,), float(rank + 1))
            bufs = {impl: x.clone() for impl in run.impls}
            wrong = 0

            def step(impl: str, bufs=bufs, x=x) -> None:
                t = bufs[impl]
                t.copy_(x)
                c.all_reduce(t)

            def prepare(impl: str) -> None:
                c.trace_enabled = impl == "traced"

            # Warm-up: run.warmup calls of each, or about WARMUP_S of them for large messages.
            begin = time.perf_counter()
            step(run.impls[0])
            one = turns.max_over_ranks([time.perf_counter() - begin])[0]
            for impl in run.impls:
                prepare(impl)
                for _ in range(min(run.warmup, max(3, int(WARMUP_S / max(one, 1e-7))))):
                    step(impl)
            times, best, rounds = _time_alternating(step, prepare, run, progress, nbytes)
            for impl in run.impls:
                wrong += int((bufs[impl] != expected).sum())
            wrong = int(turns.max_over_ranks([wrong])[0])
            rec = {"bytes": nbytes, "wrong": wrong}
            for impl in run.impls:
                rec[f"{impl}_us"] = times[impl] * 1e6
                rec[f"{impl}_best_us"] = best[impl] * 1e6
            if "traced" in times and "untraced" in times:
                rec["overhead"] = round(times["traced"] / times["untraced"] - 1, 4)
                rec["overhead_best"] = round(best["traced"] / best["untraced"] - 1, 4)
                # Each round's pair ran back to back, under the same load: the median of the
                # pairs' ratios is the figure least moved by other work on the machine.
                rec["overhead_paired"] = round(statistics.median(
                    a / b for a, b in zip(rounds["traced"], rounds["untraced"])) - 1, 4)
            records.append(rec)
        progress.close()
        c.trace_enabled = True
    return _report(config, records) if rank == 0 else 0


def _time_alternating(step, prepare, run: turns.RunOptions, progress: report.Progress, nbytes: int) -> tuple:
    """Seconds per call of each implementation, over ``run.rounds`` rounds of at most ``run.steps``
    calls each (for large messages fewer calls, a round lasting about BATCH_S, and fewer rounds, the
    size's lasting about SIZE_BUDGET_S but at least MIN_ROUNDS), the implementations' order
    reversed every other round (neither always runs first after the barrier); ``prepare(impl)``
    runs before each round, untimed: (median over rounds, best round, every round), each of the
    slowest rank."""
    prepare(run.impls[0])
    begin = time.perf_counter()
    step(run.impls[0])
    one = turns.max_over_ranks([time.perf_counter() - begin])[0]
    steps = max(3, min(run.steps, int(BATCH_S / max(one, 1e-7))))
    # `one` is the slowest rank's: every rank runs the same steps and rounds.
    rounds = min(run.rounds, max(MIN_ROUNDS, int(SIZE_BUDGET_S / (len(run.impls) * steps * max(one, 1e-7)))))
    per_round = {impl: [] for impl in run.impls}
    for k in range(rounds):
        for impl in (run.impls if k % 2 == 0 else tuple(reversed(run.impls))):
            progress(impl, "step", nbytes)
            prepare(impl)
            dist.barrier()
            begin = time.perf_counter()
            for _ in range(steps):
                step(impl)
            per_round[impl].append((time.perf_counter() - begin) / steps)
    progress.skip(len(run.impls) * (run.rounds - rounds))
    slowest = {impl: turns.max_over_ranks(t) for impl, t in per_round.items()}
    return ({impl: statistics.median(t) for impl, t in slowest.items()},
            {impl: min(t) for impl, t in slowest.items()}, slowest)


def _report(config: Config, records: list[dict]) -> int:
    print(f"#     size  traced (us)  untraced (us)  overhead   best: traced  untraced  overhead"
          f"  paired  (target <= {TARGET:.0%} at 4 KiB)")
    for r in records:
        if "overhead" not in r:
            print(f"  {report.human_bytes(r['bytes']):>7}  " + "  ".join(
                f"{k}: {r[k]:.2f}" for k in r if k.endswith("_us")))
            continue
        print(f"  {report.human_bytes(r['bytes']):>7}  {r['traced_us']:>11.2f}  {r['untraced_us']:>13.2f}  "
              f"{r['overhead']:>+8.2%}  {r['traced_best_us']:>12.2f}  {r['untraced_best_us']:>8.2f}  "
              f"{r['overhead_best']:>+8.2%}  {r['overhead_paired']:>+6.2%}")
    bad = [r for r in records if r["wrong"]]
    return turns.finish(config.run, "recorder", {"sizes": list(config.sizes)}, records, bad,
                        "# wrong results: " + ", ".join(f"{r['bytes']} bytes ({r['wrong']})" for r in bad))


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES),
                   help="all_reduce sizes in bytes, multiples of 4 (default 4K)")
    turns.add_run_arguments(p, IMPLS, warmup=500, steps=200, rounds=1001, timeout=120.0, deadline=900.0,
                            nproc_help="ranks")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the recorder benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    run = turns.run_options(parser, args, IMPLS, started)
    for size in args.sizes:
        if size < 4 or size % 4:
            parser.error(f"--sizes {size}: must be a positive multiple of 4 (float32 elements)")
    return turns.start(_run_rank, Config(run, tuple(args.sizes)), run, "recorder")


if __name__ == "__main__":
    sys.exit(main())
