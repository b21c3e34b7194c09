"""Command line of the benchmarks: ``python -m braid.bench <benchmark> [options]``, or ``braid-bench``."""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each benchmark is a module of this package with main(argv, prog) -> exit status; only the chosen
# one is imported, so --help stays fast and a benchmark's dependencies load only when it runs.
BENCHMARKS = {
    "collectives": "all_reduce, reduce_scatter, all_gather, broadcast: braid vs gloo vs Open MPI",
    "tp": "transformer block forward+backward at TP=2: braid.comm.tp vs DTensor on gloo",
    "attention": "fused attention TFLOP/s: braid vs torch SDPA's flash, cuDNN and efficient backends",
    "sharding": "~25M-parameter LM training step on 2 ranks: FSDP2 (gloo, braid comms) vs braid ZeRO-2/3",
    "compression": "compression kernels: GB/s against memcpy, wire ratio, relative error",
    "ddp": "DDP step time of a ~25M-parameter transformer: gloo vs braid hooks (exact, compressed)",
    "multihost": "all_reduce across simulated hosts on shaped links: braid (exact, compressed) vs gloo",
    "pipeline": "torch.distributed.pipelining schedules at 2 and 4 stages: braid backend vs gloo, bubble",
    "cp": "ring (context-parallel) attention at 2 ranks vs one rank, communication hidden behind compute",
    "staging": "CUDA tensors through braid's all_reduce: GB/s against pinned copies, chunk x slots (GPU)",
    "cuda": "CUDA-tensor collectives on one host: device to device (CUDA IPC) vs staged vs the floor (GPU)",
    "gpufloor": "processes sharing a GPU, no braid: concurrent copy, event and device-flag round trips (GPU)",
    "recorder": "the flight recorder's cost on a 4 KiB all_reduce: recording on vs off, same processes",
    "moe": "MoE layer forward+backward tokens/s, one host and across hosts: braid vs all_to_all on gloo",
    "delayed": "ZeRO-Offload's delayed parameter update vs the usual one: a small LM's loss per lr",
    "optim": "CPU AdamW step GB/s: braid.optim's C++ step vs torch's fused and foreach AdamW, copy rate",
    "plan": "the planner's predicted step time and memory against a small GPT trained with 13 layouts",
    "ft": "a killed worker: braid.ft's survivors go on vs torchrun's restart from a checkpoint; quorum cost",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark named by the first argument; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m braid.bench",
        description="Benchmarks of braid against its peers. "
                    "`python -m braid.bench BENCHMARK --help` lists a benchmark's options.",
        epilog="benchmarks:\n" + "\n".join(f"  {name:<14}{text}" for name, text in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=BENCHMARKS, metavar="BENCHMARK")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options of the benchmark")
    ns = parser.parse_args(argv)
    module = importlib.import_module(f"braid.bench.{ns.benchmark}")
    return module.main(ns.args, prog=f"{parser.prog} {ns.benchmark}")


if __name__ == "__main__":
    sys.exit(main())
