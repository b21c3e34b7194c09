"""torch process groups (gloo, NCCL, braid's c10d backend) as carriers of braid's compressed bytes,
through braid's group interface (comm/core/group.py).

braid compresses on the tensor's device; a :class:`GroupCarrier` moves the packed bytes with the
group's all-to-all and all-gather, and sums what arrives in rank order, in float32, so results
are bitwise identical on every rank whatever the backend. :class:`HostGroups` splits a group by
host (exact inside a host, compressed across hosts).

Ordering: a group's collectives must be issued in the same order on every rank. CPU work runs on
one issue thread per process, in submission order (the caller goes on: a DDP backward keeps
computing while buckets travel); CUDA work is issued at once on the caller's current stream,
stream-ordered, and its future (``Future(devices=[device])``) completes on that stream.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from .group import DefaultGroup, Group, adapter, as_group, process_group_of
from .hosts import host_identity, host_numbers


def process_group_for(group: Optional[dist.ProcessGroup], arg: str) -> dist.ProcessGroup:
    """The torch ProcessGroup of ``group`` (None: the default group, resolved now), this rank a
    member of it: as_group's normalization (the one there is), then the ProcessGroup under it. A
    TypeError naming ``arg`` for what has none (a braid Communicator, another Group)."""
    g = as_group(group, arg)
    if isinstance(g, DefaultGroup):
        g.resolve()
    pg = process_group_of(g)
    if pg is None:
        raise TypeError(f"{arg} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return pg


class GroupCarrier:
    """One group as the carrier of packed bytes: equal-split all-to-all and all-gather, and the
    fixed-order reductions built on them. The bytes move through braid's group interface
    (comm/core/group.py): over a ProcessGroup (adapted), or over any braid Group, a Communicator
    included (its fused compressed all-reduce then runs as this algorithm, call by call; use it
    from one thread only). Calls block on CPU tensors and are stream-ordered on CUDA ones (as the
    group's synchronous collectives are). Tensors on a device the group has no backend for (CUDA
    tensors over a gloo group) travel through host memory."""

    def __init__(self, group: Union[dist.ProcessGroup, Group]):
        self.group = group
        self._group = adapter(group) if isinstance(group, dist.ProcessGroup) else group
        # A braid Group (a Communicator) is used from the caller's thread too: its jobs run inline.
        self.inline = not isinstance(group, dist.ProcessGroup)
        self.rank = self._group.rank
        self.size = self._group.world_size

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``inp`` in ``size`` equal pieces, piece j to rank j; ``out`` piece j from rank j."""
        self._group.all_to_all(out, inp)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` = every rank's ``inp``, in rank order."""
        self._group.all_gather(out, inp)

    def all_reduce(self, tensor: torch.Tensor, average: bool) -> None:
        """The group's own all-reduce (sum; avg divides after, integers truncating), for buckets
        that travel as they are."""
        self._group.all_reduce(tensor, "avg" if average else "sum")

    def sum_slices(self, x: torch.Tensor, per: int) -> torch.Tensor:
        """Reduce-scatter in a fixed order: slice ``rank`` (``per`` elements) of the 1-D ``x``,
        zero padded to ``size * per``, summed over the ranks in rank order, in float32."""
        n, numel = self.size, x.numel()
        padded = x
        if n * per != numel:
            padded = torch.zeros(n * per, dtype=x.dtype, device=x.device)
            padded[:numel] = x
        if n == 1:
            return padded.to(torch.float32, copy=True)
        recv = torch.empty_like(padded)
        self.all_to_all(recv, padded)
        parts = recv.view(n, per)
        acc = parts[0].to(torch.float32, copy=True)
        for r in range(1, n):  # rank order: every rank sums its slice's pieces alike
            acc.add_(parts[r])
        return acc

    def gather_slices(self, mine: torch.Tensor, x: torch.Tensor) -> None:
        """The 1-D ``x`` = every rank's slice ``mine`` in rank order, cut to ``x``'s size."""
        if self.size == 1:
            x.copy_(mine[: x.numel()])
            return
        out = torch.empty(self.size * mine.numel(), dtype=mine.dtype, device=mine.device)
        self.all_gather(out, mine)
        x.copy_(out[: x.numel()])

    def reduce_exact(self, x: torch.Tensor, average: bool, divisor: int) -> None:
        """Exact all-reduce of the 1-D ``x`` in place, in braid's order: each slice summed in rank
        order in float32, divided by ``divisor`` when ``average``, rounded once to x's dtype."""
        if x.numel() == 0:
            return
        acc = self.sum_slices(x, -(-x.numel() // self.size))
        if average:
            acc.div_(divisor)
        self.gather_slices(acc.to(x.dtype), x)

    def __repr__(self) -> str:
        return f"<braid GroupCarrier rank {self.rank} of {self.size}>"


def _check_members(group: dist.ProcessGroup, intra: dist.ProcessGroup, inter: dist.ProcessGroup) -> None:
    """intra and inter hold ranks of group only, and share exactly this rank."""
    if not dist.is_initialized():
        return
    members = set(dist.get_process_group_ranks(group))
    for name, g in (("intra", intra), ("inter", inter)):
        outside = sorted(set(dist.get_process_group_ranks(g)) - members)
        if outside:
            raise ValueError(f"{name} holds ranks {outside}, which are not in group")
    shared = set(dist.get_process_group_ranks(intra)) & set(dist.get_process_group_ranks(inter))
    if len(shared) != 1:
        raise ValueError(f"intra and inter must share exactly one rank (this one), they share "
                         f"{sorted(shared)}")


class HostGroups:
    """A process group split by host, for compressed all-reduces that are exact inside a host and
    compressed only across hosts (ZeRO++ qgZ's idea): the host reduce-scatters the tensor exactly
    (``intra``: this rank's host), local rank i compresses slice i and all-reduces it with the
    ranks of local index i on the other hosts (``inter``), and the host all-gathers the slices.

    Build it with :func:`host_groups` (from the ranks' host identity), or from groups of your own:
    every host must hold the same number of ranks, so ``intra.size() * inter.size()`` must equal
    ``group.size()``, and both must hold this rank and ranks of ``group`` only. The three may also
    be braid Groups (Communicators over the job, this host's ranks, and this local index's ranks:
    the hierarchical pair of a braid job), whose membership the caller vouches for.
    """

    def __init__(self, group: Optional[Union[dist.ProcessGroup, Group]],
                 intra: Union[dist.ProcessGroup, Group], inter: Union[dist.ProcessGroup, Group]):
        if all(isinstance(g, Group) for g in (group, intra, inter)):
            sizes = (group.world_size, intra.world_size, inter.world_size)
        else:
            group = process_group_for(group, "group")
            intra, inter = process_group_for(intra, "intra"), process_group_for(inter, "inter")
            sizes = (group.size(), intra.size(), inter.size())
        if sizes[1] * sizes[2] != sizes[0]:
            raise ValueError(f"intra and inter: intra.size() * inter.size() must equal group.size() "
                             f"({sizes[0]}), got {sizes[1]} * {sizes[2]}: every host must hold "
                             "the same number of ranks")
        if isinstance(group, dist.ProcessGroup):
            _check_members(group, intra, inter)
        self.group, self.intra, self.inter = GroupCarrier(group), GroupCarrier(intra), GroupCarrier(inter)
        self.rank, self.size = self.group.rank, self.group.size

    def reduce_exact(self, x: torch.Tensor, average: bool, divisor: int) -> None:
        """The exact all-reduce (warm-up steps) over the whole group, in rank order."""
        self.group.reduce_exact(x, average, divisor)

    def all_reduce(self, tensor: torch.Tensor, average: bool) -> None:
        self.group.all_reduce(tensor, average)

    def __repr__(self) -> str:
        return (f"<braid HostGroups rank {self.rank} of {self.size}: {self.inter.size} hosts x "
                f"{self.intra.size} ranks>")


def host_groups(group: Optional[dist.ProcessGroup] = None) -> Optional[HostGroups]:
    """Splits ``group`` (None: the default group) by host identity, as braid's communicator tells
    hosts apart (same machine and /dev/shm, or ``BRAID_HOST_ID``).

    Collective over the whole job, as ``torch.distributed.new_group`` is: every rank calls it, in
    the same order as its other group creations; a rank outside ``group`` passes what new_group
    returned to it (``GroupMember.NON_GROUP_MEMBER``) and gets None. Raises ValueError (on every
    rank) when the group's hosts hold different numbers of ranks."""
    member = not (isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER)
    g = process_group_for(group, "group") if member else None
    entries: list = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (host_identity(), dist.get_process_group_ranks(g) if member else None))
    ranks = next((e[1] for e in entries if e[1] is not None), None)
    if ranks is None:
        raise ValueError("group: no rank of the job passed a process group it belongs to")
    ids = host_numbers([entries[r][0] for r in ranks])
    hosts = [[ranks[i] for i in range(len(ranks)) if ids[i] == h] for h in range(max(ids) + 1)]
    sizes = [len(h) for h in hosts]
    if len(set(sizes)) != 1:
        raise ValueError(f"group: hierarchical compression needs the same number of ranks on every host, got "
                         f"hosts of {sizes} ranks (set BRAID_HOST_ID to group ranks differently, or compress "
                         "without hierarchical)")
    # Every rank of the job makes every group, in the same order (new_group's contract); each
    # keeps the two it belongs to.
    me, intra, inter = dist.get_rank(), None, None
    for members in hosts:
        made = dist.new_group(members)
        intra = made if me in members else intra
    for i in range(sizes[0]):
        members = [h[i] for h in hosts]
        made = dist.new_group(members)
        inter = made if me in members else inter
    return HostGroups(g, intra, inter) if member else None


Carrier = Union[GroupCarrier, HostGroups]


def carrier_of(group, arg: str = "process_group") -> Carrier:
    """The carrier of ``group``: a ProcessGroup, None (the default group), or a HostGroups."""
    if isinstance(group, (GroupCarrier, HostGroups)):
        return group
    return GroupCarrier(process_group_for(group, arg))


class _IssueThread:
    """Runs the CPU work of every carrier of this process one job at a time, in submission order.

    Every rank submits in program order, so every group sees its collectives in the same order on
    every rank; two threads issuing on one group could interleave them differently per rank. A job
    submitted from this thread (a future's callback that reduces again) runs at once, in place,
    instead of waiting behind itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: Optional[int] = None
        self._queue: Optional[queue.SimpleQueue] = None
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Callable[[], None], result: list) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        if threading.current_thread() is self._thread:
            _run(job, result, fut)
            return fut
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child (threads do not survive fork)
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._queue,), daemon=True,
                                                name="braid-group-issue")
                self._thread.start()
                self._pid = os.getpid()
            self._queue.put((job, result, fut))
        return fut

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        while True:
            _run(*jobs.get())


def _run(job: Callable[[], None], result: list, fut: torch.futures.Future) -> None:
    try:
        job()
    except Exception as e:  # noqa: BLE001 - the caller's wait() or the future raises it
        fut.set_exception(e)
        return
    fut.set_result(result)


_ISSUE = _IssueThread()


def issue(job: Callable[[], None], result: list, device: torch.device, inline: bool = False
          ) -> torch.futures.Future:
    """Runs ``job`` (kernels and a carrier's collectives) for tensors on ``device``; returns a
    future of ``result``. CPU: on the issue thread, in submission order, or now with ``inline``
    (a carrier over a braid Communicator, whose other calls the caller issues from its own thread:
    two threads would interleave them differently on different ranks). CUDA: now, on the current
    stream; the future is a ``Future(devices=[device])`` completed on that stream."""
    if inline and device.type != "cuda":
        fut = torch.futures.Future()
        _run(job, result, fut)
        return fut
    if device.type == "cuda":
        fut = torch.futures.Future(devices=[device])
        job()
        fut.set_result(result)
        return fut
    return _ISSUE.submit(job, result)


def resolve_hosts(hierarchical, group, where: str = "") -> Optional[HostGroups]:
    """The HostGroups a layer's ``hierarchical`` argument names over ``group`` (a Group): None for
    False or None, the HostGroups given, or for True the group split by host (a ProcessGroup's by
    ``host_groups()``, a Communicator's by its ``split_by_host()``). ``where`` prefixes errors."""
    if hierarchical is False or hierarchical is None:
        return None
    if not isinstance(hierarchical, (bool, HostGroups)):
        raise TypeError(f"{where}hierarchical must be a bool or a HostGroups, got "
                        f"{type(hierarchical).__name__}")
    hosts = hierarchical
    if hierarchical is True:
        pg = process_group_of(group)
        if pg is not None:
            hosts = host_groups(pg)
        elif hasattr(group, "split_by_host"):
            hosts = group.split_by_host()
        else:
            raise ValueError(f"{where}hierarchical=True cannot split a {type(group).__name__} by host: pass "
                             "hierarchical=HostGroups(group, host_group, local_index_group)")
    if hosts.size != group.world_size or hosts.rank != group.rank:
        raise ValueError(f"{where}hierarchical: the HostGroups (rank {hosts.rank} of {hosts.size}) are not "
                         f"the group's (rank {group.rank} of {group.world_size})")
    return hosts
