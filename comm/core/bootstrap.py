"""A communicator's bootstrap through a torch.distributed Store: the ranks publish their host
identity, shared-memory segment names and (across hosts) TCP endpoints, rank 0 draws the job's
secret that TCP peers prove, and every wait ends at the deadline or as soon as a peer publishes
why it could not join."""
from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import Sequence

import torch.distributed as dist

from .errors import CommError, CommTimeout
from .hosts import host_identity, host_numbers
from .launch_env import bind_address

# How often a bootstrap wait looks for a peer's published failure.
POLL_S = 0.1


def trace_id(parts: Sequence[str]) -> str:
    """A short name for a communicator, equal on every rank (from what every rank gathered)."""
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


class Bootstrap:
    """The store traffic of one communicator: its keys live under ``prefix``, and each wait gives
    up ``timeout_s`` seconds after it began."""

    def __init__(self, store: "dist.Store", prefix: str, rank: int, world_size: int, timeout_s: float):
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

    def key(self, name: str) -> str:
        return self.prefix + name

    def gather(self, name: str, value: str, what: str) -> list:
        """Publishes ``value`` under name/rank and returns every rank's value."""
        self.store.set(self.key(f"{name}/{self.rank}"), value)
        keys = [self.key(f"{name}/{r}") for r in range(self.world_size)]
        self.wait(keys, what)
        # One round trip for all N values (a get each would be N: at many hosts the bootstrap's
        # store traffic per rank is then its share of the bytes, not N waits on the store).
        return [v.decode() for v in self.store.multi_get(keys)]

    def tell_peers(self, error: BaseException) -> None:
        """Publishes why this rank could not join, so that the others raise at once instead of
        waiting for it until the deadline. Best effort: the store may be what failed."""
        if self.world_size == 1 or isinstance(error, CommTimeout):
            return
        try:
            self.store.set(self.key("failed"), f"rank {self.rank} could not join the communicator: "
                           f"{type(error).__name__}: {error}")
        except Exception:  # noqa: BLE001 - the original error is what the caller must see
            pass

    def wait(self, keys: Sequence[str], what: str) -> None:
        """Waits for ``keys``, looking at the store with a growing pause (0.5 ms up to 20 ms)
        between looks, so that a peer's published failure ends the wait. (A store wait with a
        short timeout would do the same, but a TCPStore logs two warnings per timed-out slice.)"""
        deadline = time.monotonic() + self.timeout_s
        failed = self.key("failed")
        keys = list(keys)
        pause = 0.0005
        while not self.store.check(keys):
            if self.store.check([failed]):
                raise CommError(self.store.get(failed).decode()) from None
            if time.monotonic() >= deadline:
                missing = [k.rsplit("/", 1)[-1] for k in keys if not self.store.check([k])]
                raise CommTimeout(f"rank {self.rank}: ranks [{', '.join(missing)}] did not {what} "
                                  f"within {self.timeout_s:g} s") from None
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, POLL_S / 5)

    def join(self) -> list:
        """Which ranks share a host: equal numbers for equal published host identities
        (host_identity()), in rank order. Rank 0 first draws the communicator's secret: once this
        first gather completes, the secret is there for every rank to read without a wait of its own."""
        if self.world_size == 1:
            return [0]
        if self.rank == 0:
            self.store.set(self.key("secret"), os.urandom(32).hex())
        return host_numbers(self.gather("host", host_identity(), "join the communicator"))

    def connect(self, core) -> str:
        """Joins the C++ communicator ``core`` to its peers: every rank maps every other's
        shared-memory segment, the segments are unlinked once all have mapped them, and ranks on
        different hosts exchange TCP endpoints. Returns the communicator's trace id (the flight
        recorder's name of it: the same on every rank, new every run)."""
        me = f"{core.segment_name()}|{os.getpid()}|{socket.gethostname()}"
        if self.world_size == 1:
            return trace_id([self.prefix, me])
        peers = []
        entries = self.gather("seg", me, "publish their shared memory")
        comm_id = trace_id([self.prefix, *entries])
        for entry in entries:
            name, pid, host = entry.split("|", 2)
            peers.append((name, int(pid), host))
        core.attach(peers)
        # Unlink once every rank has mapped every segment: nothing can leak after this point.
        if self.store.add(self.key("attached"), 1) == self.world_size:
            self.store.set(self.key("attached_all"), "1")
        endpoints = self._publish_endpoint(core) if core.num_hosts > 1 else None
        # Across hosts every rank published its endpoint after counting itself attached, so the
        # endpoints' gather has already seen the count complete: this wait returns at once.
        self.wait([self.key("attached_all")], "map the shared memory")
        core.unlink_own()
        if endpoints is not None:
            labels = [f"rank {r} ({endpoints[r]} on {peers[r][2]})" for r in range(self.world_size)]
            core.connect_tcp(endpoints, labels)
        return comm_id

    def _publish_endpoint(self, core) -> list:
        """TCP between the ranks of different hosts: this rank listens, authenticating peers by
        the communicator's secret (rank 0 drew it before the first gather), and every rank's
        endpoint is gathered (connect_tcp then opens connections: by default when an algorithm
        first uses a pair)."""
        secret = bytes.fromhex(self.store.get(self.key("secret")).decode())
        endpoint = core.listen_tcp(bind_address(self.store), secret)
        return self.gather("tcp", endpoint, "publish their TCP endpoints")


