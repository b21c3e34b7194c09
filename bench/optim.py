"""Optimizer step benchmark: braid's C++ AdamW step (braid.optim) against torch's fused and
foreach AdamW on the same CPU tensors, in GB/s of optimizer traffic, beside this machine's copy
rate (the floor: a step must read and write its state at least once).

Traffic per element: read parameter, gradient and both moments, write parameter and moments:
28 bytes in float32; 30 with the bfloat16 copy of the parameter that offloaded training sends back
to the GPU (torch writes it in a separate cast, which is timed with it). The copy rate counts a
copy's bytes read plus written, as the steps' traffic is counted. Every implementation is timed
the same way, in the same process, the order alternating between repeats; the median of the
repeats is reported.

    python -m braid.bench optim --sizes 10M,100M --threads 1,all
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

from braid import optim

from .report import machine_info

IMPLS = ("braid", "torch-fused", "torch-foreach")


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(text[-1:], 1)
    value = int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be a positive element count, got {text!r}")
    return value


def _time(fn: Callable[[], None], iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _adamw(n: int, impl: str, with_copy: bool):
    """One step function of `impl` over fresh tensors of `n` elements (gradients fixed)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    copy = torch.empty(n, dtype=torch.bfloat16) if with_copy else None
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if impl == "braid":
        m, v = torch.zeros(n), torch.zeros(n)
        state = {"step": 0}

        def step() -> None:
            state["step"] += 1
            optim.adam_step(p, g, m, v, step=state["step"], decoupled=True, param_copy=copy, **hyper)
        return step
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = torch.optim.AdamW([param], fused=impl == "torch-fused", foreach=impl == "torch-foreach", **hyper)
    if copy is None:
        return opt.step

    def step_and_cast() -> None:
        opt.step()
        copy.copy_(param.detach())
    return step_and_cast


def _copy_rate(n: int) -> float:
    """Bytes read plus written per second by a float32 copy of n elements (the floor's rate)."""
    src, dst = torch.randn(n), torch.empty(n)
    t = statistics.median(_time(lambda: dst.copy_(src), 3) for _ in range(5))
    return 8 * n / t


def run(sizes: Sequence[int], threads: Sequence[int], impls: Sequence[str], repeats: int, iters: int,
        with_copy: bool) -> list[dict]:
    records = []
    bytes_per_elem = 28 + (2 if with_copy else 0)
    for nthreads in threads:
        torch.set_num_threads(nthreads)
        for n in sizes:
            floor = _copy_rate(n)
            steps = {impl: _adamw(n, impl, with_copy) for impl in impls}
            times = {impl: [] for impl in impls}
            for r in range(repeats):
                for impl in (impls if r % 2 == 0 else list(reversed(impls))):
                    times[impl].append(_time(steps[impl], iters))
            row = {"threads": nthreads, "elements": n, "bf16_copy": with_copy, "copy_gbps": floor / 1e9}
            for impl in impls:
                t = statistics.median(times[impl])
                row[impl] = {"ms": t * 1e3, "gbps": bytes_per_elem * n / t / 1e9}
            records.append(row)
            del steps
            print_row(row, impls)
    return records


def print_row(row: dict, impls: Sequence[str]) -> None:
    cells = "  ".join(f"{impl} {row[impl]['ms']:8.2f} ms {row[impl]['gbps']:6.2f} GB/s" for impl in impls)
    ratios = ""
    if "braid" in impls:
        ratios = f"   braid/floor {row['braid']['gbps'] / row['copy_gbps']:.2f}"
        for peer in impls:
            if peer != "braid":
                ratios += f"  braid/{peer} {row[peer]['ms'] / row['braid']['ms']:.2f}"
    print(f"{row['threads']:>3} thr {row['elements']:>11,} el{' +bf16' if row['bf16_copy'] else '      '}  "
          f"copy {row['copy_gbps']:6.2f} GB/s  {cells}{ratios}", flush=True)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10M,100M",
                        help="comma-separated element counts (K, M, G: powers of 1000; default 10M,100M)")
    parser.add_argument("--threads", default="1,all", help="comma-separated thread counts, 'all' for every "
                        "core this process may use (default 1,all)")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per implementation (default 5)")
    parser.add_argument("--iters", type=int, default=5, help="steps per repeat (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the records here")
    args = parser.parse_args(argv)
    try:
        sizes = [_count(s) for s in args.sizes.split(",")]
    except (argparse.ArgumentTypeError, ValueError) as e:
        parser.error(f"--sizes: {e}")
    cores = len(os.sched_getaffinity(0))
    threads = []
    for t in args.threads.split(","):
        if t.strip() == "all":
            threads.append(cores)
        elif t.strip().isdigit() and int(t) >= 1:
            threads.append(int(t))
        else:
            parser.error(f"--threads: {t!r} is neither a positive count nor 'all'")
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        bad = ", ".join(unknown) or "(none given)"
        parser.error(f"--impls: unknown {bad}; choose from {', '.join(IMPLS)}")
    if args.repeats < 1 or args.iters < 1:
        parser.error("--repeats and --iters must be >= 1")
    print(f"# AdamW step, float32 state; traffic 28 B/element (30 with the bfloat16 copy); "
          f"braid/peer > 1: braid faster; {cores} cores", flush=True)
    records = []
    for with_copy in (False, True):
        records += run(sizes, threads, impls, args.repeats, args.iters, with_copy)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"benchmark": "optim", "machine": machine_info(), "records": records}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
