"""Collectives benchmark: braid against gloo, Open MPI and DeepSpeed, printed like nccl-tests.

    python -m braid.bench collectives                   # spawns --nproc ranks (default 2)
    python -m braid.bench collectives --nproc 4 --ops all_reduce --max-bytes 1M --json r.json
    torchrun --nproc-per-node 4 -m braid.bench collectives   # under a launcher: no spawning
    python -m braid.bench collectives --impls braid --ops all_reduce --trace on,off   # recorder's cost

Launch. Without RANK and WORLD_SIZE in the environment this process hosts a TCPStore on a free
loopback port and starts the ranks: under ``mpirun --oversubscribe --bind-to none -np N`` when
Open MPI is measured (mpi4py imports and mpirun exists; mpi_rank.py is the ranks' entry point),
else spawned and watched here (when one fails, the others get a few seconds to report their
side, then are stopped, and the run fails). The whole run has a deadline (--deadline). Every rank
joins a gloo process group and a braid communicator over that store, under mpirun also
MPI_COMM_WORLD, and, when deepspeed imports, loads DeepSpeed's shared-memory all_reduce
(deepspeed_peer.py; all_reduce only): these implementations run in the same processes, their
timed batches alternating at each op and size, so a slow phase of the machine falls on all of
them. Every collective wait of braid and gloo has a deadline (--timeout). Under torchrun the
ranks are torchrun's, and Open MPI is left out. Rank 0 prints and writes the results; the other
ranks stay quiet.

Measurement (protocol.py), on zero-filled buffers: warm-up, then batches of k back-to-back calls
(k from --time-budget, or --iters), a barrier of the implementation under test before each
batch; the time of a batch is its slowest rank's, the reported time the median over batches.
#wrong comes from one more call on fresh buffers of small integers, compared with the exact
result on every rank.

Columns: size = S in bytes, the whole message (all_reduce, broadcast: the tensor; reduce_scatter:
the input, n * output; all_gather: the output, n * input; all_to_all(v): what each rank sends;
send_recv: what each rank sends to the next); count = elements of S; time in us;
algbw = S / time; busbw = algbw * 2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter,
all_gather and all_to_all(v), 1 for broadcast and send_recv (GB/s = 1e9 B/s). Then, per peer,
braid's busbw over the peer's per op and size: >1 means braid is faster.

--trace: braid's flight recorder on (its default) or off; ``on,off`` measures braid twice on the
same communicator, recording (``braid``) and with recording paused (``braid-untraced``), their
batches alternating like any two implementations: the ratio table ``braid / braid-untraced``
is the recorder's cost (below 1: slower with it).

--json writes::

    {"benchmark": "collectives", "date": ISO 8601 UTC, "machine": {hostname, cpu, logical_cpus,
     usable_cpus, memory_gib, load_average, platform, python, torch, numpy, braid, mpi_library,
     deepspeed},
     "config": {world_size, launcher, ops, impls, dtype, sizes, warmup, batches, time_budget_s,
     iters, timeout_s, bind, trace},
     "records": [{"impl", "op", "world_size", "size", "bytes", "count", "dtype", "time_us",
                  "algbw_gbps", "busbw_gbps", "wrong", "iters"}, ...]}

where ``size`` is the size asked for (--min-bytes .. --max-bytes) and ``bytes`` what moved (an op
that splits the message rounds it down to whole pieces per rank), load_average is the host's 1, 5
and 15 minute load at launch (other work on the host skews
every figure) and a record's ``iters`` the calls per timed batch. --plot draws busbw against size.

Exit status: 0; 1 when a rank or the setup failed; 3 when the run finished but a result had
wrong elements.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from importlib import metadata

import numpy as np
import torch
import torch.distributed as dist
from braid import comm

from . import deepspeed_peer, launch, mpi_peer, protocol, report

IMPLS = ("braid", "braid-registered", "gloo", "mpi", "deepspeed")
REGISTERED = "braid-registered"  # braid with its inputs in registered buffers (Communicator.empty)
# braid with its flight recorder paused, beside braid (--trace on,off): the recorder's cost.
UNTRACED = "braid-untraced"
# The ranks stop measuring this long before --deadline (at most a quarter of the run), to report
# what they have before the launcher stops them.
DEADLINE_MARGIN_S = 60.0
# Under mpirun the ranks read the run's Config from the launcher's store under this key.
MPIRUN_CONFIG_KEY = "braid-bench/config"

# torch 2.13 renamed the single-tensor gloo collectives; older versions have the old names only.
_gloo_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_gloo_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Config:
    ops: tuple[str, ...]
    impls: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str
    timing: protocol.Timing
    timeout: float  # seconds, every collective and store wait
    deadline: float  # time.time() by which the whole run must be over
    started: float  # time.time() at launch
    launcher: str  # how the ranks started: "spawn" (by this module), "mpirun" (by this module) or "torchrun"
    bind: str  # "core": local rank r runs on the r-th usable CPU; "none": the scheduler decides
    machine: dict  # report.machine_info() at launch, before the ranks load the host
    json_path: str | None
    plot_path: str | None
    trace: tuple[str, ...] = ("on",)  # braid's flight recorder: ("on",), ("off",) or both, side by side

    def to_json(self) -> str:
        """For ranks started by mpirun, which read it from the launcher's store (JSON, not pickle:
        anything on the loopback can reach a TCPStore)."""
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> "Config":
        d = json.loads(text)
        d.update(ops=tuple(d["ops"]), impls=tuple(d["impls"]), sizes=tuple(d["sizes"]),
                 timing=protocol.Timing(**d["timing"]), trace=tuple(d["trace"]))
        return Config(**d)


class TorchBackend:
    """protocol.Backend over torch tensors. Timings and #wrong cross ranks through the gloo group.
    ``ops`` are the collectives it implements (the keys of ``calls``)."""

    def __init__(self, name: str, dtype: str,
                 calls: dict[str, Callable[[torch.Tensor, torch.Tensor], object]],
                 barrier: Callable[[], object]):
        self.name = name
        self._dtype = getattr(torch, dtype)
        self._calls = calls
        self._barrier = barrier
        self.ops = tuple(calls)

    def bind(self, op: str, send: np.ndarray, out_count: int | None
             ) -> tuple[Callable[[], None], Callable[[], np.ndarray]]:
        x = torch.from_numpy(send).to(self._dtype)
        out = x if out_count is None else torch.empty(out_count, dtype=self._dtype)
        fn = self._calls[op]
        # numpy has no bfloat16: the check compares in float32, which holds every value exactly.
        as_numpy = (lambda: out.float().numpy()) if self._dtype == torch.bfloat16 else out.numpy
        return (lambda: fn(out, x)), as_numpy

    def barrier(self) -> None:
        self._barrier()

    def reduce(self, values: Sequence[float], how: str) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM)
        return t.tolist()


@functools.lru_cache(maxsize=64)
def _split_kwargs(rank: int, world_size: int, count: int) -> dict[str, list[int]]:
    """all_to_allv's split sizes for this rank, as keyword arguments (cached: the call is timed)."""
    send, recv = protocol.split_counts("all_to_allv", rank, world_size, count)
    return {"input_split_sizes": list(send), "output_split_sizes": list(recv)}