def agree_membership(store: "dist.Store", prefix: str, rank: int, world_size: int, exclude: Sequence[int],
                     wait_s: float, timeout_s: float) -> list:
    """The ranks that go on, agreed through the store (keys under ``prefix``): every caller
    registers; the first to claim the decision waits until every rank neither excluded nor yet
    registered has registered, or ``wait_s`` seconds, and publishes the registered ranks in order;
    every caller reads that list (at most ``timeout_s`` seconds). A rank registering after the list
    was published is not in it: it raises CommError, as does any caller when the decider vanishes
    before publishing (CommTimeout)."""
    store.set(f"{prefix}alive/{rank}", "1")
    expected = [r for r in range(world_size) if r not in set(exclude)]
    members_key = f"{prefix}members"
    if store.compare_set(f"{prefix}decider", "", str(rank)).decode() == str(rank):
        deadline = time.monotonic() + wait_s
        while True:
            arrived = [r for r in expected if store.check([f"{prefix}alive/{r}"])]
            if len(arrived) == len(expected) or time.monotonic() >= deadline:
                break
            time.sleep(min(POLL_S / 5, max(0.0, deadline - time.monotonic())))
        store.set(members_key, ",".join(map(str, arrived)))
    deadline = time.monotonic() + timeout_s
    while not store.check([members_key]):
        if time.monotonic() >= deadline:
            raise CommTimeout(f"rank {rank}: the ranks that go on were not agreed within {timeout_s:g} s "
                              "(the rank deciding them left before publishing them)")
        time.sleep(POLL_S / 5)
    members = [int(r) for r in store.get(members_key).decode().split(",") if r]
    if rank not in members:
        raise CommError(f"rank {rank} arrived after the ranks that go on were agreed ({members}): it is "
                        "left out")
    return members


def request_admission(store: "dist.Store", root: str) -> int:
    """Files a process's request to join the communicators under ``root``; returns its number."""
    return int(store.add(f"{root}joiners/count", 1))


def admit(store: "dist.Store", root: str, point: str, rank: int, world_size: int, new_prefix: str,
          expect: int, wait_s: float, timeout_s: float) -> tuple:
    """The members' side of a grow: the first member to claim ``point`` takes in the requests
    filed since the last grow (waiting up to ``wait_s`` seconds for ``expect`` of them), numbers
    them world_size, world_size + 1, ... in the order they were filed, and publishes that to
    them (``root``joined/<i>) and to the other members (``point``admitted). Returns
    (new world size, the requests taken in)."""
    admitted_key = f"{point}admitted"
    if store.compare_set(f"{point}decider", "", str(rank)).decode() == str(rank):
        taken_key = f"{root}joiners/taken"
        taken = int(store.get(taken_key).decode()) if store.check([taken_key]) else 0
        deadline = time.monotonic() + wait_s
        while True:
            count = int(store.add(f"{root}joiners/count", 0))
            if count - taken >= expect or time.monotonic() >= deadline:
                break
            time.sleep(min(POLL_S / 5, max(0.0, deadline - time.monotonic())))
        joiners = list(range(taken + 1, count + 1))
        new_world = world_size + len(joiners)
        for i, request in enumerate(joiners):
            store.set(f"{root}joined/{request}", f"{new_prefix}|{world_size + i}|{new_world}")
        store.set(taken_key, str(count))
        store.set(admitted_key, f"{new_world}|" + ",".join(map(str, joiners)))
    deadline = time.monotonic() + wait_s + timeout_s
    while not store.check([admitted_key]):
        if time.monotonic() >= deadline:
            raise CommTimeout(f"rank {rank}: the ranks to take in were not agreed within "
                              f"{wait_s + timeout_s:g} s (the member deciding them left before "
                              "publishing them)")
        time.sleep(POLL_S / 5)
    world, joiners = store.get(admitted_key).decode().split("|")
    return int(world), [int(j) for j in joiners.split(",") if j]


def await_admission(store: "dist.Store", root: str, request: int, timeout_s: float) -> tuple:
    """The joiner's side: waits until a grow took request ``request`` in; returns (prefix, rank,
    world size) of the communicator to build."""
    key = f"{root}joined/{request}"
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise CommTimeout(f"no communicator under {root!r} took this process in within {timeout_s:g} s "
                              "(its members call grow() to take joiners in)")
        time.sleep(pause)
        pause = min(pause * 2, POLL_S / 5)
    prefix, rank, world = store.get(key).decode().split("|")
    return prefix, int(rank), int(world)
