"""Tensor-parallel benchmark: a transformer block's forward+backward at TP=N on CPU, braid vs DTensor.

    python -m braid.bench tp                     # 2 ranks, the default block shapes
    python -m braid.bench tp --shapes 512x8x2048x4x256 --json results/tp.json
    python -m braid.bench tp --carrier nccl --nproc 8   # on 8 GPUs: braid's layers vs DTensor, NCCL

Implementations, in the same processes, on the same block (bench/models.py: pre-norm attention
with separate q/k/v projections and a GELU MLP) and the same plan (q, k, v and the MLP's up
projection split by columns, the output and down projections by rows):

- ``braid``: braid.comm.tp layers on a braid communicator;
- ``braid-on-gloo``: the same layers on the gloo group DTensor's mesh uses (braid's group
  interface over a ProcessGroup): the carrier held equal, the layers' own cost compared;
- ``braid-on-nccl``, ``dtensor-on-nccl``: both on an NCCL group, every tensor on the rank's GPU
  (``--carrier nccl``; each row's ratio is then against DTensor on NCCL);
- ``dtensor``: torch's ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a
  gloo DeviceMesh;
- ``compute``: the braid layers on a stand-in communicator that moves nothing, so the step is a
  rank's share of the arithmetic alone.

A step is ``zero_grad``, forward, and backward of a weighted sum of the output. Timing: the
implementations take turns (so a slow phase of the machine hits them alike), in an order that
rotates every round (bench/turns.py): each turn a gloo barrier, then ``--steps`` steps timed
together; a round's time per step is the slowest rank's; the result is the median over
``--rounds`` rounds after ``--warmup`` steps. Exposed
communication = step time minus the ``compute`` step time: what communication (and, for DTensor,
its dispatch) adds to the critical path. ``err`` is the largest difference of the output and of
the input gradient from the dense block run locally, a check that the sharded step is the same
computation.

--json writes {"benchmark": "tp", "date", "machine", "config", "records": [{"impl", "dim", "heads",
"hidden", "batch", "seq", "world_size", "step_ms", "exposed_ms", "carrier", "ratio_vs_dtensor", "err"}]};
ratio_vs_dtensor is against DTensor on the same carrier (NCCL for NCCL rows, else gloo).
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from braid.comm import tp

from . import report, turns
from .models import BLOCK_PLAN, Block

IMPLS = ("braid", "braid-on-gloo", "dtensor", "braid-on-nccl", "dtensor-on-nccl", "compute")
# The carrier of each implementation (--carrier keeps those it names; None moves nothing).
CARRIER_OF = {"braid": "braid", "braid-on-gloo": "gloo", "dtensor": "gloo", "braid-on-nccl": "nccl",
              "dtensor-on-nccl": "nccl", "compute": None}


def _reference(impl: str) -> str:
    """The DTensor run a row is compared with: the one on NCCL for NCCL rows, else on gloo."""
    return "dtensor-on-nccl" if CARRIER_OF[impl] == "nccl" else "dtensor"


@dataclass(frozen=True)
class Shape:
    dim: int
    heads: int
    hidden: int
    batch: int
    seq: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        return turns.parse_dims(cls, text, "DIMxHEADSxHIDDENxBATCHxSEQ")

    __str__ = turns.format_dims


# From latency-bound (small activations, many collectives per unit of arithmetic) to
# compute-bound; batch * seq * dim * 4 B is the size of each all-reduce.
DEFAULT_SHAPES = (Shape(256, 8, 1024, 4, 128), Shape(512, 8, 2048, 4, 256), Shape(1024, 16, 4096, 2, 512))


@dataclass(frozen=True)
class Config:
    run: turns.RunOptions
    shapes: tuple[Shape, ...]


class _Done:
    """A finished piece of work: what the stand-in communicator returns for async calls."""

    @staticmethod
    def wait(timeout: float | None = None) -> bool:
        return True


class LocalCommunicator:
    """Has a communicator's shape (rank, world size, collectives) but moves no data: all_reduce
    leaves the local values, all_gather repeats the local piece, reduce_scatter keeps the local
    slice. The layers then do exactly one rank's arithmetic, which times the computation alone."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def _done(self, async_op: bool):
        return _Done() if async_op else None

    def all_reduce(self, tensor, op="sum", async_op=False):
        return self._done(async_op)

    def all_gather(self, output, input, async_op=False):
        if input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
            input = input.clone()  # an in-place gather (FSDP2's): the input is a slice of the output
        output.view(self.world_size, -1).copy_(input.reshape(1, -1))
        return self._done(async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        output.view(-1).copy_(input.view(self.world_size, -1)[self.rank])
        return self._done(async_op)

    def broadcast(self, tensor, src=0, async_op=False):
        return self._done(async_op)


def _dtensor_block(dense: Block, world_size: int, device: torch.device, group=None) -> torch.nn.Module:
    """DTensor's TP of ``dense`` on a mesh over ``group`` (default: the run's gloo group)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if group is None:
        mesh = init_device_mesh(device.type, (world_size,))
    else:
        mesh = DeviceMesh.from_group(group, device.type)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(copy.deepcopy(dense), mesh, {k: styles[v]() for k, v in BLOCK_PLAN.items()})


def _step(model: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = model(x)
    (out * weights).sum().backward()
    return out


def _bench_shape(shape: Shape, c, rank: int, world_size: int, run: turns.RunOptions,
                 progress: report.Progress, device: torch.device, nccl) -> list[dict]:
    torch.manual_seed(0)
    dense = Block(shape.dim, shape.heads, shape.hidden).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape.batch, shape.seq, shape.dim, generator=g).to(device).requires_grad_()
    weights = torch.randn(shape.batch, shape.seq, shape.dim, generator=g).to(device) / shape.seq
    ref_out = _step(dense, x, weights).detach()
    ref_grad = x.grad.clone()
    builders = {
        "braid": lambda: tp.parallelize(copy.deepcopy(dense), c, BLOCK_PLAN),
        "braid-on-gloo": lambda: tp.parallelize(copy.deepcopy(dense), dist.group.WORLD, BLOCK_PLAN),
        "dtensor": lambda: _dtensor_block(dense, world_size, device),
        "braid-on-nccl": lambda: tp.parallelize(copy.deepcopy(dense), nccl, BLOCK_PLAN),
        "dtensor-on-nccl": lambda: _dtensor_block(dense, world_size, device, nccl),
        "compute": lambda: tp.parallelize(copy.deepcopy(dense), LocalCommunicator(rank, world_size),
                                          BLOCK_PLAN, src=None),
    }
    models = {impl: builders[impl]() for impl in run.impls}
    errors = {}
    for impl, model in models.items():
        progress(impl, "check", shape.batch * shape.seq * shape.dim * 4)
        out = _step(model, x, weights)
        errors[impl] = max((out.detach() - ref_out).abs().max().item(),
                           (x.grad - ref_grad).abs().max().item())
        for _ in range(run.warmup - 1):
            _step(model, x, weights)
    steps = {impl: turns.synchronized(functools.partial(_step, model, x, weights), device)
             for impl, model in models.items()}
    step = turns.time_in_turns(steps, run, progress, shape.batch * shape.seq * shape.dim * 4)
    errors = dict(zip(errors, turns.max_over_ranks(list(errors.values()))))
    compute = step.get("compute")
    records = []
    for impl in models:
        records.append({
            "impl": impl, "dim": shape.dim, "heads": shape.heads, "hidden": shape.hidden,
            "batch": shape.batch, "seq": shape.seq, "world_size": world_size,
            "step_ms": round(step[impl] * 1e3, 3),
            "exposed_ms": None if compute is None else round((step[impl] - compute) * 1e3, 3),
            "carrier": CARRIER_OF[impl],
            "ratio_vs_dtensor": (round(step[impl] / step[_reference(impl)], 3) if _reference(impl) in step
                                 else None),
            # The stand-in communicator computes something else on purpose: no check.
            "err": None if impl == "compute" else float(f"{errors[impl]:.3g}"),
        })
    return records


def _run_rank(rank: int, world_size: int, store_port: int | None, config: Config) -> int:
    run = config.run
    with turns.rank_session(rank, world_size, store_port, run) as c:
        device, nccl = turns.device_of(run, rank), turns.nccl_group(run)
        progress = report.Progress(len(config.shapes) * len(run.impls) * (1 + run.rounds), enabled=rank == 0)
        records = []
        for shape in config.shapes:
            records += _bench_shape(shape, c, rank, world_size, run, progress, device, nccl)
        progress.close()
    return _report(config, records) if rank == 0 else 0


def _table(records: list[dict]) -> str:
    lines = ["#      shape (dim x heads x hidden x batch x seq)   impl           step (ms)  exposed (ms)"
             "  vs dtensor      err"]
    for r in records:
        shape = f"{r['dim']}x{r['heads']}x{r['hidden']}x{r['batch']}x{r['seq']}"
        exposed = "-" if r["exposed_ms"] is None else f"{r['exposed_ms']:.2f}"
        ratio = "-" if r["ratio_vs_dtensor"] is None else f"{r['ratio_vs_dtensor']:.3f}"
        err = "-" if r["err"] is None else f"{r['err']:.2g}"
        lines.append(f"  {shape:>47}   {r['impl']:<13} {r['step_ms']:>10.2f}  {exposed:>12}"
                     f"  {ratio:>10}  {err:>7}")
    return "\n".join(lines)


def _report(config: Config, records: list[dict]) -> int:
    print(_table(records))
    # The block computes in float32 with O(1) values: a correct sharded step differs from the
    # dense one by rounding only.
    bad = [r for r in records if r["err"] is not None and not r["err"] <= 1e-3]
    return turns.finish(config.run, "tp", {"shapes": [str(s) for s in config.shapes]}, records, bad,
                        "# results differ from the dense block: "
                        + ", ".join(f"{r['impl']} {r['dim']} ({r['err']:.3g})" for r in bad))


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=Shape.parse, nargs="+", default=DEFAULT_SHAPES,
                   help="blocks as DIMxHEADSxHIDDENxBATCHxSEQ (default: "
                        + " ".join(map(str, DEFAULT_SHAPES)) + ")")
    turns.add_run_arguments(p, IMPLS, warmup=3, steps=3, rounds=5, timeout=120.0, deadline=1800.0,
                            nproc_help="ranks (the TP degree) to spawn")
    turns.add_carrier_argument(p)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the tensor-parallel benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    run = turns.with_carriers(parser, args, turns.run_options(parser, args, IMPLS, started), CARRIER_OF)
    for shape in args.shapes:
        for name, value in (("heads", shape.heads), ("hidden", shape.hidden)):
            if value % run.world_size:
                parser.error(f"--shapes {shape}: {name}={value} does not divide by {run.world_size} ranks")
        if shape.dim % shape.heads:
            parser.error(f"--shapes {shape}: dim must divide by heads")
    return turns.start(_run_rank, Config(run, tuple(args.shapes)), run, "tp")


if __name__ == "__main__":
    sys.exit(main())
