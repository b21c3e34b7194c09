"""braid's ZeRO wrapper with the optimizer stepped bucket by bucket in the backward
(``ShardedModule.step_in_backward``): the shards end as ``optimizer.step()`` after the backward
leaves them, bit for bit, at every ZeRO stage, over a braid communicator and a gloo group, with
no_sync accumulation."""
import torch
import torch.distributed as dist
from braid import optim
from braid.comm import zero
from helpers import outcome
from helpers.sharding import small_lm, small_lm_loss
from helpers.ranks import make_comm, process_group, run_ranks
from torch import nn

# Small buckets: the model's parameters spread over several, some straddling shards.
BUCKET_CAP_MB = 2048 / 2**20


def _run(group, rank: int, stage: int, name: str, in_backward: bool, steps: int = 5, micro: int = 2) -> dict:
    sharded = zero.shard(small_lm(), group, stage=stage, bucket_cap_mb=BUCKET_CAP_MB)
    make = {"adamw": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9)}[name]
    opt = make(sharded.parameters())
    if in_backward:
        sharded.step_in_backward(opt)
    for step in range(steps):
        sharded.zero_grad()
        for m in range(micro):
            if m < micro - 1:
                with sharded.no_sync():
                    (small_lm_loss(sharded, rank, step, m) / micro).backward()
            else:
                (small_lm_loss(sharded, rank, step, m) / micro).backward()
        if not in_backward:
            opt.step()
    params = sharded.full_state_dict()
    seen = {}
    if in_backward:
        seen = {"step": outcome(opt.step), "clip": outcome(sharded.clip_grad_norm_, 1.0)}
        sharded.step_in_backward(None)
        seen["detached"] = outcome(opt.step)  # steps again: after the parameters were taken
    return {"params": params, "seen": seen}


def stepped_in_backward(rank, n, store_path):
    out = {}
    with process_group(rank, n, store_path):
        with make_comm(rank, n, store_path) as c:
            for carrier, group in (("communicator", c), ("gloo", dist.group.WORLD)):
                for stage in (1, 2, 3):
                    for name in ("adamw", "sgd"):
                        after = _run(group, rank, stage, name, False)
                        during = _run(group, rank, stage, name, True)
                        same = all(torch.equal(during["params"][k], v) for k, v in after["params"].items())
                        moved = max((during["params"][k] - v).abs().max().item()
                                    for k, v in small_lm().state_dict().items())
                        out[(carrier, stage, name)] = {"same": same, "moved": moved, "seen": during["seen"]}
    return out


def test_step_in_backward_equals_step_after_backward():
    for rank, out in enumerate(run_ranks(stepped_in_backward, 2)):
        assert len(out) == 12
        for key, r in out.items():
            assert r["same"], (rank, key)
            assert r["moved"] > 1e-3, (rank, key, "the parameters did not move")
            assert r["seen"]["step"]["type"] == "RuntimeError", (key, r["seen"])
            assert "stepped by" in r["seen"]["step"]["message"], (key, r["seen"])
            assert r["seen"]["clip"]["type"] == "RuntimeError", (key, r["seen"])
            assert r["seen"]["detached"]["type"] is None, (key, r["seen"])  # step() works again


def bad_optimizers(rank, n, store_path):
    with make_comm(rank, n, store_path) as c:
        sharded = zero.shard(small_lm(), c, stage=2, bucket_cap_mb=BUCKET_CAP_MB)
        other = nn.Linear(3, 3)
        return {"torch": outcome(sharded.step_in_backward, torch.optim.SGD(sharded.parameters(), lr=0.1)),
                "foreign": outcome(sharded.step_in_backward, optim.SGD(other.parameters(), lr=0.1))}


def test_step_in_backward_refuses_what_cannot_step_its_shards():
    seen = run_ranks(bad_optimizers, 2)[0]
    assert seen["torch"]["type"] == "TypeError" and "braid.optim" in seen["torch"]["message"], seen
    foreign = seen["foreign"]
    assert foreign["type"] == "ValueError" and "every trainable shard" in foreign["message"], seen

