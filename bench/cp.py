"""Context-parallel benchmark: ring attention's forward+backward at N ranks against one rank holding
the whole sequence, and how much of the ring's communication hides behind its compute.

    python -m braid.bench cp                              # 2 ranks, causal, the default lengths
    python -m braid.bench cp --seqs 1024 4096 --no-causal --json results/cp.json
    python -m braid.bench cp --tcp                        # the ring over TCP between the ranks

One attention layer, (batch, heads, seq, head_dim) = (--batch, --heads, S, --head-dim), float32,
on the CPU. Implementations, taking turns in the same processes (bench/turns.py):

- ``ring``: ``braid.comm.cp.ring_attention`` on this rank's S/N positions (the balanced layout for
  causal attention), K/V blocks moved by the braid communicator's point-to-point;
- ``compute``: the same ring with a stand-in that moves nothing (the arriving block is a local
  copy of the sent one): a rank's share of the arithmetic alone;
- ``comm``: the ring's transfers alone, in the ring's order and sizes (forward: N-1 K/V blocks;
  backward: N-1 K/V blocks and N dK/dV accumulators, float32), nothing computed;
- ``single``: the same block code on the whole sequence at one rank (every rank computes it, each
  on its own core): the time one rank holding the sequence takes;
- ``sdpa``: torch's ``scaled_dot_product_attention`` forward+backward on the whole sequence at one
  rank (its CPU flash kernel, which skips masked tiles): torch's own single-rank time.

A step is a forward and a backward of a weighted sum of the output. Reported: step time per
implementation, ``speedup`` = single / ring (and sdpa / ring), ``exposed``: the time per step the
ring waits for its transfers after computing, timed around each wait and taken, per step, on the
rank that waited least (the rank that computed last: the one that finished first also waits for
its peer's compute, which is load imbalance, not communication), and
``hidden`` = 1 - exposed / comm, the share of the transfers' time hidden behind compute (1: all
of it; clipped to [0, 1]). The waits are timed directly because the transfers take a few percent
of a step here, less than the step's run-to-run noise on a loaded machine, so a difference of
step times (ring - compute) could not resolve them. ``err``: the ring's output and dq, gathered,
against the single-rank result.

--json writes {"benchmark": "cp", "date", "machine", "config", "records": [{"seq", "batch",
"heads", "head_dim", "causal", "world_size", "ring_ms", "compute_ms", "comm_ms", "single_ms",
"sdpa_ms", "exposed_ms", "speedup_vs_single", "speedup_vs_sdpa", "hidden", "err"}]}; "config" has
"tcp".
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from braid.comm import cp

from . import report, turns

IMPLS = ("ring", "compute", "comm", "single", "sdpa")
DEFAULT_SEQS = (1024, 2048, 4096)


@dataclass(frozen=True)
class Config:
    run: turns.RunOptions
    seqs: tuple[int, ...]
    batch: int
    heads: int
    head_dim: int
    causal: bool
    tcp: bool


class _Done:
    @staticmethod
    def wait() -> None:
        return None


class _NoTransfer(cp._Ring):
    """A ring of ``world_size`` ranks whose transfers copy the sent block into the receive buffer
    instead of moving it: the ring's arithmetic without its communication."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.next, self.prev = (rank + 1) % world_size, (rank - 1) % world_size
        self.communicator = None

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> _Done:
        recv.copy_(send)
        return _Done()


class _WaitTimed:
    def __init__(self, exchange, ring: "_TimedRing"):
        self._exchange, self._ring = exchange, ring

    def wait(self) -> None:
        begin = time.perf_counter()
        self._exchange.wait()
        self._ring.waited += time.perf_counter() - begin


class _TimedRing(cp._Ring):
    """The ring of a braid communicator that adds up the time spent waiting for its transfers,
    and keeps it per step."""

    def __init__(self, communicator):
        super().__init__(communicator, "bench")
        self.waited = 0.0
        self.per_step: list[float] = []

    def step(self, fn) -> None:
        before = self.waited
        fn()
        self.per_step.append(self.waited - before)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> _WaitTimed:
        return _WaitTimed(super().exchange(send, recv), self)


