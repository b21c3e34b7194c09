"""Runs a test function on N ranks (processes) sharing a FileStore, with a deadline on every wait.

    results = run_ranks(check_sum, 4, seed)          # pooled workers; one result per rank
    with FreshRanks(3) as ranks:                      # new processes, for tests that kill ranks
        ranks.start(victim_test, seed)
        ranks.kill(2)
        outcomes = ranks.outcomes()

A rank runs ``fn(rank, world_size, store_path, *args)``; ``fn`` must be a module-level function
(it travels by pickle, by reference) and its result a picklable value. Importing torch costs
1-2 s per process here, so ``run_ranks`` reuses one pool of workers (a call with world size N
uses workers 0..N-1; one that misses its deadline or dies is killed and replaced), and every
worker, pooled or fresh, is forked from a server process that imported torch and braid once
(multiprocessing's forkserver): a new rank starts in milliseconds. Each worker takes the test
process's environment as it is when the worker starts, as a spawned process would.
"""
from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import socket
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import wait as wait_connections
from typing import Any, Callable, Iterator

import pytest
import torch.distributed as dist

# Deadline of a whole multi-rank call, from the test's side. Generous: 4 ranks share 2 cores, and
# a hang must end as a test failure, not as the pytest-timeout backstop.
DEFAULT_DEADLINE_S = 120.0
# Deadline of every braid wait inside the ranks: a real collective here takes milliseconds, so
# this only ever fires when a test is broken, and it fires long before DEFAULT_DEADLINE_S.
COMM_TIMEOUT_S = 20.0
STORE_TIMEOUT = timedelta(seconds=COMM_TIMEOUT_S)

# Forked from a server that has imported torch and braid (no threads of torch's running: none
# starts at import), instead of a fresh interpreter that imports them again per rank.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "braid.comm"])
_store_dir: str | None = None
_store_ids = itertools.count()
_comm_ids: dict[str, itertools.count[int]] = {}  # in a rank: communicators made per call (store)


class RankFailure(AssertionError):
    """One or more ranks raised, died or missed the deadline; the message holds every rank's story."""


def _worker_main(conn, environ: dict) -> None:
    """Worker loop: receive (fn, rank, world_size, store_path, args), run it, send back the outcome.
    ``environ``: the test process's environment when it started the worker (the fork server holds
    the one it had when the server started)."""
    os.environ.clear()
    os.environ.update(environ)
    import torch
    from braid import comm  # noqa: F401  (loads the extension once per worker, not in the first test)

    # Up to 4 ranks share 2 cores: torch's OpenMP workers would spin between matmuls on cores
    # other ranks need, making multi-rank model tests many times slower.
    torch.set_num_threads(1)

    while True:
        try:
            fn, rank, world_size, store_path, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            outcome: tuple[str, Any] = ("ok", fn(rank, world_size, store_path, *args))
        except BaseException:  # noqa: BLE001 - any failure, even SystemExit, goes back to the test
            outcome = ("err", traceback.format_exc())
        try:
            payload = pickle.dumps(outcome)
        except Exception:  # noqa: BLE001 - reported instead of killing the worker
            payload = pickle.dumps(("err", "result is not picklable:\n" + traceback.format_exc()))
        release_destroyed_groups()
        conn.send_bytes(payload)


class _Worker:
    def __init__(self) -> None:
        self.conn, child = _CTX.Pipe(duplex=True)
        self.proc = _CTX.Process(target=_worker_main, args=(child, dict(os.environ)), daemon=True)
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=10)
        self.conn.close()


def new_store_path() -> str:
    """A fresh FileStore path (one per multi-rank call); the folder goes at interpreter exit."""
    global _store_dir
    if _store_dir is None:
        _store_dir = tempfile.mkdtemp(prefix="braid-tests-")
        atexit.register(shutil.rmtree, _store_dir, True)
    return os.path.join(_store_dir, f"store{next(_store_ids)}")


def open_store(store_path: str) -> dist.FileStore:
    """The FileStore of a call, with a short timeout. World size -1: the file is never deleted by
    the store (the test process may open it too); the folder is removed at exit."""
    store = dist.FileStore(store_path, -1)
    store.set_timeout(STORE_TIMEOUT)
    return store


