"""Staging benchmark: braid's all_reduce on CUDA tensors (chunks through pinned host memory, the
path across hosts and where CUDA IPC is off: set here with BRAID_CUDA_IPC=0 in every rank) against
pinned copies between the GPU and the host. Needs a GPU and a braid build with CUDA.

    python -m braid.bench staging                            # 2 ranks on the visible GPU(s)
    python -m braid.bench staging --sizes 64 256 --json results/staging.json

Every rank holds a float32 tensor of S MiB on a GPU (ranks take the visible GPUs round-robin, so
at 2 ranks on one GPU both share its link to the host). Timed, each with every rank at a gloo
barrier first, ``--repeats`` calls then one synchronize; a round's time per call is the slowest
rank's, the result the median over ``--rounds``:

- ``d2h`` / ``h2d``: the tensor copied to a pinned host buffer / back (``non_blocking``, the
  current stream), every rank at once: what any staging of those bytes pays at least;
- ``host``: braid's all_reduce of the same bytes on a CPU tensor: the host collective alone;
- ``cuda``: braid's all_reduce on the CUDA tensor: copies down, the host collective and copies up,
  pipelined in chunks of ``staging_chunk_bytes`` with ``staging_slots`` in flight.

Reported per size: GB/s of each (the tensor's bytes over the time); ``vs copy`` = cuda's GB/s over
the slower copy direction's (the pipeline's target is >= 0.80); ``vs floor`` = max(d2h, h2d,
host) / cuda: 1.0 when the pipeline hides everything behind its slowest stage. Then, at the
largest size, cuda's GB/s for each staging_chunk_bytes x staging_slots of ``--chunks`` x
``--slots``. The timed calls reduce zeros (the sum stays put); before timing, every size and
setting is checked once on rank-distinct small integers, whose float32 sums are exact.

--json writes {"benchmark": "staging", "date", "machine", "config", "records": [{"size_bytes",
"chunk_bytes", "slots", "d2h_s", "h2d_s", "host_s", "cuda_s", "vs_copy", "vs_floor", "exact"}]};
sweep records have only the cuda time, vs_copy and exact.
"""
from __future__ import annotations

import argparse
import os
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

MiB = 1 << 20
DEFAULT_SIZES = (16, 64, 256)
DEFAULT_CHUNKS = (1, 2, 4, 8, 16)
DEFAULT_SLOTS = (2, 3, 4)


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...]  # MiB
    chunks: tuple[int, ...]  # MiB
    slots: tuple[int, ...]
    repeats: int
    rounds: int
    timeout: float
    json_path: str | None
    started: float


