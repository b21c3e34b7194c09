"""braid's ZeRO wrapper with the optimizer offloaded (``zero.shard(..., offload_optimizer=True)``):
master shards and optimizer state in host memory, each reduced bucket gradient added (and, under
``step_in_backward``, stepped) by a host thread while the backward goes on, the masters copied back
to the device before their next all-gather.

On the CPU the offloaded run does the arithmetic of the resident one in the same order, so the two
agree bit for bit: losses, parameters, optimizer state, over 20 steps at ZeRO stages 1-3, over a braid
Communicator and a gloo group, with gradient accumulation, clipping, mixed precision and qwZ. The
GPU run (pinned buffers, async copies, events) is in ``make gpu-test``.
"""
import threading
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from braid import comm, optim
from braid.comm import zero
from helpers.sharding import TOL, small_lm, small_lm_loss
from helpers.ranks import make_comm, process_group, run_ranks

# Small buckets: the model's parameters spread over several, some straddling shards.
BUCKET_CAP_MB = 2048 / 2**20
STEPS = 20


def _optimizer(name: str, params):
    if name == "adamw":
        return optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "torch-adamw":  # any optimizer steps the host shards after the backward
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return optim.SGD(params, lr=0.1, momentum=0.9)


def _train(group, rank: int, stage: int, offload: bool, opt_name: str = "adamw", in_backward: bool = False,
           micro: int = 1, clip: bool = False, mp: bool = False, qwz: bool = False, steps: int = STEPS,
           first_step: int = 0, start=None) -> dict:
    sharded = zero.shard(small_lm(), group, stage=stage, bucket_cap_mb=BUCKET_CAP_MB,
                         offload_optimizer=offload,
                         mp_policy=zero.MixedPrecision(param_dtype=torch.bfloat16) if mp else None,
                         param_compression=comm.Int8Quantizer(block=32) if qwz else None)
    opt = _optimizer(opt_name, sharded.parameters())
    if start is not None:
        sharded.load_sharded_state_dict(start["sharded"])
        opt.load_state_dict(start["optimizer"])
    stepped_on = set()
    if in_backward:
        step_param = opt.step_param

        def recorded(p, grad):
            stepped_on.add(threading.current_thread().name.split("_")[0])
            step_param(p, grad)

        opt.step_param = recorded
        sharded.step_in_backward(opt)
    losses = []
    for step in range(first_step, first_step + steps):
        sharded.zero_grad()
        for m in range(micro):
            loss = small_lm_loss(sharded, rank, step, m) / micro
            if m < micro - 1:
                with sharded.no_sync():
                    loss.backward()
            else:
                loss.backward()
            losses.append(loss.item())
        if clip:
            losses.append(sharded.clip_grad_norm_(0.5).item())
        if not in_backward:
            opt.step()
    on_host = all(p.device.type == "cpu" for p in sharded.parameters())
    return {"losses": losses, "params": sharded.full_state_dict(), "sharded": sharded.sharded_state_dict(),
            "optimizer": opt.state_dict(), "stepped_on": stepped_on, "on_host": on_host,
            "memory": sharded.memory_stats(opt),
            "masters": sum(p.numel() * p.element_size() for p in sharded.parameters())}


def _same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not isinstance(y, dict) or not _same_state(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, list):
            if len(x) != len(y) or any(
                    not _same_state({"v": u}, {"v": v}) for u, v in zip(x, y)):
                return False
        elif x != y:
            return False
    return True


# (stage, options): every stage plain for 20 steps, then for 8 steps each: accumulation +
# clipping, step_in_backward, torch's optimizer, mixed precision, qwZ.
CASES = [(1, {}), (2, {}), (3, {}),
         (2, {"micro": 2, "clip": True, "steps": 8}),
         (3, {"micro": 2, "clip": True, "opt_name": "sgd", "steps": 8}),
         (2, {"in_backward": True, "steps": 8}),
         (3, {"in_backward": True, "micro": 2, "steps": 8}),
         (1, {"opt_name": "torch-adamw", "steps": 8}),
         (3, {"mp": True, "steps": 8}),
         (3, {"qwz": True, "steps": 8})]


def offloaded_equals_resident(rank, n, store_path, carrier, cases):
    out = {}
    with process_group(rank, n, store_path):
        with make_comm(rank, n, store_path) as c:
            group = c if carrier == "communicator" else dist.group.WORLD
            for i in cases:
                stage, options = CASES[i]
                resident = _train(group, rank, stage, False, **options)
                offloaded = _train(group, rank, stage, True, **options)
                moved = max((resident["params"][k] - v).abs().max().item()
                            for k, v in small_lm().state_dict().items())
                out[i] = {
                    "losses": resident["losses"] == offloaded["losses"],
                    "params": _same_state(resident["params"], offloaded["params"]),
                    "optimizer": _same_state(resident["optimizer"], offloaded["optimizer"]),
                    "sharded": _same_state(resident["sharded"], offloaded["sharded"]),
                    "moved": moved, "on_host": offloaded["on_host"], "stepped_on": offloaded["stepped_on"],
                    "memory": (resident["memory"], offloaded["memory"]), "masters": offloaded["masters"],
                }
    return out