@contextmanager
def process_group(rank: int, world_size: int, store_path: str, backend: str = "gloo") -> Iterator[None]:
    """The torch.distributed default group of `backend` on the call's store (its keys apart from
    braid's), with the short test timeout; destroyed on exit (gloo on a FileStore aborts at
    interpreter exit otherwise)."""
    store = dist.PrefixStore(f"{backend}-pg/", open_store(store_path))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=STORE_TIMEOUT)
    try:
        yield
    finally:
        # Destroyed, but held until nothing else owns them: a gloo group whose last reference
        # goes with a DDP Reducer is destroyed while the Reducer's deallocation holds the GIL, and
        # its destructor joins a worker thread that may need the GIL to free its last work (torch's
        # ProcessGroupGloo; pytorch issue 56297): the rank hangs. Its Python object frees it with
        # the GIL released, so the worker drops that last (release_destroyed_groups).
        _DESTROYED_GROUPS.extend(dist.distributed_c10d._world.pg_map)
        dist.destroy_process_group()


_DESTROYED_GROUPS: list = []


def release_destroyed_groups() -> None:
    """Frees the groups `process_group` destroyed that nothing but their Python object owns any
    more (the test's DDP modules, and their Reducers, collected); the rest wait for a later call.
    A kept group's threads (gloo's event loop wakes ~100 times a second) would otherwise slow every
    later test in a pooled worker."""
    if not _DESTROYED_GROUPS:
        return
    import gc

    import braid.comm._C as _C

    gc.collect()
    still_owned = [g for g in _DESTROYED_GROUPS if _C._process_group_owners(g) > 1]
    _DESTROYED_GROUPS[:] = still_owned


@contextmanager
def braid_default_group(rank: int, world_size: int, store_path: str) -> Iterator[dist.ProcessGroup]:
    """The default process group on braid, plus a gloo group over the same ranks to compare with."""
    import braid.comm  # noqa: F401  (registers the backend)

    with process_group(rank, world_size, store_path, backend="braid"):
        yield dist.new_group(backend="gloo", timeout=STORE_TIMEOUT)


def listen_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now, for stores a test starts later (MASTER_PORT).

    Drawn below the kernel's range of ephemeral ports (ip_local_port_range), from which every
    outgoing connection on the machine takes its local port: a port bound to 0 and released
    comes from that range, and any connection may take it before the test's store listens
    (EADDRINUSE). Below it only a listener that names the port could."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(10000, max(10001, low))
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: draw again
        ports.append(port)
    return ports