def _timed(fn: Callable[[], object], config: Config) -> float:
    """Seconds per call of ``fn`` (a warm-up first): the median over rounds of the slowest rank."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(config.rounds):
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(config.repeats):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - begin) / config.repeats)
    return statistics.median(turns.max_over_ranks(times))


def _exact(c, numel: int, device: torch.device, rank: int, world_size: int) -> bool:
    """One all_reduce of rank-distinct small integers on ``device``, against their exact sum; true
    only when every rank got it."""
    def ints(r: int) -> torch.Tensor:
        return (torch.arange(numel, dtype=torch.int64) * (r + 3) % 1009).to(torch.float32)

    t = ints(rank).to(device)
    c.all_reduce(t)
    want = sum(ints(r) for r in range(world_size))
    ok = torch.tensor([int(torch.equal(t.cpu(), want))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _measure(c, size_mib: int, device: torch.device, rank: int, world_size: int, config: Config,
             copies: bool) -> dict:
    numel = size_mib * MiB // 4
    exact = _exact(c, numel, device, rank, world_size)
    x = torch.zeros(numel, device=device)
    record = {"size_bytes": numel * 4, "exact": exact, "cuda_s": _timed(lambda: c.all_reduce(x), config)}
    if copies:
        pinned = torch.empty(numel, pin_memory=True)
        cpu = torch.zeros(numel)
        record.update(d2h_s=_timed(lambda: pinned.copy_(x, non_blocking=True), config),
                      h2d_s=_timed(lambda: x.copy_(pinned, non_blocking=True), config),
                      host_s=_timed(lambda: c.all_reduce(cpu), config))
        slowest = max(record["d2h_s"], record["h2d_s"], record["host_s"])
        record["vs_floor"] = round(slowest / record["cuda_s"], 3)
    return record


def _run_rank(rank: int, world_size: int, store_port: int | None, config: Config) -> int:
    # The staging pipeline itself: ranks on one host would otherwise go device to device (CUDA
    # IPC, measured by ``python -m braid.bench cuda``).
    os.environ["BRAID_CUDA_IPC"] = "0"
    launch.start_rank(rank, world_size, store_port, bind="none", threads=1, timeout_s=config.timeout)
    records = []
    try:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        progress = report.Progress(len(config.sizes) + len(config.chunks) * len(config.slots),
                                   enabled=rank == 0)
        c = comm.init(timeout=config.timeout, device=device)
        for size in config.sizes:
            progress("cuda", "all_reduce", size * MiB)
            records.append(_measure(c, size, device, rank, world_size, config, copies=True))
        c.close()
        copy_s = {r["size_bytes"]: max(r["d2h_s"], r["h2d_s"]) for r in records}
        for chunk in config.chunks:
            for slots in config.slots:
                progress(f"chunk {chunk} MiB x {slots}", "all_reduce", max(config.sizes) * MiB)
                c = comm.init(timeout=config.timeout, device=device, staging_chunk_bytes=chunk * MiB,
                              staging_slots=slots)
                records.append(dict(_measure(c, max(config.sizes), device, rank, world_size, config,
                                             copies=False), chunk_bytes=chunk * MiB, slots=slots))
                c.close()
        progress.close()
        for r in records:
            r["vs_copy"] = round(copy_s[r["size_bytes"]] / r["cuda_s"], 3)
        launch.end_gloo_use()
    finally:
        dist.destroy_process_group()
    return _report(config, records, world_size) if rank == 0 else 0


def _gbs(nbytes: int, seconds: float | None) -> str:
    return "-" if seconds is None else f"{nbytes / seconds / 1e9:8.2f}"


def _report(config: Config, records: list[dict], world_size: int) -> int:
    print(f"# {torch.cuda.get_device_name()}, {world_size} ranks; GB/s = tensor bytes / time")
    print("#  size (MiB)  d2h GB/s  h2d GB/s  host GB/s  cuda GB/s  vs copy  vs floor  exact")
    for r in records:
        if "chunk_bytes" not in r:
            print(f"  {r['size_bytes'] // MiB:>10}  {_gbs(r['size_bytes'], r['d2h_s'])}  "
                  f"{_gbs(r['size_bytes'], r['h2d_s'])}   {_gbs(r['size_bytes'], r['host_s'])}   "
                  f"{_gbs(r['size_bytes'], r['cuda_s'])}  {r['vs_copy']:7.2f}  {r['vs_floor']:8.2f}"
                  f"  {r['exact']}")
    print(f"\n# {max(config.sizes)} MiB: cuda GB/s by staging_chunk_bytes (rows) x staging_slots (columns)")
    print("#  chunk (MiB)" + "".join(f"  slots {s:>2} (vs copy)" for s in config.slots))
    sweep = {(r["chunk_bytes"], r["slots"]): r for r in records if "chunk_bytes" in r}
    for chunk in config.chunks:
        cells = [sweep[(chunk * MiB, s)] for s in config.slots]
        print(f"  {chunk:>11}" + "".join(f"  {_gbs(r['size_bytes'], r['cuda_s'])} ({r['vs_copy']:5.2f})   "
                                         for r in cells))
    bad = [r for r in records if not r["exact"]]
    if bad:
        where = [f"{r['size_bytes'] // MiB} MiB"
                 + (f" chunk {r['chunk_bytes'] // MiB} MiB x {r['slots']}" if "chunk_bytes" in r else "")
                 for r in bad]
        print("# wrong sums at: " + ", ".join(where))
    print(f"# wall time {time.time() - config.started:.1f} s", flush=True)
    if config.json_path:
        report.write_json(config.json_path, {
            "benchmark": "staging", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": dict(report.machine_info(), torch=torch.__version__, gpu=torch.cuda.get_device_name()),
            "config": {"world_size": world_size, "sizes_mib": list(config.sizes),
                       "chunks_mib": list(config.chunks), "slots": list(config.slots),
                       "repeats": config.repeats, "rounds": config.rounds},
            "records": records})
    return launch.EXIT_FINDINGS if bad else 0


def _positive_ints(p: argparse.ArgumentParser, name: str, values: Sequence[int]) -> tuple[int, ...]:
    if not values or any(v < 1 for v in values):
        p.error(f"--{name} takes positive integers, got {' '.join(map(str, values))}")
    return tuple(values)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the staging benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2), round-robin over the GPUs")
    p.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES,
                   help="tensor sizes in MiB (default: " + " ".join(map(str, DEFAULT_SIZES)) + ")")
    p.add_argument("--chunks", type=int, nargs="+", default=DEFAULT_CHUNKS,
                   help="staging_chunk_bytes of the sweep, in MiB (default: "
                        + " ".join(map(str, DEFAULT_CHUNKS)) + ")")
    p.add_argument("--slots", type=int, nargs="+", default=DEFAULT_SLOTS,
                   help="staging_slots of the sweep (default: " + " ".join(map(str, DEFAULT_SLOTS)) + ")")
    p.add_argument("--repeats", type=int, default=5, help="calls per timed round (default 5)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds; the median is reported (default 7)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take (default 120)")
    p.add_argument("--deadline", type=float, default=900.0,
                   help="seconds the whole run may take (default 900)")
    p.add_argument("--json", dest="json_path", metavar="PATH", type=report.output_path(), default=None,
                   help="also write the results here")
    args = p.parse_args(argv)
    if args.nproc < 2:
        p.error(f"--nproc must be at least 2, got {args.nproc}")
    for name in ("repeats", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.timeout <= 0 or args.deadline <= 0:
        p.error("--timeout and --deadline must be positive")
    config = Config(_positive_ints(p, "sizes", args.sizes), _positive_ints(p, "chunks", args.chunks),
                    _positive_ints(p, "slots", args.slots), args.repeats, args.rounds, args.timeout,
                    args.json_path, started)
    if not torch.cuda.is_available():
        print("braid.bench staging: needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return launch.EXIT_FAILED
    if not is_cuda_build():
        print("braid.bench staging: this braid build has no CUDA (build it where torch has CUDA and "
              "nvcc is found)", file=sys.stderr)
        return launch.EXIT_FAILED
    print(f"# braid.bench staging: {args.nproc} ranks on {torch.cuda.device_count()} GPU(s)", flush=True)
    return launch.spawn(_run_rank, args.nproc, args.timeout, started + args.deadline, config)


if __name__ == "__main__":
    sys.exit(main())
