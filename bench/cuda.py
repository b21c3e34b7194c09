"""CUDA-tensor collectives between the ranks of one host: braid's device-to-device path (CUDA IPC)
against its staged path (pinned host memory) and against the floor of device memory traffic.
Needs a GPU and a braid build with CUDA.

    python -m braid.bench cuda                                  # 2 and 4 ranks on the visible GPU(s)
    python -m braid.bench cuda --nprocs 2 --sizes 4K 64M --json results/cuda.json

Every rank holds its tensors on a GPU (ranks take the visible GPUs round-robin: on one GPU every
rank shares it, as the tests do). Two communicators per rank: ``ipc`` (the default path; the
benchmark fails when it did not come up) and ``staged`` (``BRAID_CUDA_IPC=0`` at its set-up). For
each op and size S, every rank at a gloo barrier first, ``--repeats`` calls then one synchronize;
a round's time per call is the slowest rank's, the result the median over ``--rounds``, the two
paths taking turns (the order alternates every round).

S is nccl-tests' size: the tensor of all_reduce, reduce_scatter's input, all_gather's output,
all_to_all's input. algbw = S / time.

The floor: the device memory traffic, per rank, of an algorithm that reads its peers' tensors in
place (no copy into a scratch buffer): all_reduce 3S - S/N (reduce one N-th from every rank, then
gather the other N-1 N-ths), reduce_scatter S + S/N, all_gather and all_to_all 2S (each byte read
once, written once), over a device copy's rate measured in the same run with every rank copying at
once (bytes read plus written per second: on a shared GPU each rank's share of it). ``vs floor``
= floor time / measured time (target >= 0.8 at 64-256 MiB); ``latency`` is the time of a 4 KiB
call (target <= 15 us). Before timing, every op and size is checked once on rank-distinct small
integers (float32 sums exact) against the result computed locally.

--json writes {"benchmark": "cuda", "date", "machine", "config", "records": [{"world_size", "op",
"size_bytes", "ipc_s", "staged_s", "floor_s", "vs_floor", "vs_staged", "exact"}], "copy_rate"}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from braid import comm
from braid.comm.core.build_info import is_cuda_build

from . import launch, report, turns

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
DEFAULT_SIZES = ("4K", "64K", "1M", "16M", "64M", "256M")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...]  # bytes
    ops: tuple[str, ...]
    repeats: int
    rounds: int
    timeout: float
    json_path: str | None
    started: float


def _parse_size(text: str) -> int:
    unit = UNITS.get(text[-1:].upper(), 1)
    digits = text[:-1] if text[-1:].upper() in UNITS else text
    if not digits.isdigit() or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"a size is a positive integer with K, M or G, got {text!r}")
    return int(digits) * unit


def floor_bytes(op: str, size: int, world: int) -> float:
    """Device memory bytes (read + written) one rank must move for ``op`` of nccl-tests size
    ``size`` among ``world`` ranks when it reads its peers' tensors in place."""
    part = size / world
    if op == "all_reduce":
        return 3 * size - part
    if op == "reduce_scatter":
        return size + part
    if op in ("all_gather", "all_to_all"):
        return 2 * size
    raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")


def _timed(fns: dict[str, Callable[[], object]], config: Config) -> dict[str, float]:
    """Seconds per call of each of ``fns`` (a warm-up first): the median over rounds of the slowest
    rank; the order of ``fns`` alternates every round."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(config.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            begin = time.perf_counter()
            for _ in range(config.repeats):
                fns[name]()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - begin) / config.repeats)
    return {n: statistics.median(turns.max_over_ranks(t)) for n, t in times.items()}


def _ints(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s check input: small integers whose float32 sums over a few ranks are exact."""
    return (torch.arange(numel, dtype=torch.int64) * (rank + 3) % 1009).to(torch.float32)


