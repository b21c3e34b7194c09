"""The Manager: per-step quorum, commit and live recovery of a data-parallel job over replicas.

Each replica trains a full copy of the model: one process, or several (a *replica group*: the
ranks of one host sharding the model with braid's ZeRO wrapper or FSDP2, or splitting it with
TP), which live and die together (torchrun's agent restarts a host's workers as one). Rank ``i``
of every replica meets rank ``i`` of the others in *lane* ``i``: a braid communicator over the
epoch's members that averages that rank's gradients (or gradient shards) and carries its part of
a live recovery. Membership is decided per replica, once, by each replica's rank 0, and handed to
its other ranks through the replica group, so every lane has the same members.

A step runs in the epoch in force at its start; its gradients are averaged over that epoch's
members by braid (``ft.ddp``, or ``Manager.average_gradients`` for a sharded replica). At the
optimizer step the members vote (one small all-reduce per lane, then one over the replica group:
did everyone's gradients arrive, does anyone wait to join) and the vote is settled in the store
(compare-and-set of the step's key), so every member commits or discards the step alike even when
a member died half-way through the vote. A discarded step, or a pending join, makes the next
``start_step`` form a new epoch: the survivors and joiners register, the dead are found by their
stopped heartbeats, and new lane communicators are built over the members. A member that is
behind (a restarted or new replica) receives the state of the most advanced member, streamed
over braid lane by lane, before the first step of the new epoch.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from braid.comm import Communicator
from braid.comm.core.errors import CommError
from braid.comm.core.group import as_group

from . import quorum
from .quorum import Epoch, FTError, Registration
from .transfer import recv_state, send_state

log = logging.getLogger("braid.ft")

DEFAULT_PREFIX = "braid-ft/"


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _store_from_env(timeout_s: float) -> dist.Store:
    address = os.environ.get("BRAID_FT_STORE")
    if not address:
        raise ValueError(
            "no store: pass store= (a torch Store that outlives every replica) or set "
            "BRAID_FT_STORE=host:port of a TCPStore (python -m braid.ft store --port PORT serves one)"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"BRAID_FT_STORE must be host:port, got {address!r}")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


class Manager:
    """Coordinates fault-tolerant data parallelism over replicas (see the module docstring).

    Args:
        state_dict: returns everything a joining replica needs (model, optimizer, data position)
            as nested dicts / lists of tensors and plain values; in a replica of several ranks,
            this rank's part (its shards), which rank ``i`` of a healthy replica sends to rank
            ``i`` of the joining one.
        load_state_dict: loads what ``state_dict`` returned on a healthy replica (tensors arrive
            on the CPU).
        min_replicas: the fewest replicas an epoch may have; fewer, and the quorum waits for
            joins until ``quorum_timeout`` and then raises FTError.
        replica_id: this replica's id in [0, num_replicas) (default ``BRAID_FT_REPLICA``). A
            restarted process keeps its replica's id.
        num_replicas: the replicas the job starts with (default ``BRAID_FT_REPLICAS``); the first
            epoch waits for all of them (or until ``quorum_timeout``). Replicas with ids past it
            may join later.
        store: a torch Store every replica reaches and that outlives them (a TCPStore served apart
            from the replicas, a FileStore on a shared file system); default ``BRAID_FT_STORE``.
        prefix: the job's keys in the store.
        secret: a process whose secret differs from the job's (the first process's) is refused
            (default ``BRAID_FT_SECRET``, else none).
        timeout: deadline of every collective wait (seconds).
        quorum_timeout: how long forming an epoch may wait for replicas that still run.
        dead_after_s: a replica whose heartbeat (every ``heartbeat_s``) has not moved for this
            long is taken as dead and not waited for.
        replica_group: the ranks of this replica, when it has several: a braid Communicator or a
            torch ProcessGroup over them (e.g. the default group of the replica's torchrun job);
            every replica of the job has the same number of ranks. None: a replica is this one
            process. A failure of this group (one of the replica's ranks died) raises FTError:
            the replica must restart as a whole, as torchrun does.
    """

    def __init__(
        self,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        *,
        min_replicas: int = 1,
        replica_id: Optional[int] = None,
        num_replicas: Optional[int] = None,
        store: Optional[dist.Store] = None,
        prefix: str = DEFAULT_PREFIX,
        secret: Optional[str] = None,
        timeout: float = 60.0,
        quorum_timeout: float = 120.0,
        heartbeat_s: float = 0.1,
        dead_after_s: float = 2.0,
        replica_group: Any = None,
    ):
        if not callable(state_dict) or not callable(load_state_dict):
            raise TypeError(
                "state_dict and load_state_dict must be callables (the replica's state out and in)"
            )
        replica_id = _env_int("BRAID_FT_REPLICA") if replica_id is None else replica_id
        num_replicas = _env_int("BRAID_FT_REPLICAS") if num_replicas is None else num_replicas
        if not isinstance(replica_id, int) or isinstance(replica_id, bool) or replica_id < 0:
            raise ValueError(f"replica_id must be an int >= 0 (or BRAID_FT_REPLICA set), got {replica_id!r}")
        if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
            raise ValueError(
                f"num_replicas must be an int >= 1 (or BRAID_FT_REPLICAS set), got {num_replicas!r}"
            )
        if not isinstance(min_replicas, int) or isinstance(min_replicas, bool) or not 1 <= min_replicas:
            raise ValueError(f"min_replicas must be an int >= 1, got {min_replicas!r}")
        for name, value in (
            ("timeout", timeout),
            ("quorum_timeout", quorum_timeout),
            ("heartbeat_s", heartbeat_s),
            ("dead_after_s", dead_after_s),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if dead_after_s <= 3 * heartbeat_s:
            raise ValueError(
                f"dead_after_s ({dead_after_s}) must exceed three heartbeats ({heartbeat_s} s each)"
            )
        self._replica_group = None if replica_group is None else as_group(
            replica_group, "replica_group", "braid.ft.Manager")
        self.local_rank = 0 if self._replica_group is None else self._replica_group.rank
        self.ranks_per_replica = 1 if self._replica_group is None else self._replica_group.world_size
        # Where the replica group's small tensors live: the host, unless the group serves only a
        # device (an NCCL group of the host's GPUs): then the current CUDA device.
        self._replica_device = torch.device("cpu")
        problem = getattr(self._replica_group, "device_problem", None)  # a stand-in may have none
        if problem is not None and problem(self._replica_device):
            self._replica_device = torch.device("cuda", torch.cuda.current_device())
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self.replica_id, self.num_replicas, self.min_replicas = replica_id, num_replicas, min_replicas
        self._timeout_s, self._quorum_timeout_s = float(timeout), float(quorum_timeout)
        base = _store_from_env(timeout) if store is None else store
        self._store = dist.PrefixStore(prefix, base)
        secret = os.environ.get("BRAID_FT_SECRET", "") if secret is None else secret
        quorum.check_secret(self._store, secret)
        quorum.check_ranks_per_replica(self._store, self.ranks_per_replica)
        # One incarnation per start of the replica (all its ranks): rank 0's, handed to the others.
        self._incarnation = self._in_replica("broadcast", self._broadcast_text, secrets.token_hex(6))
        # Its own connection: a blocking store call of the main thread must not stop the heartbeat.
        self._heartbeat = quorum.Heartbeat(
            self._store.clone(), replica_id, float(heartbeat_s), self.local_rank)
        liveness = quorum.Liveness(self._store, float(dead_after_s), self.ranks_per_replica)
        self._rules = quorum.Rules(num_replicas, min_replicas, liveness, self._quorum_timeout_s, log.warning)
        self._epoch: Optional[Epoch] = None
        self._comm: Optional[Communicator] = None
        self._step = 0
        self._error: Optional[BaseException] = None
        self._needs_quorum = True
        self._synced = False  # holds the job's agreed state (a member since, a source, or received it)
        self.hook_state = None  # braid's DDP hook state (ft.DistributedDataParallel): follows the epochs
        self._on_new_members: List[Callable[[], None]] = []  # run when an epoch takes in a replica
        self.events: List[dict] = []  # reconfigurations, failures and recoveries, in order
        atexit.register(self.shutdown)  # the heartbeat thread stops before the interpreter does

    # -- what the training loop reads ------------------------------------------------------
    def current_step(self) -> int:
        """Steps committed so far (the same on every member; a joiner takes its source's)."""
        return self._step

    def num_participants(self) -> int:
        """Replicas in the current epoch (0 before the first ``start_step``)."""
        return 0 if self._epoch is None else len(self._epoch.members)

    def participants(self) -> List[int]:
        """The replica ids of the current epoch's members, in rank order."""
        return [] if self._epoch is None else [m.replica for m in self._epoch.members]

    def participant_rank(self) -> int:
        """This replica's index among the current epoch's members (for sharding data by member)."""
        if self._epoch is None:
            raise RuntimeError("no epoch yet: call start_step() (optimizer.zero_grad()) first")
        return self._epoch.rank_of(self.replica_id)

    @property
    def epoch(self) -> Optional[int]:
        return None if self._epoch is None else self._epoch.number

    @property
    def communicator(self) -> Optional[Communicator]:
        """The communicator over the current epoch's members (replaced at every reconfiguration)."""
        return self._comm

    @property
    def errored(self) -> Optional[BaseException]:
        """The failure seen in the current step (its gradients are not to be trusted), or None."""
        return self._error

    # -- the step --------------------------------------------------------------------------
    def start_step(self) -> None:
        """Begins a step: forms a new epoch first when the last step failed or a replica waits to
        join (receiving state when this replica is behind)."""
        if self._heartbeat.error is not None:
            raise FTError(
                f"replica {self.replica_id}: the store stopped answering the heartbeat: "
                f"{self._heartbeat.error}"
            )
        if self._needs_quorum:
            self._form_epoch()
        self._error = None

    def note_error(self, error: BaseException) -> None:
        """Marks this step failed (its gradient exchange raised); the step will be discarded."""
        if self._error is None:
            self._error = error
            self._event("failure", error=f"{type(error).__name__}: {error}")

    def all_reduce(self, tensor: torch.Tensor, op: str = "avg") -> torch.Tensor:
        """``tensor`` reduced in place over the epoch's members; on a failure the step is marked
        failed and ``tensor`` is left as it is (the step will be discarded)."""
        if self._error is None:
            try:
                self._require_comm().all_reduce(tensor, op=op)
            except CommError as e:
                self.note_error(e)
        return tensor

    def should_commit(self) -> bool:
        """Ends the step: True when every member's gradients arrived (commit: apply the optimizer
        step), False when the step is discarded. Every member gets the same answer (in a replica
        of several ranks: every rank of every member)."""
        comm = self._require_comm()
        epoch = self._epoch
        joins_pending = self._heartbeat.joins > epoch.joins_upto
        vote = torch.tensor([0.0 if self._error is not None else 1.0, 0.0 if joins_pending else 1.0])
        try:
            comm.all_reduce(vote, op="min")
        except CommError as e:
            self.note_error(e)
            vote[0] = 0.0
        if self._replica_group is not None:  # the lanes' votes together: one vote per replica
            vote = self._replica_min(vote)
        healthy = vote[0].item() == 1.0
        key = f"e{epoch.number}/s{self._step}"
        decision = self._store.compare_set(key, "", "commit" if healthy else "discard").decode()
        if comm.rank == 0 and self.local_rank == 0 and self._step >= 2:
            self._heartbeat.delete_later(f"e{epoch.number}/s{self._step - 2}")  # read by all by now
        if decision == "commit":
            self._step += 1
            self._heartbeat.committed = self._step
        else:
            self._event("discard")
        if decision != "commit" or not healthy or vote[1].item() != 1.0:
            self._needs_quorum = True
        return decision == "commit"

    def average_gradients(self, parameters: Any) -> None:
        """Averages the gradients of ``parameters`` over the epoch's members (this rank's lane), in
        place: what ``ft.DistributedDataParallel``'s hook does for a replicated module, for a
        replica that shards or splits its model (braid's ZeRO wrapper's ``parameters()``, FSDP2's
        DTensor parameters, TP layers), called after the backward and before ``optimizer.step()``.
        Gradients of one dtype travel as one flat buffer (summed in member order, then divided by
        the number of members). A failure marks the step failed (it will be discarded)."""
        grads = []
        for p in parameters:
            g = p.grad
            if g is None:
                continue
            grads.append(g._local_tensor if hasattr(g, "_local_tensor") else g)
        if self._error is not None or not grads:
            return
        comm = self._require_comm()
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault((g.dtype, g.device), []).append(g)
        try:
            for group in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in group])
                comm.all_reduce(flat, op="sum")
                flat.div_(len(self._epoch.members))
                offset = 0
                for g in group:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
        except CommError as e:
            self.note_error(e)

    def attach_ddp(self, hook_state: Any, on_new_members: Callable[[], None]) -> None:
        """Used by ``ft.DistributedDataParallel``: the hook state whose carrier is set to each
        epoch's communicator, and a call made when an epoch takes in a replica (before its first
        step)."""
        hook_state.group = self._comm
        self.hook_state = hook_state
        self._on_new_members.append(on_new_members)

    def shutdown(self) -> None:
        """Stops the heartbeat and closes the communicator (the others then see this replica leave).
        Idempotent; runs at interpreter exit too."""
        atexit.unregister(self.shutdown)
        self._heartbeat.stop()
        if self._comm is not None:
            comm, self._comm = self._comm, None
            comm.close()

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- epochs ----------------------------------------------------------------------------
    def _require_comm(self) -> Communicator:
        if self._comm is None:
            raise RuntimeError("no epoch yet: call start_step() (optimizer.zero_grad()) first")
        return self._comm

    def _event(self, kind: str, **detail: Any) -> None:
        entry = dict(
            kind=kind, replica=self.replica_id, step=self._step, epoch=self.epoch, time=time.time(), **detail
        )
        if self.ranks_per_replica > 1:
            entry["rank"] = self.local_rank
        self.events.append(entry)
        log.info("braid.ft %s", entry)
        trace_dir = os.environ.get("BRAID_TRACE_DIR")
        rank = f".rank{self.local_rank}" if self.local_rank else ""
        if trace_dir:  # beside the flight recorder's dumps, which name the failure itself
            try:
                name = f"braid-ft-replica{self.replica_id}{rank}.jsonl"
                with open(os.path.join(trace_dir, name), "a") as f:
                    f.write(json.dumps(entry, default=str) + "\n")
            except OSError as e:
                log.warning("braid.ft: could not write its events to BRAID_TRACE_DIR: %s", e)

    def _next_number(self, joining: bool) -> int:
        """The epoch to register for: the one after ours; a process without one (new, restarted,
        left out) files a join request and takes the one after the latest (0 at a cold start)."""
        if not joining and self._epoch is not None:
            return self._epoch.number + 1
        latest = quorum.latest_epoch(self._store)
        if latest is None:
            return 0
        quorum.request_join(self._store, self.replica_id, self._incarnation)
        return latest + 1

    def _in_replica(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(*args, **kwargs)`` (a collective over the replica group); its failure means
        one of this replica's ranks died, and the replica must restart as a whole."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise FTError(
                f"replica {self.replica_id} rank {self.local_rank}: the replica group's {what} failed "
                f"({type(e).__name__}: {e}); a rank of this replica died, so the replica must restart "
                "as a whole (torchrun --max-restarts restarts a host's workers together)"
            ) from e

    def _replica_min(self, values: torch.Tensor) -> torch.Tensor:
        """The minimum of ``values`` (a small host tensor) over the replica's ranks, on the host."""
        moved = values.to(self._replica_device)
        self._in_replica("all_reduce", self._replica_group.all_reduce, moved, op="min")
        return moved.cpu()

    def _broadcast_text(self, text: str) -> str:
        """``text`` of the replica's rank 0, on every rank of the replica (as it is without one)."""
        group = self._replica_group
        if group is None:
            return text
        device = self._replica_device
        raw = None
        if self.local_rank == 0:
            raw = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
        size = torch.tensor([0 if raw is None else raw.numel()], dtype=torch.int64, device=device)
        group.broadcast(size, 0)
        if raw is None:
            raw = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
        if raw.numel():
            group.broadcast(raw, 0)
        return bytes(raw.tolist()).decode()

    def _agree_as_leader(self, joining: bool) -> tuple:
        """Rank 0 of the replica: registers for the next epoch and returns ``(outcome, text)``:
        ("epoch", the published epoch as "<number>;<Epoch.text>"), ("left-out", "") when the epoch
        was decided without this replica, or ("lost", the message) when no member holds the
        job's state."""
        number = self._next_number(joining)
        continuing = self._synced and self._epoch is not None and self._epoch.number == number - 1
        me = Registration(self.replica_id, self._incarnation, self._step, continuing)
        epoch = quorum.agree(self._store, number, me, self._rules)
        if epoch.lost:
            return "lost", (
                f"replica {self.replica_id}: no replica holding the job's state is alive (epoch "
                f"{number} found only {epoch.participants_text()}): restart the job from a checkpoint"
            )
        rank = epoch.rank_of(self.replica_id)
        if rank is None or epoch.members[rank].incarnation != self._incarnation:
            self._event("left-out", wanted=number)
            return "left-out", ""
        return "epoch", f"{number};{epoch.text()}"

    def _form_epoch(self) -> None:
        began = time.monotonic()
        if self._comm is not None:
            self._comm.abort()  # peers still inside a collective with this replica fail at once
            self._comm = None
        joining = self._epoch is None
        while True:
            told = "|".join(self._agree_as_leader(joining)) if self.local_rank == 0 else ""
            told = self._in_replica("broadcast", self._broadcast_text, told)
            outcome, _, text = told.partition("|")
            if outcome == "lost":
                raise FTError(text)
            if outcome == "left-out":
                joining = True
                continue
            number_text, _, members_text = text.partition(";")
            epoch = Epoch.parse(int(number_text), members_text)
            self._epoch = epoch
            comm, failed = None, None
            lane = "comm" if self.local_rank == 0 else f"lane{self.local_rank}"
            try:
                comm = Communicator(
                    self._store,
                    epoch.rank_of(self.replica_id),
                    len(epoch.members),
                    timeout=self._timeout_s,
                    prefix=f"e{epoch.number}/{lane}/",
                )
                received = self._recover(epoch, comm)
            except CommError as e:  # a member died meanwhile: the next epoch goes on without it
                failed = e
            if self._replica_group is not None:  # every lane of the replica made it, or none goes on
                ok = self._replica_min(torch.tensor([0.0 if failed is not None else 1.0]))
                if failed is None and ok.item() != 1.0:
                    failed = CommError("another lane of this replica failed to form the epoch")
            if failed is not None:
                self._event("recovery-failed", error=f"{type(failed).__name__}: {failed}")
                if comm is not None:
                    comm.abort()
                joining = False
                continue
            self._comm = comm
            break
        if self.hook_state is not None:
            self.hook_state.group = comm
        if epoch.receivers():
            for fn in self._on_new_members:
                fn()
        self._needs_quorum = False
        self._event(
            "epoch",
            members=[m.replica for m in epoch.members],
            source=epoch.source.replica,
            received=received,
            seconds=round(time.monotonic() - began, 4),
        )

    def _recover(self, epoch: Epoch, comm: Communicator) -> bool:
        """Streams the source's state to the members that are behind; True on a receiver."""
        source, receivers = epoch.source, epoch.receivers()
        if source.replica == self.replica_id:
            state = self._state_dict()
            for m in receivers:
                send_state(comm, epoch.rank_of(m.replica), state, self._step)
            self._synced = True
            return False
        if any(m.replica == self.replica_id for m in receivers):
            self._synced = False
            state, step = recv_state(comm, epoch.rank_of(source.replica))
            self._load_state_dict(state)
            self._step = step
            self._heartbeat.committed = step
            self._synced = True
            return True
        return False