def _step(q, k, v, weights, attention) -> None:
    for t in (q, k, v):
        t.grad = None
    out = attention(q, k, v)
    (out * weights).sum().backward()


def _transfers(ring: cp._Ring, kv: torch.Tensor, buffers: list) -> None:
    """The ring's transfers of one forward+backward, nothing computed."""
    n = ring.world_size
    for _ in range(n - 1):  # forward
        ring.exchange(kv, buffers[0]).wait()
    for step in range(n):  # backward: K/V on (but the last step), the dK/dV accumulator on
        pending = ring.exchange(kv, buffers[0]) if step + 1 < n else None
        ring.exchange(buffers[1], buffers[2]).wait()
        if pending is not None:
            pending.wait()


def _bench_seq(seq: int, config: Config, c, rank: int, world_size: int, progress: report.Progress) -> dict:
    run = config.run
    causal = config.causal
    g = torch.Generator().manual_seed(seq)
    shape = (config.batch, config.heads, seq, config.head_dim)
    q, k, v, weights = (torch.randn(shape, generator=g) for _ in range(4))
    scale = 1.0 / config.head_dim ** 0.5
    local = [cp.shard(t, c, balanced=causal).requires_grad_() for t in (q, k, v)]
    local_weights = cp.shard(weights, c, balanced=causal)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ring, alone, one = _TimedRing(c), _NoTransfer(rank, world_size), _NoTransfer(0, 1)
    apply = cp._RingAttention.apply
    kv = torch.stack([local[1].detach(), local[2].detach()])
    buffers = [torch.empty_like(kv), torch.zeros(kv.shape), torch.empty(kv.shape)]
    steps = {
        "ring": functools.partial(ring.step, functools.partial(
            _step, *local, local_weights, lambda a, b, d: apply(a, b, d, ring, causal, scale, causal))),
        "compute": functools.partial(_step, *local, local_weights,
                                     lambda a, b, d: apply(a, b, d, alone, causal, scale, causal)),
        "comm": functools.partial(_transfers, ring, kv, buffers),
        "single": functools.partial(_step, *whole, weights,
                                    lambda a, b, d: apply(a, b, d, one, causal, scale, False)),
        "sdpa": functools.partial(_step, *whole, weights,
                                  lambda a, b, d: F.scaled_dot_product_attention(a, b, d, is_causal=causal)),
    }
    steps = {impl: steps[impl] for impl in run.impls}
    nbytes = kv.numel() * kv.element_size()
    # Check: the ring's output and dq, gathered, against the single-rank block code.
    err = None
    if "ring" in steps:
        progress("ring", "check", nbytes)
        out = apply(*local, ring, causal, scale, causal)
        (out * local_weights).sum().backward()
        ref = apply(*whole, one, causal, scale, False)
        (ref * weights).sum().backward()
        err = max((cp.unshard(out.detach(), c, balanced=causal) - ref.detach()).abs().max().item(),
                  (cp.unshard(local[0].grad, c, balanced=causal) - whole[0].grad).abs().max().item())
        err = turns.max_over_ranks([err])[0]
    for step in steps.values():
        for _ in range(run.warmup):
            step()
    ring.per_step.clear()
    t = turns.time_in_turns(steps, run, progress, nbytes)
    ms = {impl: round(t[impl] * 1e3, 3) if impl in t else None for impl in IMPLS}
    exposed = hidden = None
    if "ring" in t:  # per step the least any rank waited (the minimum as minus the maximum of negatives)
        least = turns.max_over_ranks([-w for w in ring.per_step])
        exposed = -sum(least) / len(least)
        if "comm" in t and t["comm"] > 0:
            hidden = round(min(1.0, max(0.0, 1.0 - exposed / t["comm"])), 3)
        exposed = round(exposed * 1e3, 3)
    return {"seq": seq, "batch": config.batch, "heads": config.heads, "head_dim": config.head_dim,
            "causal": causal, "world_size": world_size,
            **{f"{impl}_ms": ms[impl] for impl in IMPLS}, "exposed_ms": exposed,
            "speedup_vs_single": _ratio(t, "single", "ring"), "speedup_vs_sdpa": _ratio(t, "sdpa", "ring"),
            "hidden": hidden, "err": None if err is None else float(f"{err:.3g}")}