@contextmanager
def environment(values: dict) -> Iterator[None]:
    """Sets the environment variables ``values`` for the block and restores what was there before
    (a pooled worker keeps its environment from one test to the next)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in values.items():
            patch.setenv(name, value)
        yield


def make_comm(rank: int, world_size: int, store_path: str, **kwargs):
    """A Communicator on the call's store with the short test timeout (overridable).

    Store prefixes count the communicators of this call (each rank creates them in the same
    order): braid's default numbering counts per process, which differs between pooled workers.
    """
    from braid import comm

    kwargs.setdefault("timeout", COMM_TIMEOUT_S)
    kwargs.setdefault("prefix", f"comm{next(_comm_ids.setdefault(store_path, itertools.count()))}/")
    return comm.Communicator(open_store(store_path), rank, world_size, **kwargs)


# The three carriers every layer is tested over: braid's Communicator, a gloo ProcessGroup, and a
# ProcessGroup of braid's own c10d backend.
CARRIERS = ("communicator", "gloo", "braid")


@contextmanager
def carrier(kind: str, rank: int, world_size: int, store_path: str) -> Iterator[Any]:
    """The group a layer runs on for carrier ``kind`` (one of CARRIERS): a Communicator, or the
    default process group of that backend (destroyed on exit)."""
    if kind == "communicator":
        yield make_comm(rank, world_size, store_path)
        return
    if kind == "braid":
        import braid.comm  # noqa: F401  (registers the backend)
    with process_group(rank, world_size, store_path, backend=kind):
        yield dist.group.WORLD


def _collect(workers: list[_Worker], deadline_s: float) -> dict[int, tuple[str, Any]]:
    """Waits for one outcome per worker until the deadline. Outcomes: ("ok", value), ("err", tb),
    ("died", exitcode) or ("hung", None) for a worker that was still busy at the deadline."""
    outcomes: dict[int, tuple[str, Any]] = {}
    by_conn = {w.conn: r for r, w in enumerate(workers)}
    end = time.monotonic() + deadline_s
    pending = set(by_conn)
    while pending:
        left = end - time.monotonic()
        if left <= 0:
            break
        for conn in wait_connections(list(pending), timeout=left):
            r = by_conn[conn]
            pending.discard(conn)
            try:
                outcomes[r] = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                workers[r].proc.join(timeout=10)
                outcomes[r] = ("died", workers[r].proc.exitcode)
    for conn in pending:
        outcomes[by_conn[conn]] = ("hung", None)
    return outcomes


def _report(fn: Callable, outcomes: dict[int, tuple[str, Any]], deadline_s: float) -> str:
    lines = [f"{fn.__name__} on {len(outcomes)} ranks:"]
    for r in sorted(outcomes):
        kind, value = outcomes[r]
        if kind == "ok":
            lines.append(f"--- rank {r}: ok")
        elif kind == "err":
            lines.append(f"--- rank {r}: raised\n{value}")
        elif kind == "died":
            lines.append(f"--- rank {r}: process exited with code {value}")
        else:
            lines.append(f"--- rank {r}: no answer within {deadline_s:g} s (killed)")
    return "\n".join(lines)


def _send(workers: list[_Worker], fn: Callable, store_path: str, args: tuple) -> None:
    n = len(workers)
    for r, w in enumerate(workers):
        w.conn.send_bytes(pickle.dumps((fn, r, n, store_path, args)))


class _Pool:
    """Reusable workers; run() uses the first world_size of them."""

    def __init__(self) -> None:
        self.workers: list[_Worker] = []

    def get(self, n: int) -> list[_Worker]:
        self.workers = [w for w in self.workers if w.proc.is_alive()]
        while len(self.workers) < n:
            self.workers.append(_Worker())
        return self.workers[:n]

    def discard(self, workers: list[_Worker]) -> None:
        for w in workers:
            w.kill()
            if w in self.workers:
                self.workers.remove(w)

    def shutdown(self) -> None:
        """EOF on every pipe ends every worker loop; workers still alive after 10 s are killed."""
        for w in self.workers:
            w.conn.close()
        end = time.monotonic() + 10
        for w in self.workers:
            w.proc.join(timeout=max(0.0, end - time.monotonic()))
            w.kill()
        self.workers = []


_pool = _Pool()
atexit.register(_pool.shutdown)


def shutdown_pool() -> None:
    """Stops the pooled workers (end of the session)."""
    _pool.shutdown()


def run_ranks(fn: Callable, world_size: int, *args: Any, deadline_s: float = DEFAULT_DEADLINE_S) -> list[Any]:
    """Runs ``fn(rank, world_size, store_path, *args)`` on ``world_size`` pooled workers and
    returns the results in rank order. Raises RankFailure if any rank raised, died or missed the
    deadline (late workers are killed and replaced, so the next test starts clean)."""
    workers = _pool.get(world_size)
    _send(workers, fn, new_store_path(), args)
    outcomes = _collect(workers, deadline_s)
    bad = [workers[r] for r, (kind, _) in outcomes.items() if kind in ("died", "hung")]
    if bad:
        _pool.discard(bad)
    if any(kind != "ok" for kind, _ in outcomes.values()):
        raise RankFailure(_report(fn, outcomes, deadline_s))
    return [outcomes[r][1] for r in range(world_size)]


class FreshRanks:
    """``world_size`` new processes for one call, for tests that kill ranks; all are killed on exit.

    The test process can join the call's store through ``open_store(ranks.store_path)``.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.store_path = new_store_path()
        self._workers: list[_Worker] = []

    def __enter__(self):
        self._workers = [_Worker() for _ in range(self.world_size)]
        return self

    def __exit__(self, *exc) -> None:
        for w in self._workers:
            w.kill()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def start(self, fn: Callable, *args: Any) -> None:
        """Starts ``fn(rank, world_size, store_path, *args)`` on every rank; returns at once."""
        _send(self._workers, fn, self.store_path, args)

    def kill(self, rank: int) -> None:
        """SIGKILLs one rank now."""
        os.kill(self._workers[rank].pid, signal.SIGKILL)

    def outcomes(self, deadline_s: float = DEFAULT_DEADLINE_S) -> dict[int, tuple[str, Any]]:
        """Every rank's outcome: ("ok", value), ("err", traceback), ("died", exitcode), ("hung", None)."""
        return _collect(self._workers, deadline_s)
