"""One replica of braid.ft's tests and benchmark, run as its own process, as torchrun would
start it::

    python -m braid.bench.ft_replica --replica R --replicas N --store PATH --out DIR

A small MLP trained with braid.ft on batches fixed by (step, replica), writing one JSON line per
committed step (the step, the members, a digest of the parameters) and the final parameters. It
trains ``--steps`` steps, then on until a step has every replica (and while ``--hold-file``
exists). ``--die STEP:PHASE`` makes the process SIGKILL itself at the first step from STEP on
that every replica takes part in; ``--die-file`` names a file whose appearance orders the same
at once. Phases: "backward" (inside the gradient all-reduces), "step" (after the backward,
before the vote), "join" (while loading the state a healthy replica sent it).

``--ranks-per-replica R`` (R > 1): a replica is R processes (``--local-rank``, or torchrun's
``LOCAL_RANK`` under a torchrun job of R workers, whose default group is then the replica's)
that shard the model with braid's ZeRO wrapper (``--stage``) over a braid Communicator on
``--replica-store`` (or over the torchrun job's gloo group, or a braid Communicator from the
environment of the srun step that runs the replica); each rank trains on its own batches,
the wrapper averages them inside the replica, and ``Manager.average_gradients`` averages the
shards over the replicas. The phase "backward" then dies just before that exchange (the peers
wait in it). Records and digests are per rank; the final parameters are rank 0's full state."""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from braid import ft
from braid.comm.core.group import as_group