def _ratio(times: dict, numerator: str, denominator: str) -> float | None:
    if numerator not in times or denominator not in times:
        return None
    return round(times[numerator] / times[denominator], 3)


def _run_rank(rank: int, world_size: int, store_port: int | None, config: Config) -> int:
    run = config.run
    if config.tcp:  # every rank a host of its own: the ring's transfers go over TCP (loopback here)
        os.environ["BRAID_HOST_ID"] = f"cp-bench-rank{rank}"
    with turns.rank_session(rank, world_size, store_port, run) as c:
        progress = report.Progress(len(config.seqs) * (len(run.impls) * run.rounds + 1), enabled=rank == 0)
        records = [_bench_seq(seq, config, c, rank, world_size, progress) for seq in config.seqs]
        progress.close()
    return _report(config, records) if rank == 0 else 0


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(records: list[dict]) -> str:
    lines = ["#   seq  ring (ms)  compute (ms)  comm (ms)  single (ms)  sdpa (ms)  vs single  vs sdpa"
             "  exposed (ms)  hidden      err"]
    for r in records:
        lines.append(f"  {r['seq']:>5}  {_fmt(r['ring_ms'], '9.2f')}  {_fmt(r['compute_ms'], '12.2f')}"
                     f"  {_fmt(r['comm_ms'], '9.2f')}  {_fmt(r['single_ms'], '11.2f')}"
                     f"  {_fmt(r['sdpa_ms'], '9.2f')}  {_fmt(r['speedup_vs_single'], '9.2f')}"
                     f"  {_fmt(r['speedup_vs_sdpa'], '7.2f')}  {_fmt(r['exposed_ms'], '12.3f')}"
                     f"  {_fmt(r['hidden'], '6.2f')}"
                     f"  {_fmt(r['err'], '7.2g')}")
    return "\n".join(lines)


def _report(config: Config, records: list[dict]) -> int:
    print(_table(records))
    # float32 blocks merged through their LSE against one float32 softmax: rounding only.
    bad = [r for r in records if r["err"] is not None and not r["err"] <= 1e-3]
    settings = {"seqs": list(config.seqs), "batch": config.batch, "heads": config.heads,
                "head_dim": config.head_dim, "causal": config.causal, "tcp": config.tcp}
    return turns.finish(config.run, "cp", settings, records, bad,
                        "# ring results differ from the single-rank ones: "
                        + ", ".join(f"seq {r['seq']} ({r['err']:.3g})" for r in bad))


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=DEFAULT_SEQS,
                   help="whole sequence lengths (default: " + " ".join(map(str, DEFAULT_SEQS)) + ")")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="attention without the causal mask (contiguous shards)")
    p.add_argument("--tcp", action="store_true",
                   help="ranks as if on hosts of their own (BRAID_HOST_ID): the blocks travel over TCP")
    turns.add_run_arguments(p, IMPLS, warmup=1, steps=1, rounds=5, timeout=120.0, deadline=1800.0,
                            nproc_help="ranks the sequence is split over")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the context-parallel benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    run = turns.run_options(parser, args, IMPLS, started)
    for name in ("batch", "heads", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    parts = 2 * run.world_size if args.causal else run.world_size
    for seq in args.seqs:
        if seq < 1 or seq % parts:
            parser.error(f"--seqs {seq}: must be a positive multiple of {parts} (the ring's chunks at "
                         f"{run.world_size} ranks)")
    config = Config(run, tuple(args.seqs), args.batch, args.heads, args.head_dim, args.causal, args.tcp)
    return turns.start(_run_rank, config, run, "cp")


if __name__ == "__main__":
    sys.exit(main())