def braid_backend(c, dtype: str, recording: bool | None = None, switch: dict | None = None) -> TorchBackend:
    """braid's collectives on communicator ``c``. ``recording`` (True / False): the backend
    ``braid`` / ``braid-untraced`` of a run measuring the flight recorder's cost, the two on the
    same communicator, each call switching the recorder to its setting when the other left it
    otherwise (``switch``, shared by the two, remembers the setting: the check costs both the same
    and the switch happens once per batch)."""
    calls = {
        "all_reduce": lambda out, x: c.all_reduce(x, op="sum"),
        "reduce_scatter": lambda out, x: c.reduce_scatter(out, x, op="sum"),
        "all_gather": lambda out, x: c.all_gather(out, x),
        "broadcast": lambda out, x: c.broadcast(x, src=protocol.ROOT),
        "all_to_all": lambda out, x: c.all_to_all(out, x),
        "all_to_allv": lambda out, x: c.all_to_all(out, x, **_split_kwargs(c.rank, c.world_size, x.numel())),
        "send_recv": lambda out, x: c.send_recv(x, (c.rank + 1) % c.world_size,
                                                out, (c.rank - 1) % c.world_size).wait(),
    }
    if recording is None:
        return TorchBackend("braid", dtype, calls, c.barrier)

    def switched(fn: Callable) -> Callable:
        def call(out: torch.Tensor, x: torch.Tensor) -> object:
            if switch["on"] is not recording:
                c.trace_enabled = switch["on"] = recording
            return fn(out, x)
        return call

    return TorchBackend("braid" if recording else UNTRACED, dtype,
                        {op: switched(fn) for op, fn in calls.items()}, c.barrier)


