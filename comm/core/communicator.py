"""The braid communicator: the collectives and point-to-point transfers users call, on CPU
tensors and, in builds with CUDA, on CUDA tensors staged through pinned host memory (the binding
dispatches the collectives by the tensors' device: csrc/binding/torch_binding.cpp; the calls the
core runs on host memory only, all_to_all with split sizes and point-to-point, fall back to
:func:`_through_host` here); :func:`init` builds one from the launcher's environment
(launch_env.py), and every communicator joins its peers through the store (bootstrap.py)."""
from __future__ import annotations

import importlib.metadata
import itertools
import json
import logging
import operator
import os
import socket
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import torch
import torch.distributed as dist

import braid.comm._C as _C  # the extension module itself (not the package)
from .bootstrap import Bootstrap, admit, agree_membership, await_admission, request_admission
from .build_info import is_cuda_build
from .group import COMPRESSED_ALL_REDUCE, HIERARCHICAL, REGISTERED_BUFFERS, Group, WorkList
from .group_carrier import HostGroups
from .launch_env import launch_rank, launch_store, launch_world_size
from .vocabulary import REDUCE_OPS, Op, op_code
from .wire import CompressionHost, WireStats
from .work import Work, seconds

logger = logging.getLogger(__name__)

_instances = itertools.count()
DEFAULT_TIMEOUT = timedelta(seconds=300)  # of every wait, unless a communicator is given its own