def _buffers(op: str, size: int, world: int, device: torch.device,
             fill: Callable[[int], torch.Tensor] | None):
    """(output, input) of ``op`` at nccl-tests size ``size`` (float32), filled by ``fill(numel)``
    or with zeros; input None for all_reduce (in place)."""
    n = size // 4 // world * world  # whole elements, divisible by world
    make = (lambda k: fill(k).to(device)) if fill else (lambda k: torch.zeros(k, device=device))
    if op == "all_reduce":
        return make(n), None
    if op == "reduce_scatter":
        return torch.zeros(n // world, device=device), make(n)
    if op == "all_gather":
        return torch.zeros(n, device=device), make(n // world)
    return torch.zeros(n, device=device), make(n)


def _call(c, op: str, out: torch.Tensor, inp: torch.Tensor | None) -> None:
    if op == "all_reduce":
        c.all_reduce(out)
    else:
        getattr(c, op)(out, inp)


def _expected(op: str, size: int, rank: int, world: int) -> torch.Tensor:
    n = size // 4 // world * world
    if op == "all_reduce":
        return sum(_ints(r, n) for r in range(world))
    if op == "reduce_scatter":
        return sum(_ints(r, n) for r in range(world)).chunk(world)[rank]
    if op == "all_gather":
        return torch.cat([_ints(r, n // world) for r in range(world)])
    return torch.cat([_ints(r, n).chunk(world)[rank] for r in range(world)])


def _exact(c, op: str, size: int, device: torch.device, rank: int, world: int) -> bool:
    out, inp = _buffers(op, size, world, device, lambda k: _ints(rank, k))
    _call(c, op, out, inp)
    ok = torch.tensor([int(torch.equal(out.cpu(), _expected(op, size, rank, world)))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _copy_rate(device: torch.device, config: Config) -> float:
    """Bytes read plus written per second by one rank's device copy, every rank copying at once."""
    n = max(config.sizes) // 4
    src, dst = torch.zeros(n, device=device), torch.empty(n, device=device)
    t = _timed({"copy": lambda: dst.copy_(src)}, config)["copy"]
    return 2 * n * 4 / t


def _run_rank(rank: int, world_size: int, store_port: int | None, config: Config) -> int:
    launch.start_rank(rank, world_size, store_port, bind="none", threads=1, timeout_s=config.timeout)
    records = []
    try:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        ipc = comm.init(timeout=config.timeout, device=device)
        staged = comm.init(timeout=config.timeout, device=device)
        probe = torch.zeros(1, device=device)
        ipc.all_reduce(probe)
        with launch.scoped_environ({"BRAID_CUDA_IPC": "0"}):
            staged.all_reduce(probe)
        path = ipc._c.device_path(device.index)
        if path != "ipc":
            raise RuntimeError(f"the device-to-device path did not come up: {path}")
        rate = _copy_rate(device, config)
        progress = report.Progress(len(config.ops) * len(config.sizes), enabled=rank == 0)
        for op in config.ops:
            for size in config.sizes:
                progress("ipc/staged", op, size)
                exact = _exact(ipc, op, size, device, rank, world_size) and \
                    _exact(staged, op, size, device, rank, world_size)
                out, inp = _buffers(op, size, world_size, device, None)
                t = _timed({"ipc": lambda op=op, out=out, inp=inp: _call(ipc, op, out, inp),
                            "staged": lambda op=op, out=out, inp=inp: _call(staged, op, out, inp)}, config)
                floor_s = floor_bytes(op, size, world_size) / rate
                records.append({"world_size": world_size, "op": op, "size_bytes": size, "ipc_s": t["ipc"],
                                "staged_s": t["staged"], "floor_s": floor_s,
                                "vs_floor": round(floor_s / t["ipc"], 3),
                                "vs_staged": round(t["staged"] / t["ipc"], 3), "exact": exact})
        progress.close()
        ipc.close()
        staged.close()
        launch.end_gloo_use()
    finally:
        dist.destroy_process_group()
    return _report(config, records, world_size, rate) if rank == 0 else 0


def _report(config: Config, records: list[dict], world_size: int, rate: float) -> int:
    print(f"# {torch.cuda.get_device_name()}, {world_size} ranks on {torch.cuda.device_count()} GPU(s); "
          f"device copy {rate / 1e9:.0f} GB/s (read + write) per rank with every rank copying")
    print("#  op              size   ipc algbw  staged algbw  ipc time (us)  vs staged  vs floor  exact")
    for r in records:
        s = r["size_bytes"]
        print(f"  {r['op']:<14} {report.human_bytes(s):>8}  {s / r['ipc_s'] / 1e9:9.2f}  "
              f"{s / r['staged_s'] / 1e9:12.2f}  {r['ipc_s'] * 1e6:13.1f}  {r['vs_staged']:9.2f}  "
              f"{r['vs_floor']:8.2f}  {r['exact']}")
    bad = [r for r in records if not r["exact"]]
    if bad:
        where = (f"{r['op']} {report.human_bytes(r['size_bytes'])}" for r in bad)
        print("# wrong results at: " + ", ".join(where))
    print(f"# wall time {time.time() - config.started:.1f} s", flush=True)
    if config.json_path:
        path = config.json_path
        if world_size != 2:
            path = path.replace(".json", f"-{world_size}.json")
        report.write_json(path, {
            "benchmark": "cuda", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": dict(report.machine_info(), torch=torch.__version__, gpu=torch.cuda.get_device_name()),
            "config": {"world_size": world_size, "sizes": list(config.sizes), "ops": list(config.ops),
                       "repeats": config.repeats, "rounds": config.rounds},
            "copy_rate": rate, "records": records})
    return launch.EXIT_FINDINGS if bad else 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the CUDA collectives benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=(2, 4),
                   help="rank counts to run, each a run of its own (default 2 4)")
    p.add_argument("--sizes", type=_parse_size, nargs="+", default=tuple(map(_parse_size, DEFAULT_SIZES)),
                   help="sizes with K, M or G (default: " + " ".join(DEFAULT_SIZES) + ")")
    p.add_argument("--ops", nargs="+", choices=OPS, default=OPS, help="collectives (default: all)")
    p.add_argument("--repeats", type=int, default=10, help="calls per timed round (default 10)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds; the median is reported (default 7)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take (default 120)")
    p.add_argument("--deadline", type=float, default=900.0,
                   help="seconds the whole run may take (default 900)")
    p.add_argument("--json", dest="json_path", metavar="PATH", type=report.output_path(".json"), default=None,
                   help="also write the results here (4 ranks: PATH with -4 before .json)")
    args = p.parse_args(argv)
    if any(n < 2 for n in args.nprocs):
        p.error(f"--nprocs takes rank counts of at least 2, got {' '.join(map(str, args.nprocs))}")
    for name in ("repeats", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.timeout <= 0 or args.deadline <= 0:
        p.error("--timeout and --deadline must be positive")
    if not torch.cuda.is_available():
        print("braid.bench cuda: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return launch.EXIT_FAILED
    if not is_cuda_build():
        print("braid.bench cuda: this braid build has no CUDA (build it where torch has CUDA and nvcc "
              "is found)", file=sys.stderr)
        return launch.EXIT_FAILED
    config = Config(tuple(args.sizes), tuple(args.ops), args.repeats, args.rounds, args.timeout,
                    args.json_path, started)
    status = 0
    for nproc in args.nprocs:
        print(f"# braid.bench cuda: {nproc} ranks on {torch.cuda.device_count()} GPU(s)", flush=True)
        status = max(status, launch.spawn(_run_rank, nproc, args.timeout, started + args.deadline, config))
    return status


if __name__ == "__main__":
    sys.exit(main())