IN, HIDDEN, OUT, BATCH = 8, 32, 4, 16


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step: int, replica: int, rank: int = 0):
    g = torch.Generator().manual_seed(100_003 * step + replica + 7_919 * rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():  # a sharded replica's: this rank's flat shards, or local shards
        p = p.to_local() if hasattr(p, "to_local") else p
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


LOG = None  # this process's JSON-lines log, once open


def die() -> None:
    if LOG is not None:
        LOG.write(json.dumps({"dying": time.time()}) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--die", default="")
    ap.add_argument("--die-file", default="", help="when this file appears, die in the phase it names")
    ap.add_argument("--hold-file", default="", help="while this file exists (on any replica), go on training")
    ap.add_argument("--secret", default="job-a")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--compression", default=None)
    ap.add_argument("--ranks-per-replica", type=int, default=1)
    ap.add_argument("--local-rank", type=int, default=None)
    ap.add_argument("--replica-store", default="", help="FileStore of the replica's own group")
    ap.add_argument("--stage", type=int, default=3, help="ZeRO stage inside a replica of several ranks")
    ap.add_argument("--inner", choices=("zero", "fsdp2"), default="zero",
                    help="what shards the model inside a replica of several ranks")
    ap.add_argument("--device", default="cpu", help="where the model trains (cuda: every replica on the GPU)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    die_step, die_phase = (int(args.die.split(":")[0]), args.die.split(":")[1]) if args.die else (-1, "")

    sharded = args.ranks_per_replica > 1
    local, group = 0, None
    if sharded:
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # a torchrun job per replica: its group is ours
            dist.init_process_group("gloo")
            local, group = dist.get_rank(), dist.group.WORLD
            assert dist.get_world_size() == args.ranks_per_replica, dist.get_world_size()
        elif args.inner == "fsdp2":  # FSDP2 needs the default process group: gloo over the replica
            local = args.local_rank
            dist.init_process_group("gloo", store=dist.FileStore(args.replica_store, -1), rank=local,
                                    world_size=args.ranks_per_replica)
            group = dist.group.WORLD
        elif os.environ.get("SLURM_STEP_ID") and args.local_rank is None:  # an srun step per replica
            from braid import comm

            group = comm.init(timeout=20.0)  # SLURM_PROCID, SLURM_NTASKS, the step's own store
            local = group.rank
            assert group.world_size == args.ranks_per_replica, group.world_size
        else:
            from braid.comm import Communicator

            local = args.local_rank
            group = Communicator(dist.FileStore(args.replica_store, -1), local, args.ranks_per_replica,
                                 timeout=20.0)
    model = make_model(args.replica).to(args.device)  # replicas start apart: the first epoch unites them
    fsdp2 = sharded and args.inner == "fsdp2"
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(torch.device(args.device).type, (args.ranks_per_replica,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif sharded:
        from braid.comm import zero

        model = zero.shard(model, group, stage=args.stage)
    opt = make_optimizer(model)

    def state():  # an FSDP2 module's DTensors travel as their local shards
        weights = model.sharded_state_dict() if sharded and not fsdp2 else model.state_dict()
        return {"model": weights, "opt": opt.state_dict()}

    def load(state):
        if die_phase == "join":
            die()
        if fsdp2:
            ft.load_local_shards(model, opt, state["model"], state["opt"])
            return
        (model.load_sharded_state_dict if sharded else model.load_state_dict)(state["model"])
        opt.load_state_dict(state["opt"])

    store = dist.FileStore(args.store, -1)
    manager = ft.Manager(
        state,
        load,
        replica_id=args.replica,
        num_replicas=args.replicas,
        store=store,
        secret=args.secret,
        timeout=20.0,
        quorum_timeout=60.0,
        dead_after_s=1.0,
        replica_group=group,
    )
    ddp = model if sharded else ft.DistributedDataParallel(manager, model, compression=args.compression)
    optimizer = ft.Optimizer(manager, opt)
    def due() -> bool:  # the first step from die_step on that every replica takes part in
        return manager.current_step() >= die_step and manager.num_participants() == args.replicas

    def ordered(phase: str) -> bool:  # a supervisor's order, read at each step's start
        return bool(args.die_file) and ordered_phase == phase

    ordered_phase = ""

    if die_phase == "backward" and not sharded:
        model[0].weight.register_hook(lambda g: die() if due() else None)
    if args.die_file and not sharded:
        model[0].weight.register_hook(lambda g: die() if ordered("backward") else None)
    global LOG
    name = f"replica{args.replica}" + (f".rank{local}" if local else "")
    log = LOG = open(os.path.join(args.out, f"{name}.jsonl"), "a", buffering=1)
    log.write(json.dumps({"start": time.time(), "pid": os.getpid()}) + "\n")
    # Past --steps training goes on until a step is committed by every replica of the job, so that
    # a replica restarted late still rejoins; every member sees that step, so all stop at it.
    last_members, holding = [], bool(args.hold_file)
    while manager.current_step() < args.steps or len(last_members) < args.replicas or holding:
        optimizer.zero_grad()
        # In a replica of several ranks its last rank takes the orders (one rank dies; its peers
        # go with it, stopped by the launcher).
        if args.die_file and local == args.ranks_per_replica - 1 and os.path.exists(args.die_file):
            with open(args.die_file) as f:
                ordered_phase = f.read().strip()
            os.unlink(args.die_file)  # an order is carried out once
        step = manager.current_step()
        x, y = (t.to(args.device) for t in batch(step, args.replica, local))
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if sharded:  # the wrapper averaged the replica's gradients; now across the replicas
            if (die_phase == "backward" and due()) or ordered("backward"):
                die()
            manager.average_gradients(model.parameters())
        if (die_phase == "step" and due()) or ordered("step"):
            die()
        members = manager.participants()
        hold = None
        if args.hold_file:  # agreed among the members: the step commits only if this arrived
            hold = manager.all_reduce(torch.tensor([float(os.path.exists(args.hold_file))]), op="max")
            if sharded:  # and the same on every rank of the replica (its lanes read the file apart)
                as_group(group).all_reduce(hold, op="max")
        if optimizer.step():
            last_members = members
            holding = hold is not None and hold.item() > 0
            log.write(
                json.dumps(
                    {
                        "step": manager.current_step(),
                        "members": members,
                        "rank": local,
                        "digest": digest(model),
                        "epoch": manager.epoch,
                        "time": time.time(),
                    }
                )
                + "\n"
            )
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if fsdp2:  # every rank gathers each parameter whole
        final = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in model.state_dict().items()}
    else:
        final = model.full_state_dict() if sharded else model.state_dict()
    if local == 0:
        path = os.path.join(args.out, f"final{args.replica}.pt")
        torch.save({k: v.detach().cpu().clone() for k, v in final.items()}, path)
    log.write(json.dumps({"events": manager.events}) + "\n")
    manager.shutdown()


if __name__ == "__main__":
    main()