class RegisteredBackend(TorchBackend):
    """braid's collectives with each input in a buffer the host's ranks can read
    (``Communicator.empty``: the window path, one copy), the outputs private as in ``braid``.
    Binding is collective, as the buffers are; the suite binds in the same order on every rank."""

    def __init__(self, c, dtype: str):
        super().__init__(REGISTERED, dtype, braid_backend(c, dtype)._calls, c.barrier)
        self._c = c

    def bind(self, op: str, send: np.ndarray, out_count: int | None
             ) -> tuple[Callable[[], None], Callable[[], np.ndarray]]:
        x = self._c.empty(send.size, dtype=self._dtype)
        x.copy_(torch.from_numpy(send).to(self._dtype))
        out = x if out_count is None else torch.empty(out_count, dtype=self._dtype)
        fn = self._calls[op]
        as_numpy = (lambda: out.float().numpy()) if self._dtype == torch.bfloat16 else out.numpy
        return (lambda: fn(out, x)), as_numpy


def gloo_backend(dtype: str) -> TorchBackend:
    return TorchBackend("gloo", dtype, {
        "all_reduce": lambda out, x: dist.all_reduce(x),
        "reduce_scatter": lambda out, x: _gloo_reduce_scatter(out, x),
        "all_gather": lambda out, x: _gloo_all_gather(out, x),
        "broadcast": lambda out, x: dist.broadcast(x, src=protocol.ROOT),
        "all_to_all": lambda out, x: dist.all_to_all_single(out, x),
        "all_to_allv": lambda out, x: dist.all_to_all_single(
            out, x, **_split_kwargs(dist.get_rank(), dist.get_world_size(), x.numel())),
        "send_recv": _gloo_send_recv,
    }, dist.barrier)