@pytest.mark.parametrize("carrier,world_size,cases", (
    ("communicator", 2, (0, 1, 2, 3, 5, 6, 8, 9)),
    ("gloo", 3, (4, 7)),
))
def test_offloaded_training_equals_resident_bitwise(carrier, world_size, cases):
    for rank, out in enumerate(run_ranks(offloaded_equals_resident, world_size, carrier, tuple(cases))):
        for i, r in out.items():
            case = (carrier, rank, CASES[i])
            assert r["on_host"], case
            assert r["losses"] and r["params"] and r["optimizer"] and r["sharded"], (case, r)
            assert r["moved"] > 1e-3, (case, "the parameters did not move")
            if CASES[i][1].get("in_backward"):
                assert r["stepped_on"] == {"braid-offload"}, (case, r["stepped_on"])
            resident, offloaded = r["memory"]
            assert "optimizer" in resident and "offloaded" in offloaded and "optimizer" not in offloaded, case
            # The host holds the masters, their gradients (same size) and the optimizer's state
            # (the resident run's, byte for byte); on the CPU no pinned staging buffer.
            assert offloaded["offloaded"] == resident["optimizer"] + 2 * r["masters"], (case, r["memory"])
            if CASES[i][1].get("mp"):
                # ZeRO stage 3 between steps: only the shards' bfloat16 images stay on the device.
                assert 2 * offloaded["params"] == resident["params"], (case, r["memory"])


def offloaded_resumes(rank, n, store_path, stage):
    with make_comm(rank, n, store_path) as c:
        straight = _train(c, rank, stage, True, steps=6)
        first = _train(c, rank, stage, True, steps=3)
        # A new wrapper and optimizer loaded from the sharded checkpoint, steps 3-5.
        resumed = _train(c, rank, stage, True, steps=3, first_step=3, start=first)
        return (_same_state(straight["params"], resumed["params"]),
                _same_state(straight["optimizer"], resumed["optimizer"]),
                straight["losses"][3:] == resumed["losses"])


@pytest.mark.parametrize("stage", (1, 3))
def test_offloaded_training_resumes_bitwise_from_a_sharded_checkpoint(stage):
    for same in run_ranks(offloaded_resumes, 2, stage):
        assert same == (True, True, True), same


def test_offload_argument_is_checked():
    with pytest.raises(TypeError, match="offload_optimizer must be True or False"):
        zero.shard(small_lm(), None, offload_optimizer="cpu")


def _delayed_reference(n: int, steps: int, delay_from: Optional[int]) -> tuple:
    """The dense model trained in one process as the ranks train it together: each step's
    gradient the mean of every rank's. From step ``delay_from`` on (None: never) ZeRO-Offload's
    delayed update, written out: the forward and backward of step t use the parameters before the
    update of step t - 1, which runs meanwhile. Returns (losses per step and rank, final
    parameters)."""
    compute, master = small_lm(), small_lm()
    opt = optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        delay = delay_from is not None and step >= delay_from
        if step == delay_from:  # no update is pending: the delayed steps start from the masters
            with torch.no_grad():
                for p, q in zip(compute.parameters(), master.parameters()):
                    p.copy_(q)
        model = compute if delay else master
        model.zero_grad()
        row = []
        for rank in range(n):
            loss = small_lm_loss(model, rank, step, 0)
            (loss / n).backward()
            row.append(loss.item())
        losses.append(row)
        with torch.no_grad():
            for p, q in zip(master.parameters(), model.parameters()):
                p.grad = q.grad.clone()
            if delay:  # the next step computes with the parameters as they are before this update
                for p, q in zip(compute.parameters(), master.parameters()):
                    p.copy_(q)
        opt.step()
    return losses, master.state_dict()


def delayed_update(rank, n, store_path, carrier, stage, steps, delay_from):
    with process_group(rank, n, store_path):
        with make_comm(rank, n, store_path) as c:
            group = c if carrier == "communicator" else dist.group.WORLD
            sharded = zero.shard(small_lm(), group, stage=stage, bucket_cap_mb=BUCKET_CAP_MB,
                                 offload_optimizer=True)
            opt = optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1)
            threads = set()
            step_param = opt.step_param

            def recorded(p, grad):
                threads.add(threading.current_thread().name.split("_")[0])
                step_param(p, grad)

            opt.step_param = recorded
            losses, grads_after = [], []
            for step in range(steps):
                if step in (0, delay_from):
                    sharded.step_in_backward(opt, delay=step == delay_from)
                sharded.zero_grad()
                loss = small_lm_loss(sharded, rank, step, 0)
                loss.backward()
                losses.append(loss.item())
                if step >= delay_from:
                    grads_after.append(all(p.grad is None for p in sharded.parameters()))
            params = sharded.full_state_dict()  # waits for the last delayed step
            return losses, params, threads, all(grads_after)


