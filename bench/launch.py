"""How the multi-rank benchmarks start their ranks: spawned here around a TCPStore, or under torchrun.

A benchmark gives a module-level ``fn(rank, world_size, store_port, *args) -> exit status``
(``store_port`` is None under torchrun, whose env:// rendezvous then applies). :func:`spawn` hosts
the store, starts one process per rank and watches them: when one fails, the others get a few
seconds to report their side, then are stopped; past the deadline every rank is stopped.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

EXIT_FAILED = 1
EXIT_FINDINGS = 3  # the run finished, but a result was wrong or a peer failed
# After a rank fails, how long the others get to report their side before being stopped (braid
# and gloo notice a dead peer within milliseconds, so this only bounds the wait); also how long
# rank 0 gets past the deadline to print its results.
FAILURE_GRACE_S = 5.0

RankFn = Callable[..., int]


@contextlib.contextmanager
def scoped_environ(values: dict):
    """Sets environment variables for the block and restores what was there before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launcher() -> str:
    """How the ranks start: under a launcher that set RANK and WORLD_SIZE, or spawned here."""
    return "torchrun" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "spawn"


def resolve_bind(bind: str, world_size: int) -> str:
    """``auto`` is Open MPI's default: bind each rank to a core unless ranks outnumber the cores."""
    if bind == "auto":
        return "core" if world_size <= len(os.sched_getaffinity(0)) else "none"
    return bind


def bind_to_core(local_rank: int) -> None:
    """Pins this process (and the threads it starts later) to one CPU, as Open MPI's mpirun does
    by default when there are no more ranks than cores, so braid and its peers run under the same
    placement. Without it a scheduler may pack both ranks onto one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[local_rank % len(cpus)]})


def init_gloo(rank: int, world_size: int, store_port: int | None, timeout_s: float) -> None:
    """Joins the gloo process group of the run (braid's communicators bootstrap on its store)."""
    timeout = timedelta(seconds=timeout_s)
    if store_port is None:  # torchrun: env:// rendezvous
        dist.init_process_group("gloo", timeout=timeout)
    else:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def start_rank(rank: int, world_size: int, store_port: int | None, *, bind: str, threads: int,
               timeout_s: float) -> None:
    """A rank's start: placement (``bind`` "core" pins it), torch threads, the run's gloo group."""
    if bind == "core":
        bind_to_core(int(os.environ.get("LOCAL_RANK", rank)))
    torch.set_num_threads(threads)
    init_gloo(rank, world_size, store_port, timeout_s)


def end_gloo_use() -> None:
    """Call before destroying the run's gloo group, on every rank, once nothing is in flight.

    Collects garbage (DTensor/FSDP2 modules and finished works hold the group and tensors) and
    waits at a barrier until every rank is done with gloo: gloo's worker threads drop finished
    work, and its tensors' Python objects, on their own; one still doing so while the interpreter
    shuts down cannot take the GIL and aborts the process ("terminate called without an active
    exception")."""
    gc.collect()
    dist.barrier()


def run_rank_reporting(fn: RankFn, rank: int, world_size: int, store_port: int | None, *args) -> int:
    """Runs ``fn``; an exception is printed with the rank and becomes EXIT_FAILED."""
    try:
        return fn(rank, world_size, store_port, *args)
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 -- reported here with the rank; the exit status carries it
        sys.stderr.write(f"braid.bench: rank {rank} (pid {os.getpid()}) failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        return EXIT_FAILED


def _die_with(parent_pid: int) -> None:
    """Makes the kernel kill this rank when the launcher dies, however it dies (SIGKILL included):
    a rank left alone would run the whole benchmark with nobody to enforce its deadline."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup is all there is
        return
    if os.getppid() != parent_pid:  # it died before the line above took effect
        os._exit(EXIT_FAILED)


def _spawned_rank(fn: RankFn, rank: int, world_size: int, store_port: int, args: tuple,
                  parent_pid: int) -> None:
    _die_with(parent_pid)
    sys.exit(run_rank_reporting(fn, rank, world_size, store_port, *args))


def exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM handler of a launcher: unwinds it, so that its cleanup stops the ranks."""
    raise SystemExit(128 + signum)


def spawn(fn: RankFn, nproc: int, timeout_s: float, deadline: float, *args) -> int:
    """Hosts the store, starts ``nproc`` ranks running ``fn`` and waits for them until ``deadline``
    (a time.time()); returns the exit status (the worst of the ranks')."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = multiprocessing.get_context("spawn")
    me = os.getpid()
    procs = [ctx.Process(target=_spawned_rank, args=(fn, r, nproc, store.port, args, me), name=f"rank{r}")
             for r in range(nproc)]
    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        for p in procs:
            p.start()
        # Past the deadline rank 0 may still be printing what it has: give it time.
        return _watch(procs, deadline + FAILURE_GRACE_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join()
        signal.signal(signal.SIGTERM, previous)


def _watch(procs: list[multiprocessing.Process], deadline: float) -> int:
    status = 0
    running = {p.sentinel: p for p in procs}
    while running:
        ready = multiprocessing.connection.wait(list(running), timeout=max(deadline - time.time(), 0))
        if not ready:
            ranks = sorted(procs.index(p) for p in running.values())
            print(f"braid.bench: ranks {ranks} did not finish before the deadline (--deadline); "
                  "stopping them", file=sys.stderr)
            return EXIT_FAILED
        for sentinel in ready:
            p = running.pop(sentinel)
            p.join()
            if p.exitcode == EXIT_FINDINGS:
                status = EXIT_FINDINGS
            elif p.exitcode != 0:
                multiprocessing.connection.wait(list(running), timeout=FAILURE_GRACE_S)
                others = sorted(procs.index(q) for q in running.values() if q.is_alive())
                how = (f"was killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                       else f"exited with status {p.exitcode}")
                print(f"braid.bench: rank {procs.index(p)} (pid {p.pid}) {how}"
                      + (f"; stopping ranks {others}" if others else ""), file=sys.stderr)
                return EXIT_FAILED
    return status
