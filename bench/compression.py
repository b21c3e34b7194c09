"""Compression benchmark: kernel throughput against memcpy, wire ratio and error per compressor.

    python -m braid.bench compression                  # 4M float32 elements (16 MB), CPU (+ GPU)
    python -m braid.bench compression --numel 1M --json results/compression.json

Throughput is GB/s of float32 input (the gradient the kernel consumes) on one CPU thread, the
median of ``--repeats`` timed calls, next to the single-thread copy of the same bytes (``copy``:
read + write of the input size, ``torch.Tensor.copy_``). On the CPU, "vs copy" is the median of
per-repeat ratios, the copy timed right before the kernel each time. On a GPU the CUDA kernels are timed
with events against a device-to-device copy. Wire ratio: float32 bytes / payload bytes.
Relative error: ||decode(encode(x)) - x|| / ||x|| for x ~ N(0, 1) with blocks of varied scale.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from . import report


def _median_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # first touch of outputs, caches
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paired(fn: Callable[[], object], base: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of ``fn`` and the median over repeats of base time / fn time, ``base`` timed
    right before ``fn`` in every repeat: the ratio holds up when the machine's speed drifts during
    the run (a shared VM's memory bandwidth does), which comparing two medians does not."""
    fn()
    base()
    times, ratios = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        times.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    return statistics.median(times), statistics.median(ratios)


