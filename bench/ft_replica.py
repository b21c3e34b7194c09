"""One replica of braid.ft's tests and benchmark, run as its own process, as torchrun would
start it::

    python -m braid.bench.ft_replica --replica R --replicas N --store PATH --out DIR

A small MLP trained with braid.ft on batches fixed by (step, replica), writing one JSON line per
committed step (the step, the members, a digest of the parameters) and the final parameters. It
trains ``--steps`` steps, then on until a step has every replica (and while ``--hold-file``
exists). ``--die STEP:PHASE`` makes the process SIGKILL itself at the first step from STEP on
that every replica takes part in; ``--die-file`` names a file whose appearance orders the same
at once. Phases: "backward" (inside the gradient all-reduces), "step" (after the backward,
before the vote), "join" (while loading the state a healthy replica sent it)."""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from braid import ft

IN, HIDDEN, OUT, BATCH = 8, 32, 4, 16


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step: int, replica: int):
    g = torch.Generator().manual_seed(100_003 * step + replica)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
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
    args = ap.parse_args()
    torch.set_num_threads(1)
    die_step, die_phase = (int(args.die.split(":")[0]), args.die.split(":")[1]) if args.die else (-1, "")

    model = make_model(args.replica)  # replicas start apart: the first epoch gives them one state
    opt = make_optimizer(model)

    def load(state):
        if die_phase == "join":
            die()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])

    store = dist.FileStore(args.store, -1)
    manager = ft.Manager(
        lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        load,
        replica_id=args.replica,
        num_replicas=args.replicas,
        store=store,
        secret=args.secret,
        timeout=20.0,
        quorum_timeout=60.0,
        dead_after_s=1.0,
    )
    ddp = ft.DistributedDataParallel(manager, model, compression=args.compression)
    optimizer = ft.Optimizer(manager, opt)
    def due() -> bool:  # the first step from die_step on that every replica takes part in
        return manager.current_step() >= die_step and manager.num_participants() == args.replicas

    def ordered(phase: str) -> bool:  # a supervisor's order, read at each step's start
        return bool(args.die_file) and ordered_phase == phase

    ordered_phase = ""

    if die_phase == "backward":
        model[0].weight.register_hook(lambda g: die() if due() else None)
    if args.die_file:
        model[0].weight.register_hook(lambda g: die() if ordered("backward") else None)
    global LOG
    log = LOG = open(os.path.join(args.out, f"replica{args.replica}.jsonl"), "a", buffering=1)
    log.write(json.dumps({"start": time.time(), "pid": os.getpid()}) + "\n")
    # Past --steps training goes on until a step is committed by every replica of the job, so that
    # a replica restarted late still rejoins; every member sees that step, so all stop at it.
    last_members, holding = [], bool(args.hold_file)
    while manager.current_step() < args.steps or len(last_members) < args.replicas or holding:
        optimizer.zero_grad()
        if args.die_file and os.path.exists(args.die_file):
            with open(args.die_file) as f:
                ordered_phase = f.read().strip()
            os.unlink(args.die_file)  # an order is carried out once
        step = manager.current_step()
        x, y = batch(step, args.replica)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if (die_phase == "step" and due()) or ordered("step"):
            die()
        members = manager.participants()
        hold = None
        if args.hold_file:  # agreed among the members: the step commits only if this arrived
            hold = manager.all_reduce(torch.tensor([float(os.path.exists(args.hold_file))]), op="max")
        if optimizer.step():
            last_members = members
            holding = hold is not None and hold.item() > 0
            log.write(
                json.dumps(
                    {
                        "step": manager.current_step(),
                        "members": members,
                        "digest": digest(model),
                        "epoch": manager.epoch,
                        "time": time.time(),
                    }
                )
                + "\n"
            )
        if args.step_sleep:
            time.sleep(args.step_sleep)
    torch.save(
        {k: v.clone() for k, v in model.state_dict().items()},
        os.path.join(args.out, f"final{args.replica}.pt"),
    )
    log.write(json.dumps({"events": manager.events}) + "\n")
    manager.shutdown()


if __name__ == "__main__":
    main()
