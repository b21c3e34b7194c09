"""ZeRO-Offload's delayed parameter update against the usual one: how training converges.

    python -m braid.bench delayed                      # learning rates 1e-3, 3e-3, 1e-2, 3e-2
    python -m braid.bench delayed --lrs 3e-3 --steps 1000 --json results/delayed.json

braid's ZeRO wrapper with ``offload_optimizer=True`` and ``step_in_backward(opt)`` (each shard
stepped on the host thread during the backward) against the same with ``delay=True`` (each step
run during the next step's forward and backward, whose gradient is then computed with the
parameters from before the update: one step stale). One process (a communicator of one rank: the
arithmetic of the update is what differs, not the communication), braid's AdamW (weight decay
0.01), a small language model (vocabulary 64, width 64) learning a fixed random bigram table in
which each token has two successors, drawn alike: the lowest loss reachable is ln 2 = 0.693 nats.
Batches of 16 sequences of 32 tokens, the same for both runs.

Printed per learning rate and update: the mean loss over steps 90-109 and 290-309 ("-" when the
run is shorter), over the last 50 steps, and the first step whose loss is under 1.0. --json writes
the same and every loss.
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from braid import comm, optim
from braid.comm import zero

from . import report

VOCAB, WIDTH, BATCH, SEQ = 64, 64, 16, 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                         nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))


def _batch(step: int, table: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(SEQ):
        ids[:, t + 1] = table[ids[:, t], torch.randint(0, 2, (BATCH,), generator=g)]
    return ids


def train(c, lr: float, delay: bool, steps: int, table: torch.Tensor) -> list[float]:
    """Losses of ``steps`` steps of the ZeRO wrapper (stage 2, optimizer offloaded) on ``c``."""
    model = zero.shard(_model(), c, stage=2, offload_optimizer=True)
    opt = optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.step_in_backward(opt, delay=delay)
    losses = []
    for step in range(steps):
        model.zero_grad()
        ids = _batch(step, table)
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
    return losses


def _window(losses: Sequence[float], lo: int, hi: int) -> float | None:
    """The mean loss over steps lo..hi-1, None when the run is shorter."""
    return round(sum(losses[lo:hi]) / (hi - lo), 4) if len(losses) >= hi else None


def _cell(x: float | None) -> str:
    return f"{'-':>9}" if x is None else f"{x:>9.3f}"


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2",
                   help="comma-separated learning rates (default 1e-3,3e-3,1e-2,3e-2)")
    p.add_argument("--steps", type=int, default=600, help="steps per run, at least 50 (default 600)")
    p.add_argument("--json", metavar="PATH", help="write the records here")
    args = p.parse_args(argv)
    try:
        lrs = [float(x) for x in args.lrs.split(",")]
    except ValueError:
        p.error(f"--lrs must be comma-separated numbers, got {args.lrs!r}")
    if any(not (lr > 0 and math.isfinite(lr)) for lr in lrs):
        p.error(f"--lrs must be positive, got {args.lrs!r}")
    if args.steps < 50:
        p.error(f"--steps must be at least 50, got {args.steps}")
    table = torch.randint(0, VOCAB, (VOCAB, 2), generator=torch.Generator().manual_seed(7))
    c = comm.Communicator(dist.HashStore(), 0, 1)
    print(f"# braid.bench delayed: {args.steps} steps, floor ln 2 = {math.log(2):.3f} nats")
    print(f"# {'lr':>8} {'update':>8} {'loss@100':>9} {'loss@300':>9} {'last 50':>9} {'under 1.0':>10}")
    records = []
    try:
        for lr in lrs:
            for delay in (False, True):
                losses = train(c, lr, delay, args.steps, table)
                under = next((i for i, v in enumerate(losses) if v < 1.0), None)
                rec = {"lr": lr, "update": "delayed" if delay else "usual",
                       "loss_100": _window(losses, 90, 110), "loss_300": _window(losses, 290, 310),
                       "loss_last_50": _window(losses, len(losses) - 50, len(losses)),
                       "first_under_1": under, "losses": losses}
                records.append(rec)
                print(f"  {lr:>8g} {rec['update']:>8} {_cell(rec['loss_100'])} {_cell(rec['loss_300'])} "
                      f"{_cell(rec['loss_last_50'])} {str(under):>10}", flush=True)
    finally:
        c.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "delayed", "machine": report.machine_info(), "steps": args.steps,
                       "records": records}, f, indent=1)
    return 0