def _gradient(numel: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(numel, generator=g)
        * torch.rand(numel // 256 + 1, generator=g).mul(4).exp2().repeat_interleave(256)[:numel]
    )
    return x.to(device)


def _rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((y.float() - x.float()).norm() / x.float().norm()).item()


def cpu_rows(numel: int, repeats: int) -> list[dict]:
    """One row per kernel: name, seconds, GB/s of float32 input, fraction of copy bandwidth,
    wire ratio and relative error where the kernel is an encoder."""
    from braid.comm import _C

    x = _gradient(numel)
    nbytes = x.numel() * 4
    copy_dst = torch.empty_like(x)
    copy_s = _median_seconds(lambda: copy_dst.copy_(x), repeats)
    res = torch.zeros(numel)
    out = torch.empty(numel)
    acc = torch.zeros(numel)
    rows = [{"kernel": "copy (memcpy)", "seconds": copy_s, "vs_copy": 1.0}]

    def add(
        name: str, fn: Callable[[], object], payload: int | None = None, err: float | None = None
    ) -> None:
        seconds, vs_copy = _paired(fn, lambda: copy_dst.copy_(x), repeats)
        rows.append(
            {
                "kernel": name,
                "seconds": seconds,
                "vs_copy": vs_copy,
                "wire_ratio": None if payload is None else nbytes / payload,
                "rel_error": err,
            }
        )

    for bits, block in ((8, 256), (4, 128)):
        q = _C.quantize(x, None, bits, block, True, 1)
        _C.dequantize(q, bits, block, out)
        err_sr = _rel_error(x, out)
        qn = _C.quantize(x, None, bits, block, False, 1)
        _C.dequantize(qn, bits, block, out)
        err_rn = _rel_error(x, out)
        buf = torch.empty_like(q)
        tag = f"int{bits} b{block}"
        encode = functools.partial(_C.quantize, x, out=buf, bits=bits, block=block, seed=1)
        add(
            f"{tag} quantize stochastic",
            functools.partial(encode, residual=None, stochastic=True),
            q.numel(),
            err_sr,
        )
        add(
            f"{tag} quantize nearest",
            functools.partial(encode, residual=None, stochastic=False),
            q.numel(),
            err_rn,
        )
        add(
            f"{tag} quantize + error feedback",
            functools.partial(encode, residual=res, stochastic=True),
            q.numel(),
        )
        add(f"{tag} dequantize", functools.partial(_C.dequantize, q, bits, block, out))
        add(f"{tag} dequantize-accumulate", functools.partial(_C.dequantize_accumulate, q, bits, block, acc))
    for ratio in (0.01, 0.05):
        k = max(1, int(ratio * numel))
        values, indices, _ = _C.top_k(x, k)
        dense = torch.zeros(numel)
        _C.scatter_add(dense, indices, values)
        add(f"top-k {ratio:.0%} select", functools.partial(_C.top_k, x, k), 8 * k, _rel_error(x, dense))
        add(f"top-k {ratio:.0%} scatter-add", functools.partial(_C.scatter_add, acc, indices, values))
    add("error feedback update", lambda: _C.error_feedback(x, res, out))
    bf = x.to(torch.bfloat16)
    add("cast to bfloat16 (torch)", lambda: bf.copy_(x), numel * 2, _rel_error(x, bf))
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        sent = torch.empty(numel, dtype=dtype)
        add(f"cast to {name} + error feedback", functools.partial(_C.cast, x, res, sent), numel * 2,
            _rel_error(x, x.to(dtype)))
    for r in rows:
        r["gbps"] = nbytes / r["seconds"] / 1e9
    return rows


def cuda_rows(numel: int, repeats: int) -> list[dict]:
    """The CUDA kernels against a device-to-device copy (CUDA builds on a GPU only)."""
    from braid.comm import _C

    x = _gradient(numel, "cuda")
    nbytes = x.numel() * 4
    sync = torch.cuda.synchronize
    copy_dst = torch.empty_like(x)
    copy_s = _median_seconds(lambda: copy_dst.copy_(x), repeats, sync)
    res = torch.zeros_like(x)
    out = torch.empty_like(x)
    acc = torch.zeros_like(x)
    rows = [{"kernel": "device copy", "seconds": copy_s}]
    for bits, block in ((8, 256), (4, 128)):
        q = _C.cuda_quantize(x, None, bits, block, True, 1)
        tag = f"int{bits} b{block}"
        kernels = (
            (
                f"{tag} quantize stochastic",
                functools.partial(_C.cuda_quantize, x, None, bits, block, True, 1),
            ),
            (
                f"{tag} quantize + error feedback",
                functools.partial(_C.cuda_quantize, x, res, bits, block, True, 1),
            ),
            (f"{tag} dequantize", functools.partial(_C.cuda_dequantize, q, bits, block, out)),
            (
                f"{tag} dequantize-accumulate",
                functools.partial(_C.cuda_dequantize_accumulate, q, bits, block, acc),
            ),
        )
        for name, fn in kernels:
            rows.append({"kernel": name, "seconds": _median_seconds(fn, repeats, sync)})
    k = numel // 100
    rows.append(
        {
            "kernel": "top-k 1% select",
            "seconds": _median_seconds(functools.partial(_C.cuda_top_k, x, k), repeats, sync),
        }
    )
    rows.append(
        {
            "kernel": "error feedback update",
            "seconds": _median_seconds(lambda: _C.cuda_error_feedback(x, res, out), repeats, sync),
        }
    )
    for r in rows:
        r["gbps"] = nbytes / r["seconds"] / 1e9
        r["vs_copy"] = copy_s / r["seconds"]
    return rows


def table(rows: Sequence[dict], copy_name: str) -> str:
    lines = [
        f"{'kernel':<34}{'time':>11}{'GB/s':>9}{'vs ' + copy_name:>14}{'wire ratio':>12}{'rel error':>11}"
    ]
    for r in rows:
        ratio = f"{r['wire_ratio']:.2f}x" if r.get("wire_ratio") else "-"
        err = f"{r['rel_error']:.4f}" if r.get("rel_error") is not None else "-"
        lines.append(
            f"{r['kernel']:<34}{r['seconds'] * 1e3:>9.3f}ms{r['gbps']:>9.2f}{r['vs_copy']:>13.0%}"
            f"{ratio:>12}{err:>11}"
        )
    return "\n".join(lines)


def _parse_count(text: str) -> int:
    """A positive element count, with an optional K, M or G suffix (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    try:
        count = int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected a count such as 4M, got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return count


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--numel",
        type=_parse_count,
        default=4 << 20,
        help="float32 elements of the gradient (default 4M = 16 MB: larger than the caches)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per kernel; the median is shown")
    parser.add_argument("--json", metavar="PATH", type=report.output_path(),
                        help="write machine info and rows as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(1)  # the kernels are single-threaded; so is the copy they are held against
    machine = report.machine_info()
    print(
        f"# braid compression kernels, {args.numel} float32 elements ({report.human_bytes(args.numel * 4)}), "
        f"1 thread, median of {args.repeats}; load average {machine['load_average']}"
    )
    rows = cpu_rows(args.numel, args.repeats)
    print(table(rows, "copy"))
    doc = {"machine": machine, "numel": args.numel, "cpu": rows}
    from braid.comm.core.build_info import is_cuda_build

    if torch.cuda.is_available() and is_cuda_build():
        gpu = cuda_rows(args.numel, args.repeats)
        print(f"\n# CUDA kernels on {torch.cuda.get_device_name()}")
        print(table(gpu, "copy"))
        doc["cuda"] = gpu
    if args.json:
        report.write_json(args.json, doc)
    return 0
