"""The floors of CUDA tensors moving between processes on one GPU, with no braid in the way: what
two (or more) processes sharing a GPU can do at best, to read ``python -m braid.bench cuda``'s
figures against. Needs a GPU; Triton for the device-flag probe.

    python -m braid.bench gpufloor                      # 2 processes on the visible GPU 0
    python -m braid.bench gpufloor --nprocs 4 --json results/gpufloor.json

Three probes, each process on the same GPU, started together at a host barrier:

- ``copy``: a device-to-device copy of ``--copy-mib`` MiB, ``--repeats`` times, by one process
  alone and then by every process at once: whether the processes' kernels share the GPU at the
  same time (the concurrent rate per process near the lone one over N) or take turns.
- ``event``: a round trip of stream-ordered hand-offs through interprocess CUDA events, as braid's
  IPC collectives order their pieces: process 0 queues a one-element kernel and records its event,
  tells process 1 through shared host memory that the record is queued; process 1's stream waits
  on that event, runs its own kernel, records, and tells process 0, whose stream waits on it; N
  round trips, timed on process 0 from the first launch to the end of its stream. Also the same
  round trips through shared host memory alone (no CUDA), the host part of it.
- ``flag``: the same round trips with no host in the loop: each process queues N kernels that
  spin on a flag in process 0's device memory (opened by the others through CUDA IPC) until it
  holds their turn, then write the next turn. Kernels of two processes run at the same time only
  where the GPU runs several processes' work at once (MPS); otherwise a spinning kernel holds the
  GPU for its time slice, which this probe shows as the round trip. Spins are bounded
  (``--max-spins``): a turn never seen ends the probe with ``timed_out`` instead of a hang.

Reported: GB/s (read + write) alone and concurrent, round-trip microseconds of each probe.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone

MiB = 1 << 20


def _flag_kernel():
    import triton
    import triton.language as tl

    # Turn values change every launch: not specialized (Triton would compile again for 1 or 16).
    @triton.jit(do_not_specialize=["wait_for", "write", "max_spins"])
    def spin_then_write(flag_ptr, spins_ptr, wait_for, write, max_spins):
        seen = tl.atomic_add(flag_ptr, 0)  # an atomic read, never cached
        spins = 0
        # a negative flag: a turn was given up (spins ran out); every later kernel returns at once
        while (seen != wait_for) & (seen >= 0) & (spins < max_spins):
            seen = tl.atomic_add(flag_ptr, 0)
            spins += 1
        tl.atomic_xchg(flag_ptr, tl.where(seen == wait_for, write, -1))
        tl.store(spins_ptr, spins)

    return spin_then_write


def _wait_turn(shared, turn: int, deadline: float) -> None:
    while shared.value != turn:
        if time.monotonic() > deadline:
            raise TimeoutError(f"host turn {turn} not reached")


def _rank(rank: int, world: int, args: dict, barrier, shared, handles, results, flag) -> None:
    import torch

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    stream = torch.cuda.current_stream()
    out: dict = {}
    deadline = time.monotonic() + args["deadline"]

    # copy: alone (rank 0), then every rank at once
    src = torch.empty(args["copy_mib"] * MiB, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()

    def copies() -> float:
        t = time.perf_counter()
        for _ in range(args["repeats"]):
            dst.copy_(src)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / args["repeats"]

    barrier.wait()
    if rank == 0:
        out["copy_alone_s"] = copies()
    barrier.wait()
    out["copy_concurrent_s"] = copies()
    barrier.wait()

    # event: host-only round trips, then event hand-offs
    n = args["round_trips"]
    x = torch.zeros(1, device=dev)
    if rank < 2:
        peer = 1 - rank
        shared.value = 0
        barrier.wait()
        t = time.perf_counter()
        for i in range(n):
            if rank == 0:
                shared.value = 2 * i + 1
                _wait_turn(shared, 2 * i + 2, deadline)
            else:
                _wait_turn(shared, 2 * i + 1, deadline)
                shared.value = 2 * i + 2
        if rank == 0:
            out["host_round_trip_us"] = (time.perf_counter() - t) / n * 1e6
        mine = torch.cuda.Event(interprocess=True)
        mine.record(stream)
        handles[rank] = bytes(mine.ipc_handle())
        barrier.wait()
        theirs = torch.cuda.Event.from_ipc_handle(dev, handles[peer])
        torch.cuda.synchronize()
        shared.value = 0
        barrier.wait()
        t = time.perf_counter()
        for i in range(n):
            if rank == 0:
                x.add_(1)
                mine.record(stream)
                shared.value = 2 * i + 1
                _wait_turn(shared, 2 * i + 2, deadline)
                stream.wait_event(theirs)
            else:
                _wait_turn(shared, 2 * i + 1, deadline)
                stream.wait_event(theirs)
                x.add_(1)
                mine.record(stream)
                shared.value = 2 * i + 2
        torch.cuda.synchronize()
        if rank == 0:
            out["event_round_trip_us"] = (time.perf_counter() - t) / n * 1e6
    else:
        barrier.wait()
        barrier.wait()
        barrier.wait()
    barrier.wait()

    # flag: kernels spinning on a flag in rank 0's memory, turns passed around the ranks
    try:
        kernel = _flag_kernel()
    except ImportError as e:
        out["flag_error"] = f"no Triton: {e}"
        kernel = None
    if kernel is not None and flag is not None:
        spins = torch.zeros(args["flag_trips"], dtype=torch.int32, device=dev)
        kernel[(1,)](flag, spins, -5, -7, 1)  # compiled before timing: one spin, then -1 written
        torch.cuda.synchronize()
        barrier.wait()
        if rank == 0:
            flag.zero_()
            torch.cuda.synchronize()
        barrier.wait()
        t = time.perf_counter()
        trips = args["flag_trips"]
        for i in range(trips):
            turn = i * world + rank
            kernel[(1,)](flag, spins[i:], turn, turn + 1, args["max_spins"])
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        final = int(flag.item())
        if rank == 0:
            out["flag_round_trip_us"] = elapsed / trips * 1e6
            out["flag_timed_out"] = final != trips * world
            out["flag_max_spins"] = int(spins.max().item())
        barrier.wait()
    results[rank] = out


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=2, help="processes on GPU 0 (default 2)")
    p.add_argument("--copy-mib", type=int, default=256, help="bytes of the copy probe in MiB (default 256)")
    p.add_argument("--repeats", type=int, default=20, help="copies per timing (default 20)")
    p.add_argument("--round-trips", type=int, default=2000, help="event and host round trips (default 2000)")
    p.add_argument("--flag-trips", type=int, default=200, help="device-flag turns per process (default 200)")
    p.add_argument("--max-spins", type=int, default=1 << 20,
                   help="spins before a flag kernel gives up its turn (default 1048576)")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds the probes may take (default 120)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results here")
    args = p.parse_args(argv)
    for name in ("nprocs", "copy_mib", "repeats", "round_trips", "flag_trips", "max_spins"):
        if getattr(args, name) < (2 if name == "nprocs" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'nprocs' else 1}, "
                    f"got {getattr(args, name)}")
    import torch

    if not torch.cuda.is_available():
        print(f"{p.prog}: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")  # torch's: CUDA tensors among the arguments travel by IPC handle
    manager = ctx.Manager()
    handles, results = manager.dict(), manager.dict()
    barrier = ctx.Barrier(args.nprocs, timeout=args.deadline)
    shared = ctx.Value("q", 0, lock=False)
    try:  # the flag the device probe's kernels pass around, shared with every process (CUDA IPC)
        import triton  # noqa: F401

        flag = torch.zeros(1, dtype=torch.int32, device="cuda:0")
    except ImportError:
        flag = None
    procs = [ctx.Process(target=_rank,
                         args=(r, args.nprocs, vars(args), barrier, shared, handles, results, flag))
             for r in range(args.nprocs)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(args.deadline + 60)
    bad = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    if bad:
        codes = [procs[r].exitcode for r in bad]
        print(f"{p.prog}: process(es) {bad} failed (exit codes {codes})", file=sys.stderr)
        return 1
    r0 = dict(results[0])
    per = args.copy_mib * MiB * 2  # read + write
    alone = per / r0["copy_alone_s"] / 1e9
    concurrent = [per / dict(results[r])["copy_concurrent_s"] / 1e9 for r in range(args.nprocs)]
    print(f"# {torch.cuda.get_device_name(0)}, {args.nprocs} processes on one GPU, torch {torch.__version__}")
    print(f"copy {args.copy_mib} MiB: alone {alone:.0f} GB/s; all at once "
          f"{min(concurrent):.0f}-{max(concurrent):.0f} GB/s each, {sum(concurrent):.0f} GB/s together")
    print(f"host round trip (shared memory): {r0['host_round_trip_us']:.1f} us")
    print(f"event round trip (interprocess events + host hand-off): {r0['event_round_trip_us']:.1f} us")
    if "flag_round_trip_us" in r0:
        print(f"device-flag round trip ({args.nprocs} turns): {r0['flag_round_trip_us']:.1f} us"
              f"{' (TIMED OUT: a turn was never seen)' if r0['flag_timed_out'] else ''}; "
              f"most spins {r0['flag_max_spins']}")
    else:
        print(f"device-flag probe: {r0.get('flag_error')}")
    if args.json:
        with open(args.json, "w") as f:
            when = datetime.now(timezone.utc).isoformat(timespec="seconds")
            json.dump({"benchmark": "gpufloor", "date": when,
                       "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "config": vars(args),
                       "copy_alone_gbs": alone, "copy_concurrent_gbs": concurrent,
                       **{k: v for k, v in r0.items() if not k.startswith("copy")}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