def _gloo_send_recv(out: torch.Tensor, x: torch.Tensor) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, out, (rank - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def deepspeed_backend(rank: int, world_size: int, config: "Config") -> TorchBackend:
    """DeepSpeed's shared-memory all_reduce (deepspeed_peer.py); RuntimeError when it cannot run."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    run_id = str(os.environ.get("MASTER_PORT", 0) if config.launcher == "torchrun" else os.getppid())
    all_reduce = deepspeed_peer.shm_all_reduce(rank, world_size, local, config.dtype, run_id)
    return TorchBackend("deepspeed", config.dtype, {"all_reduce": lambda out, x: all_reduce(x)}, dist.barrier)


# -- one rank ------------------------------------------------------------------------------------
def run_rank(rank: int, world_size: int, store_port: int | None, config: Config) -> int:
    """One rank of the benchmark: measures every implementation in turn; rank 0 reports."""
    # One torch thread: nothing measured uses torch's thread pool, and OpenMP workers spinning
    # after a buffer conversion would steal the cores the collectives run on.
    launch.start_rank(rank, world_size, store_port, bind=config.bind, threads=1, timeout_s=config.timeout)
    try:
        backends = []
        braid = None
        if "braid" in config.impls:
            braid = comm.init(timeout=config.timeout)  # on the gloo group's store
            if len(config.trace) == 2:
                switch = {"on": True}
                backends += [braid_backend(braid, config.dtype, on, switch) for on in (True, False)]
            else:
                braid.trace_enabled = config.trace == ("on",)
                backends.append(braid_backend(braid, config.dtype))
        if REGISTERED in config.impls:
            if braid is None:
                braid = comm.init(timeout=config.timeout)
            backends.append(RegisteredBackend(braid, config.dtype))
        if "gloo" in config.impls:
            backends.append(gloo_backend(config.dtype))
        mpi_library = None
        if "mpi" in config.impls:  # only under mpirun (main() sees to it)
            from mpi4py import MPI

            backends.append(mpi_peer.MpiBackend(MPI.COMM_WORLD))
            mpi_library = mpi_peer.library_version()
        if "deepspeed" in config.impls and set(config.ops) & set(deepspeed_peer.OPS):
            try:
                backends.append(deepspeed_backend(rank, world_size, config))
            except RuntimeError as e:
                if rank == 0:
                    print(f"braid.bench: DeepSpeed peer skipped: {e}", file=sys.stderr)
        progress = report.Progress(protocol.planned(backends, config.ops, config.sizes), enabled=rank == 0)
        # Measuring stops a margin before the deadline, so that the ranks report what they have
        # instead of being stopped with it.
        stop_at = config.deadline - min(DEADLINE_MARGIN_S, (config.deadline - config.started) / 4)
        records = protocol.run_suite(backends, config.ops, config.sizes, config.dtype, rank, world_size,
                                     config.timing, progress, stop_at)
        truncated = len(records) < protocol.planned(backends, config.ops, config.sizes)
        if truncated and rank == 0:
            print("braid.bench: stopped before the deadline (--deadline): the tables hold what was "
                  "measured until then", file=sys.stderr)
        progress.close()
        floor = _copy_floor(config.sizes) if not truncated else {}
        if braid is not None:
            braid.close()
        launch.end_gloo_use()  # without it, runs with the DeepSpeed peer aborted a rank at exit
    finally:
        dist.destroy_process_group()
    status = _report(config, records, world_size, mpi_library, floor) if rank == 0 else 0
    return launch.EXIT_FAILED if truncated else status


# -- the Open MPI peer ---------------------------------------------------------------------------
def _mpi_unavailable(dtype: str) -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (`make bench-peers` installs Open MPI and mpi4py)"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (`make bench-peers` installs Open MPI)"
    if dtype not in mpi_peer.DTYPES:
        return f"MPI has no {dtype} datatype"
    return None


def _run_under_mpirun(config: Config, world_size: int) -> int:
    """Hosts the store and starts the ranks under mpirun (mpi_rank.main); waits for them until the
    deadline. mpirun runs in a session of its own, so that on the deadline it goes down with its
    ranks, and through ``setpriv --pdeathsig`` it gets SIGTERM (which it passes to its ranks) if
    this process dies first, however it dies."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=config.timeout))
    store.set(MPIRUN_CONFIG_KEY, config.to_json())  # for the ranks this process starts
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-np", str(world_size), sys.executable, "-m", "braid.bench.mpi_rank", str(store.port)]
    if shutil.which("setpriv"):
        cmd = ["setpriv", "--pdeathsig", "TERM", *cmd]
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(cmd, start_new_session=True)
    previous = signal.signal(signal.SIGTERM, launch.exit_on_signal)
    try:
        code = proc.wait(timeout=max(config.deadline + launch.FAILURE_GRACE_S - time.time(), 1.0))
        if code in (0, launch.EXIT_FAILED, launch.EXIT_FINDINGS):  # the ranks said why
            return code
        print(f"braid.bench: a rank died under mpirun (exit status {code}; mpirun's message is above)",
              file=sys.stderr)
        return launch.EXIT_FAILED
    except subprocess.TimeoutExpired:
        print("braid.bench: the ranks did not finish before the deadline (--deadline); stopping them",
              file=sys.stderr)
        return launch.EXIT_FAILED
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        signal.signal(signal.SIGTERM, previous)


# -- output (rank 0) -----------------------------------------------------------------------------
def _header(config: Config, world_size: int) -> str:
    machine = config.machine
    timing = config.timing
    calls = f"{timing.iters} calls" if timing.iters else f"calls sized to {timing.time_budget:g} s per size"
    return "\n".join([
        (f"# braid.bench collectives: {world_size} ranks ({config.launcher}), {config.dtype}, "
         f"{report.human_bytes(config.sizes[0])} .. {report.human_bytes(config.sizes[-1])}, "
         f"impls {' '.join(config.impls)}"),
        (f"# host {machine['hostname']}: {machine['cpu']}, {machine['usable_cpus']} usable CPUs, "
         f"load average {machine['load_average'][0]:.2f}, torch {torch.__version__}"),
        ("# placement: " + ("each rank bound to its own CPU, as Open MPI's mpirun does by default"
                            if config.bind == "core" else "unbound (mpirun does not bind either when "
                            "ranks outnumber the CPUs)")),
        ("# braid's flight recorder: " + {("on",): "on (its default)", ("off",): "paused"}.get(
            config.trace, f"on as braid, paused as {UNTRACED}, the same communicator")),
        (f"# timing: {timing.warmup} warm-up calls, then the median over {timing.batches} batches "
         f"({calls}) of the slowest rank's time per call"),
    ])


def _version(package: str = "braid") -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _copy_floor(sizes: Sequence[int], repeats: int = 7) -> dict[int, float]:
    """GB/s of one copy of each size (bytes read) with torch's ``copy_`` (at the smallest sizes its
    call's own cost counts too), every rank copying at once as they do in the collectives; the
    slowest rank's rate: the single-copy floor's rate."""
    rates = []
    for nbytes in sizes:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch both: page faults are not the copy's
        iters = max(1, min(1000, (64 << 20) // max(nbytes, 1)))
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            best = min(best, (time.perf_counter() - t0) / iters)
        rates.append(nbytes / best / 1e9)
    t = torch.tensor(rates, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return dict(zip(sizes, t.tolist()))


def _report(config: Config, records: list[dict], world_size: int, mpi_library: str | None,
            floor: dict[int, float]) -> int:
    status = 0
    blocks = [report.results_table(records, impl, op) for op in config.ops for impl in config.impls]
    if "braid" in config.impls:
        blocks += [report.ratio_table(records, "braid", peer) for peer in config.impls if peer != "braid"]
    if REGISTERED in config.impls:
        blocks += [report.ratio_table(records, REGISTERED, peer) for peer in config.impls
                   if peer not in ("braid", REGISTERED)]
    blocks += [report.floor_table(records, impl, floor) for impl in ("braid", REGISTERED)
               if impl in config.impls]
    print("\n\n".join(b for b in blocks if b))
    wrong = [r for r in records if r["wrong"]]
    if wrong:
        print(f"# {len(wrong)} results with wrong elements: "
              + ", ".join(f"{r['impl']} {r['op']} {r['bytes']} B ({r['wrong']})" for r in wrong))
        status = launch.EXIT_FINDINGS
    print(f"# wall time {time.time() - config.started:.1f} s")
    sys.stdout.flush()
    if config.json_path:
        machine = dict(config.machine, torch=torch.__version__, numpy=np.__version__,
                       braid=_version(), mpi_library=mpi_library,
                       deepspeed=_version("deepspeed") if "deepspeed" in config.impls else None)
        timing = config.timing
        settings = {"world_size": world_size, "launcher": config.launcher, "ops": list(config.ops),
                    "impls": list(config.impls), "dtype": config.dtype, "sizes": list(config.sizes),
                    "warmup": timing.warmup, "batches": timing.batches,
                    "time_budget_s": timing.time_budget, "iters": timing.iters, "timeout_s": config.timeout,
                    "bind": config.bind, "trace": list(config.trace)}
        report.write_json(config.json_path, {
            "benchmark": "collectives", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine, "config": settings, "records": records,
            "copy_floor_gbps": {str(k): v for k, v in floor.items()}})
    if config.plot_path:
        report.plot_busbw(config.plot_path, records,
                          f"busbw, {world_size} ranks, {config.dtype} ({config.machine['hostname']})")
    return status


# -- launch --------------------------------------------------------------------------------------
def _parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 4K, 256M or 1G, got {text!r}")
    return int(m.group(1)) * 1024 ** {"": 0, "k": 1, "m": 2, "g": 3}[m.group(2).lower()]


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn (default 2); ignored under torchrun, which sets WORLD_SIZE")
    p.add_argument("--ops", type=report.choice_list(protocol.ALL_OPS), default=protocol.OPS,
                   help=f"comma-separated collectives (default {','.join(protocol.OPS)}; also "
                   f"{', '.join(protocol.EXTRA_OPS)}: all_to_all with equal and with skewed split sizes, and "
                   "point to point around a ring)")
    p.add_argument("--impls", type=report.choice_list(IMPLS), default=None,
                   help="comma-separated implementations (default: braid, gloo, and mpi and "
                   "deepspeed when available; deepspeed measures all_reduce only)")
    p.add_argument("--min-bytes", type=_parse_bytes, default=4096,
                   help="smallest S; K, M, G are powers of 1024 (default 4K)")
    p.add_argument("--max-bytes", type=_parse_bytes, default=256 << 20, help="largest S (default 256M)")
    p.add_argument("--step-factor", type=int, default=4, help="ratio of consecutive sizes (default 4)")
    p.add_argument("--dtype", choices=protocol.DTYPES, default="float32", help="(default float32)")
    protocol.add_timing_arguments(p)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any collective or store wait may take before the run fails "
                   "(default 120)")
    p.add_argument("--deadline", type=float, default=1800.0,
                   help="seconds the whole run may take; then the ranks are stopped (default 1800)")
    p.add_argument("--bind", choices=("auto", "core", "none"), default="auto",
                   help="rank placement: core = local rank r on the r-th usable CPU; auto (default) = "
                        "core when ranks <= CPUs, else none, as Open MPI's mpirun does")
    p.add_argument("--trace", type=report.choice_list(("on", "off")), default=("on",),
                   help="braid's flight recorder: on (default), off, or on,off: both measured side by "
                        f"side on the same communicator, paused as impl {UNTRACED} (its cost)")
    p.add_argument("--json", metavar="PATH", type=report.output_path(),
                   help="write the records as JSON (format in the module docstring)")
    p.add_argument("--plot", metavar="PATH", type=report.output_path(".png"),
                   help="write a PNG of busbw against size")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the collectives benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    timing = protocol.timing_from_args(args, parser)
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        parser.error("need 1 <= --min-bytes <= --max-bytes")
    if args.step_factor < 2:
        parser.error("--step-factor must be at least 2")
    if not args.timeout > 0 or not args.deadline > 0:
        parser.error("--timeout and --deadline must be positive")
    launcher = launch.launcher()
    if launcher == "torchrun":
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        rank, world_size = 0, 2 if args.nproc is None else args.nproc
        if world_size < 1:
            parser.error("--nproc must be at least 1")

    def note(message: str) -> None:
        if rank == 0:
            print(f"braid.bench: {message}", file=sys.stderr)

    if launcher == "torchrun" and args.nproc not in (None, world_size):
        note(f"--nproc {args.nproc} ignored: torchrun started {world_size} ranks")
    mpi_missing = _mpi_unavailable(args.dtype)
    if launcher == "torchrun" and not mpi_missing:
        mpi_missing = ("torchrun started the ranks, and only ranks that mpirun starts can run Open MPI "
                       "(run without torchrun: the benchmark then starts its ranks under mpirun)")
    ds_missing = deepspeed_peer.unavailable(args.dtype)
    impls = args.impls
    if impls is None:
        impls = (("braid", "gloo") + (() if mpi_missing else ("mpi",))
                 + (() if ds_missing else ("deepspeed",)))
        if mpi_missing:
            note(f"Open MPI peer skipped: {mpi_missing}")
        if ds_missing:
            note(f"DeepSpeed peer skipped: {ds_missing}")
    elif "mpi" in impls and mpi_missing:
        parser.error(f"--impls mpi: {mpi_missing}")
    elif "deepspeed" in impls and ds_missing:
        parser.error(f"--impls deepspeed: {ds_missing}")
    if not protocol.check_is_exact(args.dtype, world_size):
        note(f"{args.dtype} cannot hold the check's sums exactly at {world_size} ranks: "
             "#wrong will count rounding")
    for op in args.ops:
        if protocol.message_count(op, args.min_bytes, args.dtype, world_size) == 0:
            need = next(b for b in range(1, 1 << 20)
                        if protocol.message_count(op, b, args.dtype, world_size) > 0)
            parser.error(f"--min-bytes {args.min_bytes} is less than one {args.dtype} element per rank "
                         f"for {op} at {world_size} ranks: use at least {need}")
    sizes = [args.min_bytes]
    while sizes[-1] * args.step_factor <= args.max_bytes:
        sizes.append(sizes[-1] * args.step_factor)
    if launcher == "spawn" and "mpi" in impls:
        launcher = "mpirun"
    trace = tuple(sorted(args.trace, reverse=True))  # ("on",), ("off",) or ("on", "off")
    if len(trace) == 2 and "braid" in impls:
        impls = (*impls[:impls.index("braid") + 1], UNTRACED, *impls[impls.index("braid") + 1:])
    elif len(trace) == 2 or (trace == ("off",) and "braid" not in impls):
        parser.error("--trace: braid's recorder is measured only with braid among --impls")
    config = Config(args.ops, impls, tuple(sizes), args.dtype, timing, args.timeout,
                    started + args.deadline, started, launcher, launch.resolve_bind(args.bind, world_size),
                    report.machine_info(), args.json, args.plot, trace)
    if rank == 0:
        print(_header(config, world_size), flush=True)
    if launcher == "torchrun":
        return launch.run_rank_reporting(run_rank, rank, world_size, None, config)
    if launcher == "mpirun":
        return _run_under_mpirun(config, world_size)
    return launch.spawn(run_rank, world_size, config.timeout, config.deadline, config)