@pytest.mark.parametrize("carrier,world_size,stage,delay_from", (
    ("communicator", 2, 1, 0), ("communicator", 2, 2, 0), ("communicator", 2, 3, 0), ("gloo", 3, 3, 0),
    ("communicator", 2, 2, 2)))
def test_delayed_update_trains_one_step_stale(carrier, world_size, stage, delay_from):
    """step_in_backward(opt, delay=True): every step's forward and backward use the parameters from
    before the previous step's update, which the host thread runs meanwhile; the losses and the
    final parameters follow the delayed update written out in one process (to float32 rounding:
    the mean over ranks is summed in another order there), and not the undelayed one. The delay
    may start after some steps without it (``delay_from``)."""
    steps = 6
    ref_losses, ref_params = _delayed_reference(world_size, steps, delay_from)
    _, undelayed = _delayed_reference(world_size, steps, None)
    for rank, (losses, params, threads, grads_gone) in enumerate(
            run_ranks(delayed_update, world_size, carrier, stage, steps, delay_from)):
        torch.testing.assert_close(losses, [row[rank] for row in ref_losses], **TOL)
        assert params.keys() == ref_params.keys()
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")
        assert max((params[k] - v).abs().max().item() for k, v in undelayed.items()) > 1e-3
        assert threads == {"braid-offload"}, threads
        assert grads_gone  # the gradients went to the delayed steps


def _delay_arguments(rank, n, store_path):
    with make_comm(rank, n, store_path) as c:
        sharded = zero.shard(small_lm(), c, stage=1)
        opt = optim.AdamW(sharded.parameters())
        with pytest.raises(ValueError, match=r"delay=True\) needs offload_optimizer=True"):
            sharded.step_in_backward(opt, delay=True)
        with pytest.raises(TypeError, match="delay must be True or False"):
            sharded.step_in_backward(opt, delay=1)
    return True


def test_delay_needs_offload_and_a_bool():
    assert run_ranks(_delay_arguments, 1) == [True]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _train_cuda(rank: int, stage: int, offload: bool, in_backward: bool) -> tuple:
    torch.cuda.set_device(0)
    model = small_lm().cuda()
    sharded = zero.shard(model, None, stage=stage, bucket_cap_mb=BUCKET_CAP_MB, offload_optimizer=offload)
    shards = list(sharded.parameters())
    # The resident run steps on the GPU with torch's SGD, the offloaded one on the host with
    # braid's: the same arithmetic up to fused multiply-adds.
    opt = (optim.SGD if offload else torch.optim.SGD)(shards, lr=0.1, momentum=0.9)
    if in_backward:
        sharded.step_in_backward(opt)
    losses = []
    for step in range(STEPS):
        sharded.zero_grad()
        loss = small_lm_loss(sharded, rank, step, 0)
        loss.backward()
        losses.append(loss.item())
        if not in_backward:
            opt.step()
    pinned = all(p.is_pinned() for p in shards) if offload else None
    return losses, {k: v.cpu() for k, v in sharded.full_state_dict().items()}, pinned


def offloaded_on_cuda(rank, n, store_path):
    with process_group(rank, n, store_path):  # gloo: CUDA tensors through host memory
        out = {}
        for stage in (1, 3):
            resident = _train_cuda(rank, stage, False, False)
            for in_backward in (False, True):
                offloaded = _train_cuda(rank, stage, True, in_backward)
                out[(stage, in_backward)] = (resident, offloaded)
        return out


@pytest.mark.gpu
@needs_cuda
def test_offloaded_training_on_cuda_follows_the_resident_run():
    """Two ranks sharing the GPU: the masters pinned on the host, gradients copied down and
    masters up asynchronously; 20 steps follow the resident run's losses and parameters to
    float32 rounding (1e-5). (Float32 compute: under bfloat16 one ulp of a master can flip a
    rounding of its image; mixed precision is compared bit for bit on the CPU.)"""
    for out in run_ranks(offloaded_on_cuda, 2, deadline_s=300):
        for key, ((losses, params, _), (off_losses, off_params, pinned)) in out.items():
            assert pinned, key
            torch.testing.assert_close(off_losses, losses, atol=1e-5, rtol=1e-5, msg=str(key))
            for k, v in params.items():
                torch.testing.assert_close(off_params[k], v, atol=1e-5, rtol=1e-5, msg=f"{key} {k}")
