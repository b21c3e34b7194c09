"""The replica quorum, held by a torch Store: who trains in each epoch, who failed, who joins.

An *epoch* is a stretch of steps with fixed membership. Its members are agreed once, at a step
boundary, through the store (no separate service): every process that goes on registers, one of
them (the *decider*, whoever claims the key first) waits until each expected replica has
registered or is found dead, and publishes the list once (compare-and-set, so a second decider
can only read it). Liveness comes from heartbeats: each process bumps a counter in the store from
a thread; a counter that stops moving for ``dead_after_s`` marks its replica dead, so survivors
do not wait a timeout for a replica that was killed.

Keys, under the Manager's prefix::

    secret                 digest of the job's secret (the first process sets it)
    epoch                  the latest epoch whose members are published
    joins                  counter of join requests; join/<i> = "<replica>:<incarnation>"
    committed              steps the job has committed (written off the training thread, so
                           it may lag by a heartbeat)
    ranks_per_replica      the ranks of every replica (the first process sets it)
    hb/<replica>           heartbeat counter of the replica's running process (its rank 0);
                           hb/<replica>.<i> of its rank i in a replica of several ranks
    e<E>/alive/<replica>   a registration: "<incarnation>:<step>:<member of E-1: 0|1>"
    e<E>/decider           the replica deciding epoch E
    e<E>/members           the published epoch (``Epoch.text``)
    e<E>/s<step>           the decision of one step: "commit" or "discard"
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from braid.comm.core.errors import CommTimeout

POLL_S = 0.01  # between looks at the store while waiting (every wait is a loop of short calls)


class FTError(RuntimeError):
    """A fault-tolerance protocol error that the process cannot recover from (refused join, too
    few replicas within the timeout, a store gone)."""


@dataclasses.dataclass(frozen=True)
class Registration:
    """One process's entry for an epoch: its replica, its incarnation (random per process start),
    the number of steps it has committed and whether it was a member of the epoch before."""

    replica: int
    incarnation: str
    step: int
    continuing: bool

    def text(self) -> str:
        return f"{self.replica}:{self.incarnation}:{self.step}:{int(self.continuing)}"

    @staticmethod
    def parse(text: str) -> "Registration":
        replica, incarnation, step, continuing = text.split(":")
        return Registration(int(replica), incarnation, int(step), continuing == "1")


@dataclasses.dataclass(frozen=True)
class Epoch:
    """A published membership: the members in rank order (by replica id), the replica whose state
    the others that are behind receive (``source``), and the number of join requests it took in
    (requests past it are pending)."""

    number: int
    members: List[Registration]
    joins_upto: int  # -1: no member holds the job's state (every holder died): the job cannot go on

    @property
    def lost(self) -> bool:
        return self.joins_upto < 0

    @property
    def source(self) -> Registration:
        """The member with the most committed steps; among equals one that continues from the
        epoch before (it holds the agreed state), then the lowest replica id."""
        return min(self.members, key=lambda m: (-m.step, not m.continuing, m.replica))

    def receivers(self) -> List[Registration]:
        """Members whose state is not the source's: behind it, or new (a fresh process, a replica
        that was left out). At the first epoch every member but the source."""
        src = self.source
        return [
            m for m in self.members if m.replica != src.replica and (m.step != src.step or not m.continuing)
        ]

    def rank_of(self, replica: int) -> Optional[int]:
        for i, m in enumerate(self.members):
            if m.replica == replica:
                return i
        return None

    def participants_text(self) -> str:
        return ", ".join(f"replica {m.replica} at step {m.step}" for m in self.members) or "no replica"

    def text(self) -> str:
        return f"{self.joins_upto}|" + ",".join(m.text() for m in self.members)

    @staticmethod
    def parse(number: int, text: str) -> "Epoch":
        joins, members = text.split("|")
        return Epoch(number, [Registration.parse(m) for m in members.split(",") if m], int(joins))


def secret_digest(secret: str) -> str:
    return hashlib.sha256(b"braid-ft\0" + secret.encode()).hexdigest()


def check_secret(store: dist.Store, secret: str) -> None:
    """The first process of a job records its secret's digest; a process with another secret is
    refused (it belongs to another job that shares the store and prefix)."""
    mine = secret_digest(secret)
    held = store.compare_set("secret", "", mine).decode()
    if held != mine:
        raise FTError(
            "refused to join: this process's secret (BRAID_FT_SECRET) is not the job's; it belongs "
            "to another job, or the job was started with another secret on the same store and prefix"
        )


def check_ranks_per_replica(store: dist.Store, ranks: int) -> None:
    """Every replica of a job has the same number of ranks (rank i of each meets the others' in
    lane i); the first process records it, a process of another shape is refused."""
    held = store.compare_set("ranks_per_replica", "", str(ranks)).decode()
    if held != str(ranks):
        raise FTError(
            f"refused to join: this replica has {ranks} rank(s) (its replica_group), the job's "
            f"replicas have {held}"
        )


def heartbeat_key(replica: int, rank: int = 0) -> str:
    return f"hb/{replica}" if rank == 0 else f"hb/{replica}.{rank}"


def _get(store: dist.Store, key: str) -> Optional[str]:
    return store.get(key).decode() if store.check([key]) else None


class Heartbeat:
    """Bumps ``hb/<replica>`` every ``period_s`` from a daemon thread, and reads the join counter
    while it is at it (so a pending join costs the training loop no store call)."""

    def __init__(self, store: dist.Store, replica: int, period_s: float, rank: int = 0):
        self._store = store
        self._key = heartbeat_key(replica, rank)
        self._period_s = period_s
        self._stop = threading.Event()
        self.joins = 0
        self.committed = 0  # steps this replica committed, published as the job's "committed"
        self._published = 0
        self.error: Optional[BaseException] = None
        self._stale: List[str] = []  # keys no one reads again, deleted off the training thread
        self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._run, name="braid-ft-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self._store.add(self._key, 1)
                self.joins = self._store.add("joins", 0)
                if self.committed != self._published:
                    self._published = self.committed
                    self._store.set("committed", str(self._published))
                while self._stale:
                    self._store.delete_key(self._stale.pop())
            except Exception as e:  # the store is gone: the next quorum reports it
                self.error = e
                return

    def delete_later(self, key: str) -> None:
        self._stale.append(key)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


class Liveness:
    """Who is dead, judged by heartbeats: a replica one of whose ranks' counters has not moved for
    ``dead_after_s`` since this watcher first looked (a replica lives and dies with all its
    ranks). A rank without a counter has not started yet (at the first epoch, one still importing
    torch): it is waited for, up to the quorum timeout."""

    def __init__(self, store: dist.Store, dead_after_s: float, ranks_per_replica: int = 1):
        self._store = store
        self._dead_after_s = dead_after_s
        self._ranks = ranks_per_replica
        self._seen: Dict[str, tuple] = {}

    def dead(self, replica: int) -> bool:
        return any(self._stopped(heartbeat_key(replica, i)) for i in range(self._ranks))

    def _stopped(self, key: str) -> bool:
        if not self._store.check([key]):
            return False
        value = self._store.add(key, 0)
        now = time.monotonic()
        last = self._seen.get(key)
        if last is None or last[0] != value:
            self._seen[key] = (value, now)
            return False
        return now - last[1] >= self._dead_after_s


def latest_epoch(store: dist.Store) -> Optional[int]:
    text = _get(store, "epoch")
    return None if text is None else int(text)


def read_epoch(store: dist.Store, number: int) -> Optional[Epoch]:
    text = _get(store, f"e{number}/members")
    return None if text is None else Epoch.parse(number, text)


def request_join(store: dist.Store, replica: int, incarnation: str) -> int:
    """Files a join request; members see it at their next step boundary."""
    index = store.add("joins", 1)
    store.set(f"join/{index}", f"{replica}:{incarnation}")
    return index


def _joiners(store: dist.Store, after: int, upto: int) -> List[int]:
    out = []
    for i in range(after + 1, upto + 1):
        text = _get(store, f"join/{i}")
        if text is not None:
            out.append(int(text.split(":")[0]))
    return out


def _expected(store: dist.Store, number: int, num_replicas: int) -> tuple:
    """The replicas epoch ``number`` waits for and the join count it takes in: at the first epoch
    every replica of the job; later the members of the epoch before and the replicas that asked to
    join since."""
    joins = int(store.add("joins", 0))
    if number == 0:
        return set(range(num_replicas)) | set(_joiners(store, 0, joins)), joins
    before = read_epoch(store, number - 1)
    if before is None:
        raise FTError(f"epoch {number - 1} has no published members in the store (was it cleared?)")
    return {m.replica for m in before.members} | set(_joiners(store, before.joins_upto, joins)), joins


@dataclasses.dataclass
class Rules:
    """How an epoch is formed: the job's starting replicas, the fewest an epoch may have, who is
    dead, how long to wait for the living, and where to say what is awaited."""

    num_replicas: int
    min_replicas: int
    liveness: Liveness
    timeout_s: float
    on_wait: Optional[Callable[[str], None]] = None


def agree(store: dist.Store, number: int, me: Registration, rules: Rules) -> Epoch:
    """Registers ``me`` for epoch ``number`` and returns its published membership (which may leave
    ``me`` out, when it registered after the decision). Decides it when no one has claimed that
    yet, or when the decider died before publishing. Raises FTError when fewer than
    ``min_replicas`` registered within the timeout."""
    prefix = f"e{number}/"
    store.set(f"{prefix}alive/{me.replica}", me.text())
    deadline = time.monotonic() + rules.timeout_s
    decider_key = f"{prefix}decider"
    claimed = store.compare_set(decider_key, "", str(me.replica)).decode()
    while True:
        if claimed == str(me.replica):
            return _decide(store, number, rules, deadline)
        published = read_epoch(store, number)
        if published is not None:
            return published
        if rules.liveness.dead(int(claimed)):  # the decider died before publishing: take over
            claimed = store.compare_set(decider_key, claimed, str(me.replica)).decode()
            continue
        if time.monotonic() >= deadline:
            raise CommTimeout(
                f"replica {me.replica}: epoch {number}'s members were not published within "
                f"{rules.timeout_s:g} s by replica {claimed}, which still runs"
            )
        time.sleep(POLL_S)


def _decide(store: dist.Store, number: int, rules: Rules, deadline: float) -> Epoch:
    prefix = f"e{number}/"
    expected, joins = _expected(store, number, rules.num_replicas)
    last_note = time.monotonic()
    while True:
        arrived: Dict[int, Registration] = {}
        for r in sorted(expected):
            text = _get(store, f"{prefix}alive/{r}")
            if text is not None:
                arrived[r] = Registration.parse(text)
        missing = [r for r in sorted(expected) if r not in arrived and not rules.liveness.dead(r)]
        enough = len(arrived) >= rules.min_replicas
        now = time.monotonic()
        if (not missing and enough) or (now >= deadline and enough):
            break
        if now >= deadline:
            raise FTError(
                f"epoch {number}: {len(arrived)} replica(s) registered ({sorted(arrived)}), fewer "
                f"than min_replicas={rules.min_replicas}, before the quorum timeout"
            )
        if rules.on_wait is not None and now - last_note >= 5.0:
            last_note = now
            rules.on_wait(
                f"epoch {number}: waiting for replica(s) {missing or '(any)'}; registered {sorted(arrived)}"
            )
        time.sleep(POLL_S)
    # The job's state lives in the members that continue from the epoch before. When none came
    # and the job had committed steps past every registered one, it is gone: starting over from a
    # joiner's older state would be silent. (Before any commit, any member's state will do.)
    committed = int(_get(store, "committed") or 0)
    holders = any(m.continuing for m in arrived.values()) or committed <= max(
        m.step for m in arrived.values()
    )
    epoch = Epoch(number, [arrived[r] for r in sorted(arrived)], joins if holders else -1)
    held = store.compare_set(f"{prefix}members", "", epoch.text()).decode()
    store.set("epoch", str(number))
    return Epoch.parse(number, held)