def _index(value: object, name: str) -> int:
    """An integer argument: Python and numpy/torch integers, not bools, floats or strings."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def _async_flag(async_op) -> bool:
    """``async_op`` as the binding takes it: a bool (numpy's included); anything else raises a
    TypeError naming the argument instead of the binding's list of signatures."""
    if async_op is True or async_op is False:
        return async_op
    if type(async_op).__name__ == "bool_":  # numpy.bool_
        return bool(async_op)
    raise TypeError(f"async_op must be a bool, got {async_op!r}")


def _splits(sizes, name: str) -> Optional[list]:
    """Split sizes as a list of Python ints: any sequence (or 1-D tensor) of integers, numpy and
    torch integer scalars included; floats and bools are refused naming ``name``."""
    if sizes is None:
        return None
    if type(sizes) is list and all(type(v) is int for v in sizes):  # the common case, on the call's latency
        return sizes
    if isinstance(sizes, torch.Tensor):
        sizes = sizes.tolist()
    try:
        values = list(sizes)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {type(sizes).__name__}") from None
    for v in values:
        if isinstance(v, bool) or not hasattr(type(v), "__index__"):
            raise TypeError(f"{name} must be a sequence of ints, got an element of type {type(v).__name__}")
    return [operator.index(v) for v in values]


class P2POp:
    """One transfer of :meth:`Communicator.batch_isend_irecv`: ``op`` is "send" (``tensor`` to rank
    ``peer``) or "recv" (into ``tensor`` from rank ``peer``)."""

    __slots__ = ("op", "tensor", "peer")

    def __init__(self, op: str, tensor: torch.Tensor, peer: int):
        if op not in ("send", "recv"):
            raise ValueError(f"op must be 'send' or 'recv', got {op!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self.op = op
        self.tensor = tensor
        self.peer = _index(peer, "peer")

    def __repr__(self) -> str:
        return f"P2POp({self.op!r}, tensor{tuple(self.tensor.shape)}, peer={self.peer})"


def _version() -> str:
    try:
        return importlib.metadata.version("braid")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _wrap(w, what: str):
    return None if w is None else Work(w, what)


def _device(device) -> torch.device:
    """The constructor's ``device``: None or "cpu" the CPU, "cuda" or "cuda:<index>" a GPU (builds
    with CUDA only); anything else a ValueError naming the argument."""
    if device is None:
        return torch.device("cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
    if d.type == "cuda" and not is_cuda_build():
        raise ValueError(f"device={device!r} needs braid built with CUDA; this build takes CPU tensors only "
                         "(it was built where torch had no CUDA or nvcc was not found)")
    return d


def _close_soon(c) -> None:
    """The finalizer's close: at once, or, when the last reference went away inside a future's
    callback on the communicator's own progress thread (which close() would have to join), on a
    short-lived thread once that callback has returned."""
    if c.on_progress_thread():
        import threading

        threading.Thread(target=c.close, name="braid-close", daemon=True).start()
    else:
        c.close()


# -- CUDA tensors on the calls the core runs on host memory only ---------------------------------

class _HostStaging:
    """The copies of the fallback path (:func:`_through_host`) for one CUDA device, ordered on the
    caller's current stream at the call: copies down are queued on it, so they see the work the
    caller queued before the call, and the host waits for them before the core reads them; copies
    back are queued on it too, so the caller's later work sees them, and an async call's
    ``wait()`` makes the stream current at that moment wait for them. Pinned buffers come from torch's
    caching host allocator, which holds a block until the copies queued on it are done."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.current_stream(device)

    def owns(self, t: torch.Tensor) -> bool:
        return t.device == self.device

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """An empty pinned host tensor of ``t``'s shape and dtype."""
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)

    def down(self, t: torch.Tensor) -> torch.Tensor:
        h = self.host(t)
        h.copy_(t, non_blocking=True)  # on the current stream: the caller's, at the call
        return h

    def wait_down(self) -> None:
        """Blocks until the copies down are in host memory (the core reads them next)."""
        done = torch.cuda.Event()
        done.record(self.stream)
        done.synchronize()

    def up(self, t: torch.Tensor, h: torch.Tensor) -> "torch.cuda.Event":
        """Queues the copy of ``h`` into ``t`` on the call's stream (from any thread); returns the
        event that follows it."""
        with torch.cuda.stream(self.stream):
            t.copy_(h, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return copied

    def order(self, copied: "torch.cuda.Event") -> None:
        torch.cuda.current_stream(self.device).wait_event(copied)

    def future(self) -> torch.futures.Future:
        return torch.futures.Future(devices=[self.device])

    def complete(self, fut: torch.futures.Future, value: list) -> None:
        """Sets ``fut``'s value on the call's stream: its waiters' streams wait for that stream."""
        with torch.cuda.stream(self.stream):
            fut.set_result(value)


class _StagedWork:
    """An async call of the fallback path: the core's work on the host stand-ins, then the copy of
    the stand-in of ``tensor`` back into it, once, at the first ``wait()`` or when the future
    completes (whichever comes first); ``wait()`` makes the current stream wait for that copy. It
    holds the stand-in until then. Has the methods of the core's works, so :class:`Work` wraps it."""

    def __init__(self, work: Any, stage: Any, tensor: torch.Tensor, host: torch.Tensor):
        self._w, self._stage, self._tensor, self._host = work, stage, tensor, host
        self._copied: Any = None
        self._lock = threading.Lock()  # wait() and the future's callback may race to copy back

    def _copy_back(self) -> Any:
        with self._lock:
            if self._copied is None:
                self._copied = self._stage.up(self._tensor, self._host)
            return self._copied

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not self._w.wait(timeout):
            return False
        self._stage.order(self._copy_back())
        return True

    def is_completed(self) -> bool:
        return self._w.is_completed()

    def is_success(self) -> bool:
        return self._w.is_success()

    def completed_at(self) -> Optional[float]:
        return self._w.completed_at()

    def exception_message(self) -> Optional[str]:
        return self._w.exception_message()

    def get_future(self) -> torch.futures.Future:
        fut = self._stage.future()

        def done(source: torch.futures.Future) -> None:
            try:
                source.value()  # raises the call's error
                self._copy_back()
            except Exception as e:  # noqa: BLE001 - the future carries it to its waiter
                fut.set_exception(e)
                return
            self._stage.complete(fut, [self._tensor])

        self._w.get_future().add_done_callback(done)
        return fut


def _through_host(stage: Any, tensors: Sequence[tuple], call: Callable[[list, bool], Optional[list]],
                  async_op: bool) -> Optional[list]:
    """The fallback path for device tensors on the calls the core runs on host memory only
    (all_to_all with split sizes, send, recv): each tensor of ``tensors`` (``(tensor, written)``
    pairs) that ``stage`` owns gets a pinned host stand-in, a copy of it where the call reads it;
    ``call(stand_ins, async_op)`` runs the core's call on them and returns its works (None when
    blocking), work i filling ``tensors[i]`` where that one is written. Blocking: the stand-ins of
    written tensors are copied back on the caller's stream before this returns. Async: works
    that fill a tensor become :class:`_StagedWork` (copy back at wait()); the others (sends) are
    the core's, which holds its input until it is sent. ``stage``: a :class:`_HostStaging` (a CPU
    stand-in in the tests). A device-to-device path, where one exists, is taken before this."""
    stand_ins, copied_down = [], False
    for t, written in tensors:
        if not stage.owns(t):
            stand_ins.append(t)
        elif written:
            stand_ins.append(stage.host(t))
        else:
            stand_ins.append(stage.down(t))
            copied_down = True
    if copied_down:
        stage.wait_down()
    works = call(stand_ins, async_op)
    backs = [(t, h) if written and h is not t else None for (t, written), h in zip(tensors, stand_ins)]
    if works is None:
        for back in backs:
            if back is not None:
                stage.up(*back)
        return None
    return [w if back is None else _StagedWork(w, stage, *back) for w, back in zip(works, backs)]


class Communicator(CompressionHost, Group):
    """A group of ranks running braid collectives on CPU tensors and (builds with CUDA) CUDA tensors.

    Args:
        store: a ``torch.distributed.Store`` shared by all ranks (TCPStore, FileStore, ...).
        rank, world_size: this process's rank and the number of ranks.
        timeout: deadline of every wait (``timedelta`` or seconds). Reaching it raises
            ``CommTimeout`` naming the ranks that did not arrive.
        device: ``"cpu"`` or None, or a CUDA device (``"cuda"``, ``"cuda:1"``): its staging
            buffers and copy streams are set up now rather than at the first call on one of its
            tensors. Either way every call takes CPU tensors, and CUDA tensors where braid was built
            with CUDA, stream-ordered (the call is ordered after the caller's current stream;
            ``wait()`` and blocking calls make that stream wait for the result): device to device
            between the ranks of one host (CUDA IPC, set up by every rank at a device's first
            call), else through pinned host memory in chunks. Point-to-point (and all_to_all with
            split sizes where IPC is off) take CUDA tensors by a fallback path: whole pinned
            copies, the host waiting for the copies down before the call (see :meth:`all_to_all`).
        prefix: store key prefix; by default communicators are numbered in creation order, so
            every rank must create its communicators in the same order.
        algo, oneshot_max_bytes, slot_bytes, nslots, stream_min_bytes, spin_us, yield_us,
            skew_rounds: tunables of the shared-memory transport; nsocks, socket_chunk_bytes,
            cross_oneshot_max_bytes, cross_piece_bytes: of the TCP transport between hosts;
            staging_chunk_bytes, staging_slots: of the pipeline for CUDA tensors (bytes per chunk
            part, chunks in flight; every rank must use the same); trace_buffer: calls the flight
            recorder keeps (0: none; see :meth:`dump_trace`). ``None`` takes the ``BRAID_*``
            environment variable or the built-in default (docs/usage/knobs.md).

    Ranks on one host talk through POSIX shared memory; ranks on different hosts (told apart by
    published host identity, or ``BRAID_HOST_ID``) over authenticated TCP, on the interface
    ``BRAID_SOCKET_IFNAME`` names or else the one that routes to the store's host. Across hosts
    each host's own steps stay in shared memory and only the exchange between hosts takes TCP:
    small all-reduces in one round trip among the host leaders (by recursive doubling from four
    hosts), larger ones and every reduce-scatter and all-gather directly at two hosts and around a
    ring between hosts from three (:meth:`all_reduce_algorithm` names the all-reduce's choice).

    It is a :class:`~braid.comm.core.group.Group`: every braid layer runs on it as on a torch process
    group, and finds its fused paths among ``capabilities`` (the compressed all-reduce in one call,
    hierarchical algorithms).
    """

    capabilities = frozenset({COMPRESSED_ALL_REDUCE, HIERARCHICAL, REGISTERED_BUFFERS})

    def __init__(self, store: "dist.Store", rank: int, world_size: int, *,
                 timeout: Union[timedelta, float] = DEFAULT_TIMEOUT,
                 device: Optional[Union[str, torch.device]] = None,
                 prefix: Optional[str] = None,
                 algo: Optional[str] = None,
                 oneshot_max_bytes: Optional[int] = None,
                 slot_bytes: Optional[int] = None,
                 nslots: Optional[int] = None,
                 stream_min_bytes: Optional[int] = None,
                 spin_us: Optional[float] = None,
                 yield_us: Optional[float] = None,
                 skew_rounds: Optional[bool] = None,
                 nsocks: Optional[int] = None,
                 socket_chunk_bytes: Optional[int] = None,
                 cross_oneshot_max_bytes: Optional[int] = None,
                 cross_piece_bytes: Optional[int] = None,
                 staging_chunk_bytes: Optional[int] = None,
                 staging_slots: Optional[int] = None,
                 trace_buffer: Optional[int] = None):
        # The tunables as given, for the communicators shrink() builds.
        self._options = {k: v for k, v in locals().items()
                         if k not in ("self", "store", "rank", "world_size", "timeout", "device", "prefix")}
        if not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        world_size, rank = _index(world_size, "world_size"), _index(rank, "rank")
        if world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        device = _device(device)
        self._timeout_s = seconds(timeout)
        tun = _C.Tunables.from_env()
        if algo is not None:
            if algo not in _C.ALGORITHMS:
                raise ValueError(f"algo must be one of {', '.join(_C.ALGORITHMS)}, got {algo!r}")
            tun.algo = algo
        for name, value, kind in (("oneshot_max_bytes", oneshot_max_bytes, int),
                                  ("slot_bytes", slot_bytes, int), ("nslots", nslots, int),
                                  ("stream_min_bytes", stream_min_bytes, int),
                                  ("spin_us", spin_us, float), ("yield_us", yield_us, float),
                                  ("nsocks", nsocks, int), ("socket_chunk_bytes", socket_chunk_bytes, int),
                                  ("cross_oneshot_max_bytes", cross_oneshot_max_bytes, int),
                                  ("cross_piece_bytes", cross_piece_bytes, int),
                                  ("trace_buffer", trace_buffer, int)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                raise TypeError(f"{name} must be {'a number' if kind is float else 'an int'}, "
                                f"got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
            if kind is int:  # saturate at the C++ field's range: the constructor then names the bounds
                value = min(value, 2**31 - 1 if name in ("nslots", "nsocks") else 2**63 - 1)
            setattr(tun, name, value)
        for name, value in (("staging_chunk_bytes", staging_chunk_bytes), ("staging_slots", staging_slots)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        self._device = device
        if skew_rounds is not None:
            if not isinstance(skew_rounds, bool):
                raise TypeError(f"skew_rounds must be a bool, got {type(skew_rounds).__name__}")
            tun.skew_rounds = int(skew_rounds)
        self._rank = rank
        self._world_size = world_size
        self._prefix = prefix if prefix is not None else f"braid/comm{next(_instances)}/"
        self._shrinks = 0  # shrink() calls so far: each agrees under keys of its own
        self._grows = 0  # grow() calls so far, likewise
        self._windows = 0  # registered buffers made so far (empty / zeros): their ids, the same on every rank
        self._root = self._prefix  # where processes ask to join (the first of a line of shrinks and grows)
        self._store = store
        self.last_wire_bytes: Optional[WireStats] = None
        tun.validate()  # before waiting for the peers: bad settings fail at once
        boot = Bootstrap(store, self._prefix, rank, world_size, self._timeout_s)
        try:
            host_ids = boot.join()
            self._hosts = host_ids
            self._c = _C.Communicator(rank, world_size, tun, self._timeout_s, host_ids)
        except Exception as e:
            boot.tell_peers(e)
            raise
        self._finalizer = weakref.finalize(self, _close_soon, self._c)
        try:
            if is_cuda_build():  # calls on CUDA tensors go through staging pipelines with these options
                self._c.set_staging_options(staging_chunk_bytes or 0, staging_slots or 0)
            if device.type == "cuda":
                self._c.prepare_device(torch.cuda.current_device() if device.index is None else device.index)
            comm_id = boot.connect(self._c)
            self._c.set_trace_identity(comm_id, host_ids, socket.gethostname(), _version())
        except BaseException as e:
            self._finalizer()
            boot.tell_peers(e)
            raise

    def _release_core(self):
        """Hands the C++ communicator to a new owner (the torch.distributed backend), which
        closes it; this object stops closing it at garbage collection."""
        self._finalizer.detach()
        return self._c

    # -- properties ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank among the ranks of this host (in rank order)."""
        return self._c.local_rank

    @property
    def local_world_size(self) -> int:
        """Number of ranks on this host."""
        return self._c.local_world_size

    @property
    def num_hosts(self) -> int:
        """Number of hosts the ranks span (told apart by host_identity())."""
        return self._c.num_hosts

    def dump_trace(self, directory: Optional[str] = None) -> str:
        """Writes this rank's flight recorder (its last calls: what, sizes, algorithm, bytes per
        transport, state and times) as ``braid-trace-<id>-rank<R>.json`` in ``directory``
        (default: ``BRAID_TRACE_DIR``) and returns the file's path. ``python -m braid.trace
        analyze DIR`` reads the files of all ranks. The recorder keeps ``BRAID_TRACE_BUFFER``
        calls (default 2000; 0 keeps none); with ``BRAID_TRACE_DIR`` set every rank also dumps
        there when any rank meets CommTimeout, PeerError or CollectiveMismatch, and on the signal
        ``BRAID_TRACE_SIGNAL`` names (e.g. USR1)."""
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        return self._c.dump_trace(os.fspath(directory) if directory is not None else "", "dump_trace")

    def trace(self) -> dict:
        """The flight recorder's content now, as the dump would hold it (a dict; see
        docs/trace.md)."""
        return json.loads(self._c.trace_json("trace"))

    @property
    def trace_enabled(self) -> bool:
        """Whether the flight recorder records calls now (False with ``trace_buffer=0``). Setting it
        to False pauses it (calls issued meanwhile leave no entry; what it holds stays and is
        dumped as usual), True resumes it."""
        return self._c.trace_enabled

    @trace_enabled.setter
    def trace_enabled(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"trace_enabled must be a bool, got {type(on).__name__}")
        self._c.trace_enabled = on

    def connections(self) -> dict:
        """The TCP connections this rank holds now: ``{"peers": ranks on other hosts connected to,
        "sockets": their sockets}``. Connections open when an algorithm first uses a pair of ranks
        (``BRAID_TCP_CONNECT=lazy``, the default), so they count the peers used, not the world:
        a ring across hosts holds two. ``BRAID_TCP_CONNECT=eager`` opens every pair's while the
        communicator is built."""
        return {"peers": self._c.tcp_peers, "sockets": self._c.tcp_sockets}

    def split_by_host(self) -> HostGroups:
        """This communicator split by host, for algorithms that are exact inside a host and
        compressed across hosts (ZeRO++'s hierarchical sharding, the compressed all-reduce's
        hierarchical path): a :class:`~braid.comm.core.group_carrier.HostGroups` of this communicator, a new
        one over this host's ranks and a new one over the ranks with this rank's local index
        (one per host). Collective: every rank calls it, in the same order as its other
        communicator constructions. Raises ValueError when the hosts hold different numbers of
        ranks. Close the two new communicators (``hosts.intra.group``, ``hosts.inter.group``)
        when done; closing this one does not close them."""
        hosts = self._hosts
        sizes = [hosts.count(h) for h in range(max(hosts) + 1)]
        if len(set(sizes)) != 1:
            raise ValueError(f"split_by_host: the hosts hold {sizes} ranks; every host must hold the same "
                             "number (set BRAID_HOST_ID to group ranks differently)")
        host, local = hosts[self._rank], self.local_rank
        common = {"timeout": self._timeout_s, "device": self._device}
        intra = Communicator(self._store, local, sizes[0], prefix=f"{self._prefix}host{host}/", **common)
        inter = Communicator(self._store, host, len(sizes), prefix=f"{self._prefix}local{local}/", **common)
        return HostGroups(self, intra, inter)

    def shrink(self, exclude: Sequence[int] = (), wait: float = 5.0) -> "Communicator":
        """A new communicator over the ranks of this one that go on, after a peer died
        (``PeerError``) or to leave ranks out on purpose. Every rank that goes on calls it; the
        ranks agree through the store which of them did: a rank in ``exclude`` is not waited
        for, the others are waited for up to ``wait`` seconds and left out if they have not
        called by then (a dead rank never does; a rank that calls later raises CommError). This
        communicator is aborted; the new one numbers the ranks that go on 0..k-1 in the order of
        their ranks here, with this one's timeout, device and tunables. The store must outlive
        the ranks that die (torchrun's rendezvous store, a FileStore, a TCPStore on a separate
        host: not one a dying rank hosts). Collective over the ranks that go on, in the same order
        as their other communicator constructions.

        >>> try:
        ...     c.all_reduce(grad)
        ... except comm.PeerError:
        ...     c = c.shrink()            # the survivors go on without the dead rank
        """
        exclude = [_index(r, "exclude") for r in exclude]
        if any(not 0 <= r < self._world_size for r in exclude):
            raise ValueError(f"exclude must hold ranks in [0, {self._world_size}), got {exclude}")
        if self._rank in exclude:
            raise ValueError(f"exclude holds this rank ({self._rank}): an excluded rank does not call "
                             "shrink()")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
            raise ValueError(f"wait must be a number of seconds >= 0, got {wait!r}")
        prefix = f"{self._prefix}shrink{self._shrinks}/"
        self._shrinks += 1
        self.abort()  # the peers still inside a collective with this rank fail at once
        members = agree_membership(self._store, prefix, self._rank, self._world_size, exclude, float(wait),
                                   float(wait) + self._timeout_s)
        shrunk = Communicator(self._store, members.index(self._rank), len(members), timeout=self._timeout_s,
                              device=self._device, prefix=f"{prefix}comm/", **self._options)
        shrunk._root = self._root
        return shrunk

    def grow(self, expect: Optional[int] = None, wait: float = 5.0) -> "Communicator":
        """A new communicator over the ranks of this one and the processes that asked to join
        (:meth:`join`): the members keep their ranks, the joiners follow in the order they asked.
        Every rank calls it, at a point they agree on (a step boundary); the first to arrive takes
        in the requests filed since the last grow, waiting up to ``wait`` seconds for ``expect``
        of them when given (a request filed after that waits for the next grow). This
        communicator is closed; the new one has its timeout, device and tunables. Collective over
        the members, in the same order as their other communicator constructions.

        >>> c = c.grow(expect=1, wait=60)          # on every member
        >>> c = comm.Communicator.join(store, c_prefix)  # in the new process
        """
        if expect is not None and (isinstance(expect, bool) or not isinstance(expect, int) or expect < 0):
            raise ValueError(f"expect must be None or an int >= 0, got {expect!r}")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
            raise ValueError(f"wait must be a number of seconds >= 0, got {wait!r}")
        point = f"{self._prefix}grow{self._grows}/"
        self._grows += 1
        world, _ = admit(self._store, self._root, point, self._rank, self._world_size, f"{point}comm/",
                         expect or 0, float(wait) if expect else 0.0, self._timeout_s)
        self.close()
        grown = Communicator(self._store, self._rank, world, timeout=self._timeout_s, device=self._device,
                             prefix=f"{point}comm/", **self._options)
        grown._root = self._root
        return grown

    @property
    def prefix(self) -> str:
        """The store prefix processes pass to :meth:`join` to be taken in by a later
        :meth:`grow` (the first communicator's, through shrinks and grows)."""
        return self._root

    @classmethod
    def join(cls, store: "dist.Store", prefix: str, *,
             timeout: Union[timedelta, float] = DEFAULT_TIMEOUT, device=None, **tunables) -> "Communicator":
        """Asks to join the communicator whose :attr:`prefix` is ``prefix`` and waits (up to
        ``timeout``) until its members call :meth:`grow`; returns this process's rank in the grown
        communicator (after the members, in the order the joiners asked). ``tunables`` as the
        constructor's."""
        if not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be the members' Communicator.prefix, got {prefix!r}")
        timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        request = request_admission(store, prefix)
        new_prefix, rank, world = await_admission(store, prefix, request, timeout_s)
        grown = cls(store, rank, world, timeout=timeout, device=device, prefix=new_prefix, **tunables)
        grown._root = prefix
        return grown

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout_s)

    @property
    def closed(self) -> bool:
        return self._c.closed

    def device_problem(self, device: torch.device) -> Optional[str]:
        """Why tensors on ``device`` cannot travel through this communicator (None: they can)."""
        kind = torch.device(device).type
        if kind == "cpu" or (kind == "cuda" and is_cuda_build()):
            return None
        if kind == "cuda":
            return ("this braid build has no CUDA path (build braid where torch has CUDA and nvcc "
                    "exists), so its Communicator takes CPU tensors only; or run over an NCCL process group")
        return f"a braid Communicator takes CPU{' and CUDA' if is_cuda_build() else ''} tensors, not {kind}"

    def all_reduce_algorithm(self, nbytes: int) -> str:
        """Name of the algorithm all_reduce uses for a message of ``nbytes`` bytes: on one host
        "oneshot", "twoshot" or "ring"; across hosts, for small messages "oneshot" (one round trip
        among the host leaders) or "doubling" (recursive doubling among them, from four hosts), for
        larger ones "ring" (around a ring between hosts, from three) or at two hosts a direct
        exchange, "hierarchical" (each local rank's slice with its counterparts when every host
        holds the same number of ranks, more than one) or "leaders" (the host leaders alone)."""
        return self._c.all_reduce_algo(nbytes)

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Op = "sum", async_op: bool = False, *,
                   compression: Any = None, key: Hashable = "default",
                   step: Optional[int] = None) -> Any:
        """Reduces ``tensor`` across ranks in place. Results are bitwise identical on every rank.

        With ``compression`` (an ``Int8Quantizer``, ``Int4Quantizer``, ``TopK`` or ``Cast``) the
        tensor travels compressed; ``op`` must then be "sum" or "avg", ``key`` names the
        tensor's error-feedback residual (use one key per tensor that is reduced repeatedly), and
        ``step``, when given, replaces the key's call count in the compressor's warm-up (the DDP
        hook passes its iteration). Compressed calls set ``last_wire_bytes`` (a ``WireStats``:
        bytes sent and received by this rank, and what the uncompressed all-reduce would send);
        plain calls set it to None. Returns None, or with ``async_op`` a ``Work`` (a
        ``CompressedWork`` for a compressed call).
        """
        if compression is None:
            self.last_wire_bytes = None
            # The common spelling without a call: this line is on the latency of every small call.
            code = REDUCE_OPS.get(op) if op.__class__ is str else None
            if async_op.__class__ is not bool:
                async_op = _async_flag(async_op)
            w = self._c.all_reduce(tensor, op_code(op) if code is None else code, async_op)
            return None if w is None else Work(w, "all_reduce")
        # The compressor runs the call (braid.comm.compression sits above this module and is not
        # imported here): its fused one-call path on this communicator, or its algorithm over
        # these collectives.
        run = getattr(compression, "all_reduce_on_communicator", None)
        is_class = isinstance(compression, type)
        if is_class or not callable(run):
            hint = " (a class: pass an instance, e.g. Int8Quantizer())" if is_class else ""
            raise TypeError("compression must be a braid.comm compressor (Int8Quantizer(), Int4Quantizer(), "
                            f"TopK(ratio), Cast(dtype)) or None, got {compression!r}{hint}")
        work, self.last_wire_bytes = run(self, tensor, op, key=key, async_op=_async_flag(async_op), step=step)
        return work

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Op = "sum",
                       async_op: bool = False) -> Optional[Work]:
        """Reduces ``input`` (world_size * output.numel() elements) across ranks; rank r receives
        the reduced r-th slice in ``output``."""
        w = self._c.reduce_scatter(output, input, op_code(op), _async_flag(async_op))
        return _wrap(w, "reduce_scatter")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Optional[Work]:
        """Concatenates every rank's ``input`` into ``output`` (world_size * input.numel())."""
        return _wrap(self._c.all_gather(output, input, _async_flag(async_op)), "all_gather")

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, *,
                   output_split_sizes: Optional[Sequence[int]] = None,
                   input_split_sizes: Optional[Sequence[int]] = None) -> Optional[Work]:
        """Splits ``input`` into world_size equal chunks and sends chunk j to rank j; ``output``
        (same size, not overlapping) receives chunk j from rank j.

        With split sizes (as ``torch.distributed.all_to_all_single``): ``input`` is split along
        dimension 0 into ``input_split_sizes[j]`` rows for rank j, and ``output`` receives
        ``output_split_sizes[j]`` rows from rank j, in rank order; a list left None means equal
        splits of dimension 0. Rank i's ``input_split_sizes[j]`` must equal rank j's
        ``output_split_sizes[i]`` (a difference raises ``CollectiveMismatch`` on the receiver),
        and every rank must pass split sizes if one does. These travel point to point, each pair
        as its sizes need, instead of as one collective.

        CUDA tensors with split sizes go device to device between the ranks of one host (CUDA
        IPC), stream-ordered like the other collectives. Where that path is off (ranks on several
        hosts, ``BRAID_CUDA_IPC=0``, IPC refused) they take the fallback path, as :meth:`send`
        and :meth:`recv` do: the input is copied to pinned host memory on the caller's current
        stream (after the work queued on it) and the host waits for that copy; the exchange runs
        on host memory; the output is copied back on that stream (a blocking call queues the copy
        before it returns, an async one at ``wait()``, which also makes the then current stream
        wait).
        """
        if output_split_sizes is None and input_split_sizes is None:
            return _wrap(self._c.all_to_all(output, input, _async_flag(async_op)), "all_to_all")
        out_splits = _splits(output_split_sizes, "output_split_sizes")
        in_splits = _splits(input_split_sizes, "input_split_sizes")
        if self._host_tensors(output, input):
            w = self._c.all_to_all_v(output, input, out_splits, in_splits, _async_flag(async_op))
            return None if w is None else Work(w, "all_to_all")
        if self._device_to_device(output, input):
            return _wrap(self._c.all_to_all_v(output, input, out_splits, in_splits, _async_flag(async_op)),
                         "all_to_all")

        def exchange(t: list, async_op: bool) -> Optional[list]:
            w = self._c.all_to_all_v(t[0], t[1], out_splits, in_splits, async_op)
            return None if w is None else [w]

        works = self._on_host([("output", output, True), ("input", input, False)], exchange,
                              _async_flag(async_op))
        return None if works is None else Work(works[0], "all_to_all")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Optional[Work]:
        """Copies rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        if isinstance(src, bool) or not isinstance(src, int):
            raise TypeError(f"src must be an int rank, got {type(src).__name__}")
        if not 0 <= src < self._world_size:  # here too: a src past C++'s int would fail conversion first
            raise ValueError(f"src must be a rank in [0, {self._world_size}), got {src}")
        return _wrap(self._c.broadcast(tensor, src, _async_flag(async_op)), "broadcast")

    def barrier(self, async_op: bool = False) -> Optional[Work]:
        """Returns once every rank has called barrier()."""
        return _wrap(self._c.barrier(_async_flag(async_op)), "barrier")

    # -- registered buffers ----------------------------------------------------------------------
    def empty(self, *size: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A CPU tensor of ``size`` (ints or one sequence of them) and ``dtype`` in memory that the
        other ranks of this host can read: a shared-memory segment registered with this
        communicator (a *window*). Collectives whose data lies in such tensors on every rank of
        the host (past the one-shot sizes) read the peers' buffers in place instead of copying
        through braid's staging slots: all_gather's and all_to_all's and reduce_scatter's input,
        broadcast's tensor, an all_reduce's tensor (in place). Any other tensor works as before.

        Collective: every rank calls it, with the same number of bytes (a ValueError on every
        rank of a host where they differ), in the same order as its other ``empty`` / ``zeros``
        calls (the ranks of each host create and map their segments together, through the
        store, then a barrier of the whole communicator). Its contents are uninitialized. The
        memory is freed when the tensor and every view of it are gone. Where this rank is alone on
        its host, a plain tensor. Counts against the host's shared-memory file system (/dev/shm), like braid's
        own segments: where a rank of the host cannot make its segment (too little room, refused),
        it logs a warning and every rank of the host returns a plain tensor instead (as with
        ``BRAID_REGISTERED_BUFFERS=0`` on any of them).
        """
        dims = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else size
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
            raise ValueError(f"size must be non-negative ints, got {tuple(size)}")
        shape = torch.Size(dims)
        if not isinstance(dtype, torch.dtype) or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"dtype must be a real torch dtype, got {dtype!r}")
        wid = self._windows
        self._windows += 1
        here = [r for r, h in enumerate(self._hosts) if h == self._hosts[self._rank]]
        raw = None
        mismatch = ""
        nbytes = shape.numel() * dtype.itemsize
        if len(here) > 1:
            key = f"{self._prefix}window{wid}/"
            name = ""
            if os.environ.get("BRAID_REGISTERED_BUFFERS", "1") != "0":
                try:
                    name = self._c.window_create(wid, max(nbytes, 1))
                except Exception as e:  # a /dev/shm too small, a refused segment: the host falls back
                    logger.warning("braid: rank %d could not make a registered buffer of %d bytes (%s); "
                                   "the host's ranks use plain tensors for it", self._rank, nbytes, e)
            self._store.set(f"{key}{self._rank}", f"{nbytes}/{name}")
            sizes, names = zip(*(self._store.get(f"{key}{r}").decode().split("/", 1) for r in here))
            if len(set(sizes)) > 1:  # every rank refuses, after the barrier below
                mismatch = ("empty/zeros must ask for the same number of bytes on every rank of a host: "
                            + ", ".join(f"rank {r} asked for {b}" for r, b in zip(here, sizes)))
            if "" in names or mismatch:  # some rank of the host has none: plain tensors there, the same path
                if name:
                    self._c.window_free(wid)
            else:
                raw = self._c.window_attach(wid, list(names))
        # Every rank of the communicator, whatever its host did: each host's ranks have mapped
        # every segment of theirs once it returns, so the names can go.
        self.barrier()
        if mismatch:
            raise ValueError(mismatch)
        if raw is None:
            return torch.empty(shape, dtype=dtype)
        self._c.window_unlink(wid)
        return raw[:nbytes].view(dtype).view(shape)

    def zeros(self, *size: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:meth:`empty`, filled with zeros (collective as it is)."""
        return self.empty(*size, dtype=dtype).zero_()

    # -- point-to-point ----------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Optional[Work]:
        """Sends ``tensor`` to rank ``dst``, whose matching :meth:`recv` takes a tensor of the same
        dtype and number of elements (any shape).

        Transfers between two ranks are matched in the order each side issues them, per direction;
        there are no tags. A send completes once its data is handed over (ranks on one host buffer
        up to 4 MiB per pair), so a blocking send of a larger message waits for the receive: post
        exchanges with :meth:`batch_isend_irecv` or ``async_op=True``. Point-to-point runs in issue
        order with the collectives: a collective issued after a pending receive waits for it.
        A CUDA tensor takes the fallback path (:meth:`all_to_all`): copied to pinned host memory
        after the work queued on the caller's stream, the host waiting for the copy.
        """
        dst = _index(dst, "dst")

        def post(t: list, async_op: bool) -> Optional[list]:
            w = self._c.send(t[0], dst, async_op)
            return None if w is None else [w]

        works = self._on_host([("tensor", tensor, False)], post, _async_flag(async_op))
        return None if works is None else Work(works[0], f"send to rank {dst}")

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[Work]:
        """Receives into ``tensor`` what rank ``src`` sends (see :meth:`send`). A sender of another
        dtype or size raises ``CollectiveMismatch`` here. A CUDA tensor takes the fallback path
        (:meth:`all_to_all`): received in pinned host memory, copied back on the caller's stream
        (async: at ``wait()``)."""
        src = _index(src, "src")

        def post(t: list, async_op: bool) -> Optional[list]:
            w = self._c.recv(t[0], src, async_op)
            return None if w is None else [w]

        works = self._on_host([("tensor", tensor, True)], post, _async_flag(async_op))
        return None if works is None else Work(works[0], f"recv from rank {src}")

    def batch_isend_irecv(self, ops: Sequence["P2POp"]) -> list:
        """Posts every transfer of ``ops`` (:class:`P2POp`) at once and returns one :class:`Work`
        per op, in order. The transfers advance together, so a ring exchange (send to the next
        rank, receive from the previous) of any size cannot wait on its own send. Every op is
        checked before any is posted. CUDA tensors take the fallback path (:meth:`all_to_all`):
        what is sent copied to pinned host memory first, what is received copied back at the
        op's ``wait()``."""
        if type(ops) not in (list, tuple) and (isinstance(ops, P2POp) or not isinstance(ops, Sequence)):
            raise TypeError(f"ops must be a sequence of braid.comm.P2POp, got {type(ops).__name__}")
        spec = []
        for i, op in enumerate(ops):
            if type(op) is not P2POp and not isinstance(op, P2POp):
                raise TypeError(f"ops[{i}] must be a braid.comm.P2POp, got {type(op).__name__}")
            spec.append((op.op == "send", op.tensor, op.peer))
        named = [(f"ops[{i}].tensor", op.tensor, op.op == "recv") for i, op in enumerate(ops)]
        return self._post_p2p(spec, named)

    def _post_p2p(self, spec: list, named: Sequence[tuple]) -> list:
        """Posts checked transfers (``spec``: (is_send, tensor, peer) triples; ``named``: their
        (name, tensor, written) for :meth:`_staging`) and returns one :class:`Work` per transfer.
        Host tensors, the common case (a ring's every step), go straight to the core: the Python
        before posting is on every small exchange's latency path."""
        stage = self._staging(named)
        if stage is None:
            works = self._c.p2p_batch(spec)
        else:
            def post(t: list, _async_op: bool) -> list:
                return self._c.p2p_batch([(s, tensor, peer) for (s, _, peer), tensor in zip(spec, t)])

            works = _through_host(stage, [(t, written) for _, t, written in named], post, True)
        return [Work(w, f"send to rank {peer}" if is_send else f"recv from rank {peer}")
                for w, (is_send, _, peer) in zip(works, spec)]

    def send_recv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> Work:
        """Posts the send of ``send`` to ``dst`` and the receive of ``recv`` from ``src`` together
        (as :meth:`batch_isend_irecv`, CUDA tensors included); returns a :class:`Work` whose
        ``wait()`` completes both (its future: ``[recv]``)."""
        for name, t in (("send", send), ("recv", recv)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        dst, src = _index(dst, "dst"), _index(src, "src")
        if self._host_tensors(send, recv):  # one call into the core: every ring step's latency
            return Work(self._c.send_recv(send, dst, recv, src), f"send to rank {dst}, recv from rank {src}")
        return WorkList(self._post_p2p([(True, send, dst), (False, recv, src)],
                                       (("send", send, False), ("recv", recv, True))))

    @staticmethod
    def _host_tensors(a: Any, b: Any) -> bool:
        """Whether a call on ``a`` and ``b`` goes straight to the core, neither being on a CUDA
        device: the fast path of the latency-bound calls (send_recv, all_to_all with split sizes),
        which skips :meth:`_staging`. Anything else is left to that method and the binding."""
        return not (getattr(a, "is_cuda", False) or getattr(b, "is_cuda", False))

    def _staging(self, named: Sequence[tuple]) -> Optional[_HostStaging]:
        """The fallback path's copies for a call on ``named``'s tensors ((name, tensor, written)
        triples): None when none is on a CUDA device; a ValueError naming the tensor for CUDA
        tensors this build cannot take, or CUDA tensors on two devices. Tensors on other devices
        are left to the binding's checks."""
        device = None
        for name, t, _ in named:
            if not isinstance(t, torch.Tensor) or not t.is_cuda:
                continue
            problem = self.device_problem(t.device)
            if problem is not None:
                raise ValueError(f"{name} is on {t.device}, but {problem}")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"{name} is on {t.device}, another tensor of the call on {device}: a call's "
                                 "CUDA tensors must share one device")
        return None if device is None else _HostStaging(device)

    def _device_to_device(self, *tensors: torch.Tensor) -> bool:
        """Whether a call on ``tensors`` runs device to device (CUDA IPC): all of them on one CUDA
        device whose channel is on. The first such call sets the channel up, a collective of every
        rank (each reaches it at the same call)."""
        first = tensors[0]
        if not isinstance(first, torch.Tensor) or not first.is_cuda or not hasattr(self._c, "device_ipc"):
            return False
        if any(not isinstance(t, torch.Tensor) or t.device != first.device for t in tensors):
            return False  # the binding names the argument on the wrong device
        return self._c.device_ipc(first.device.index)

    def _on_host(self, named: Sequence[tuple], call: Callable[[list, bool], Optional[list]],
                 async_op: bool) -> Optional[list]:
        """``call(tensors, async_op)``, a call the core runs on host memory only (its works, or None
        when blocking), on ``named``'s tensors ((name, tensor, written) triples): as they are on
        the CPU, through :func:`_through_host` where they are on a CUDA device."""
        stage = self._staging(named)
        if stage is None:
            return call([t for _, t, _ in named], async_op)
        return _through_host(stage, [(t, written) for _, t, written in named], call, async_op)

    def close(self) -> None:
        """Finishes queued work, leaves the group and frees its resources. Idempotent; also runs
        on garbage collection and at interpreter exit."""
        if self._finalizer.alive:
            self._c.close()  # raises when re-entrant; the finalizer then stays armed
            self._finalizer.detach()

    def abort(self) -> None:
        """Closes without waiting for queued work: the collective in progress and every queued
        one fail at once with ``CommClosed`` ("aborted"), the peers raise ``PeerError``, and the
        communicator is closed. For error handling, when a peer is known to be gone or stuck;
        ``close()`` is the normal way out."""
        if self._finalizer.alive:
            self._c.abort()
            if self._c.closed:  # not when called from inside one of its collectives
                self._finalizer.detach()

    def __reduce__(self):
        raise TypeError("a braid Communicator cannot be pickled (it is a live connection to its "
                        "peers): build one in each process, or drop it from what you save")

    def __copy__(self) -> "Communicator":
        return self

    def __deepcopy__(self, memo: dict) -> "Communicator":
        """A communicator is a handle on the group, not data: copies of a model that holds one
        (``copy.deepcopy(model)``) share it."""
        return self

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<braid.comm.Communicator rank={self._rank} world_size={self._world_size} {state}>"


def init(store: Optional["dist.Store"] = None, rank: Optional[int] = None,
         world_size: Optional[int] = None, **kwargs) -> Communicator:
    """Builds a communicator from what the launcher provides.

    In order: the explicit ``store``/``rank``/``world_size``; the default process group's store
    when ``torch.distributed`` is initialized; the torchrun environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); SLURM's (SLURM_PROCID, SLURM_NTASKS, the first host of
    SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, a port derived from SLURM_JOB_ID) where torchrun's
    are absent. Keyword arguments go to :class:`Communicator`.
    """
    if store is None and dist.is_available() and dist.is_initialized():
        store = dist.PrefixStore("braid/", dist.distributed_c10d._get_default_store())
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if rank is None:
        rank = launch_rank()
    if world_size is None:
        world_size = launch_world_size()
    if store is None:
        store = launch_store(rank, world_size, kwargs.get("timeout", timedelta(seconds=300)))
    return Communicator(store, rank, world_size, **kwargs)
