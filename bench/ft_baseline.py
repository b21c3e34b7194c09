"""The peer of ``python -m braid.bench ft``: what torch users get today when a worker dies. The
same model, data and optimizer as braid.bench.ft_replica, under torchrun with ``--max-restarts``:
DDP over gloo, a checkpoint every ``--checkpoint-every`` steps (rank 0 writes it atomically); when
a worker dies torchrun stops and restarts every worker, and all of them resume from the last
checkpoint. Rank ``--victim`` SIGKILLs itself in its backward at ``--die-at`` in the first run.
Writes one JSON line per committed step to ``--out``/rank<r>.jsonl."""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from braid.bench import ft_replica


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--die-at", type=int, default=20)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, restarts = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(os.path.join(args.out, f"rank{rank}.jsonl"), "a", buffering=1)
    # The agent's store outlives a restart and keeps the last attempt's keys, which the new
    # workers' gloo would read (and connect to dead addresses): each attempt under its own prefix.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt{restarts}/", store), rank=rank, world_size=world
    )
    model = ft_replica.make_model(0)
    opt = ft_replica.make_optimizer(model)
    ckpt = os.path.join(args.out, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    ddp = DistributedDataParallel(model)
    log.write(json.dumps({"resumed": step, "restarts": restarts, "time": time.time()}) + "\n")

    def maybe_die(grad):
        if restarts == 0 and rank == args.victim and step == args.die_at:
            log.write(json.dumps({"dying": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[0].weight.register_hook(maybe_die)
    while step < args.steps:
        opt.zero_grad()
        x, y = ft_replica.batch(step, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        step += 1
        log.write(json.dumps({"step": step, "time": time.time()}) + "\n")
        if step % args.checkpoint_every == 0 and rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        if step % args.checkpoint_every == 0:
            dist.barrier()  # the checkpoint is on disk before anyone goes past it
        if args.step_sleep:
            time.sleep(args.step_sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
