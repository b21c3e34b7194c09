"""torch.distributed.pipelining on the braid backend: every schedule at 2 and 4 ranks, and a
pipeline x data-parallel layout on sub-groups.

Each rank trains its stages with a schedule on the braid default group and, in the same process,
with the same schedule on a gloo group, from the same weights on the same batch. The stages only
move activations and gradients point to point, and the arithmetic is the same on both backends,
so the losses, the merged output and every gradient must be bitwise gloo's. Both are also
compared with the whole model run in one process, microbatch by microbatch, gradients summed in
microbatch order (float32, within 1e-6: the schedules run the same products, but some sum the
microbatches' gradients in another order, looped BFS for one, which moves the last bits: 7.5e-9
measured on gradients of O(0.1); a lost, misrouted or stale microbatch is off by O(0.01) or more).

The stages pass two tensors of different widths to the next stage (an activation and a running
"skip" sum), and each stage's widths differ from its neighbours', so the shape inference at the
first step (``send_object_list`` / ``recv_object_list`` between stages) and the order of several
messages to one peer both matter; no stage is given ``input_args``.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from braid.bench.models import SCHEDULE_STAGES, available_schedules, local_stage_indices
from helpers.ranks import COMM_TIMEOUT_S, braid_default_group, process_group, run_ranks
from torch import nn
from torch.distributed import pipelining

AVAILABLE = available_schedules()  # stages per rank: SCHEDULE_STAGES (the looped ones r, r + P, ...)
# Microbatch counts per pipeline size (1F1B needs at least one per stage): as many as the ranks
# (fewer than the looped schedules' stages), a count that is not a multiple of the ranks, and two
# rounds of the looped schedules.
MICROBATCHES = {2: (2, 3, 4), 4: (4, 7, 8)}
SKIP = 3  # width of the running sum passed beside the activation
ROWS_PER_MICROBATCH = 2
TOL = {"rtol": 1e-6, "atol": 1e-6}  # against the local model: why 1e-6, in the module docstring


def width(stage: int) -> int:
    """Input width of stage ``stage`` (and output width of the one before): differs per stage."""
    return 5 + 3 * stage


class Stage(nn.Module):
    """Stage ``index`` of ``count``: takes (h, skip) from the stage before (the batch x on the
    first), with a = tanh(h) (a = x on the first) returns (W a, skip + P a) to the next; the last
    returns W a + Q skip. (A stage's outputs are the last operations it applies: the zero-bubble
    schedule frees them after the input gradient, so no later operation of the stage may keep
    them for its weight gradient.)"""

    def __init__(self, index: int, count: int):
        super().__init__()
        torch.manual_seed(index)
        self.first, self.last = index == 0, index == count - 1
        self.lin = nn.Linear(width(index), width(index + 1))
        # The last stage reads the running sum, the others add to it.
        self.skip = nn.Linear(SKIP, width(index + 1)) if self.last else nn.Linear(width(index), SKIP)

    def forward(self, h: torch.Tensor, skip: torch.Tensor | None = None):
        a = h if self.first else torch.tanh(h)
        if self.last:
            return self.lin(a) + self.skip(skip)
        if self.first:
            skip = torch.zeros(h.shape[0], SKIP)
        return self.lin(a), skip + self.skip(a)


def data(count: int, microbatches: int, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch and the targets of one step (of one data-parallel replica)."""
    g = torch.Generator().manual_seed(100 + replica)
    rows = ROWS_PER_MICROBATCH * microbatches
    return torch.randn(rows, width(0), generator=g), torch.randn(rows, width(count), generator=g)


def reference(count: int, x: torch.Tensor, target: torch.Tensor, microbatches: int):
    """The whole model in one process: per-microbatch losses, the merged output, and the gradients
    of every stage (summed over microbatches and divided by their number, as ``scale_grads``)."""
    stages = [Stage(i, count) for i in range(count)]
    losses, outputs = [], []
    for xm, tm in zip(x.tensor_split(microbatches), target.tensor_split(microbatches)):
        out = (xm,)
        for s in stages:
            out = s(*out)
            out = out if isinstance(out, tuple) else (out,)
        loss = nn.functional.mse_loss(out[0], tm)
        loss.backward()
        losses.append(loss.detach())
        outputs.append(out[0].detach())
    grads = {i: [p.grad / microbatches for p in s.parameters()] for i, s in enumerate(stages)}
    return torch.stack(losses), torch.cat(outputs), grads


def train(schedule: str, rank: int, ranks: int, microbatches: int, group, x, target, wrap=None):
    """One step of ``schedule`` on this rank's stages over ``group``; returns the losses (last
    rank), the merged output (last rank) and the gradients of this rank's stages by stage index."""
    per_rank = SCHEDULE_STAGES[schedule]
    count = ranks * per_rank
    indices = local_stage_indices(rank, ranks, per_rank)
    modules = [Stage(i, count) for i in indices]
    run = [wrap(m) if wrap else m for m in modules]
    stages = [pipelining.PipelineStage(m, i, count, torch.device("cpu"), group=group)
              for m, i in zip(run, indices)]
    cls = getattr(pipelining, schedule)
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=microbatches,
                loss_fn=nn.functional.mse_loss)
    losses: list[torch.Tensor] = []
    if rank == 0:
        output = sched.step(x)
    elif rank == ranks - 1:
        output = sched.step(target=target, losses=losses)
    else:
        output = sched.step()
    grads = {i: [p.grad.clone() for p in m.parameters()] for i, m in zip(indices, modules)}
    last = rank == ranks - 1
    return (torch.stack(losses) if last else None), (output.detach() if last else None), grads


def compare(log: list[str], what: str, braid_result, gloo_result, ref_result) -> None:
    """braid bitwise gloo, and both within TOL of the local reference."""
    (bl, bo, bg), (gl, go, gg), (rl, ro, rg) = braid_result, gloo_result, ref_result
    pairs = [("losses", bl, gl, rl), ("output", bo, go, ro)]
    pairs += [(f"stage {i} grad {k}", b, gg[i][k], rg[i][k]) for i in bg for k, b in enumerate(bg[i])]
    for name, b, g, r in pairs:
        if b is None:
            continue
        if not torch.equal(b, g):
            log.append(f"{what} {name}: braid differs from gloo by {(b - g).abs().max().item():.3g}")
        for impl, value in (("braid", b), ("gloo", g)):
            if not torch.allclose(value, r, **TOL):
                log.append(f"{what} {name}: {impl} differs from the local model by "
                           f"{(value - r).abs().max().item():.3g}")


def schedule_on_both(rank, n, store_path, schedule):
    """Every microbatch count of MICROBATCHES[n]: a step on braid and on gloo, against the model."""
    failures: list[str] = []
    nonzero = True
    with braid_default_group(rank, n, store_path) as gloo:
        for m in MICROBATCHES[n]:
            count = n * SCHEDULE_STAGES[schedule]
            x, target = data(count, m)
            braid_result = train(schedule, rank, n, m, None, x, target)
            gloo_result = train(schedule, rank, n, m, gloo, x, target)
            compare(failures, f"M={m}", braid_result, gloo_result, reference(count, x, target, m))
            nonzero &= all(bool(g.abs().sum() > 0) for gs in braid_result[2].values() for g in gs)
    return {"failures": failures, "nonzero": nonzero}


@pytest.mark.parametrize("ranks", (2, 4))
@pytest.mark.parametrize("schedule", AVAILABLE)
def test_schedule_on_braid_equals_gloo_and_the_local_model(schedule, ranks):
    """A step of ``schedule`` with ``ranks`` pipeline ranks, shapes inferred: losses, output and
    gradients bitwise those of gloo and within float32 rounding of the unsplit model."""
    for r, result in enumerate(run_ranks(schedule_on_both, ranks, schedule)):
        assert not result["failures"], (r, result["failures"])
        assert result["nonzero"], r


def pipeline_by_data_parallel(rank, n, store_path, schedule, backend):
    """2 pipeline stages x 2 data-parallel replicas on 4 ranks: the pipelines are {0, 1} and
    {2, 3} (a replica each, its own batch), the data-parallel groups {0, 2} and {1, 3}; each stage
    module is wrapped in DDP over its data-parallel group (the schedules skip the gradient
    all-reduce on all microbatches but the last). Every group is of ``backend``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    pp_size, dp_size, m = 2, 2, 4
    replica, pp_rank = divmod(rank, pp_size)
    timeout = timedelta(seconds=COMM_TIMEOUT_S)
    with process_group(rank, n, store_path, backend=backend):
        # Every rank creates every group, in the same order.
        pp_groups = [dist.new_group([d * pp_size + p for p in range(pp_size)], timeout=timeout)
                     for d in range(dp_size)]
        dp_groups = [dist.new_group([d * pp_size + p for d in range(dp_size)], timeout=timeout)
                     for p in range(pp_size)]
        count = pp_size * SCHEDULE_STAGES[schedule]
        x, target = data(count, m, replica)
        losses, output, grads = train(schedule, pp_rank, pp_size, m, pp_groups[replica], x, target,
                                      wrap=lambda mod: DDP(mod, process_group=dp_groups[pp_rank]))
    # The data-parallel average of the replicas' reference gradients.
    refs = [reference(count, *data(count, m, d), m) for d in range(dp_size)]
    expected = {i: [sum(r[2][i][k] for r in refs) / dp_size for k in range(len(grads[i]))] for i in grads}
    failures = [f"stage {i} grad {k}: off by {(g - expected[i][k]).abs().max().item():.3g}"
                for i in grads for k, g in enumerate(grads[i])
                if not torch.allclose(g, expected[i][k], **TOL)]
    if losses is not None and not torch.allclose(losses, refs[replica][0], **TOL):
        failures.append(f"losses {losses.tolist()} vs {refs[replica][0].tolist()}")
    return {"failures": failures, "grads": grads, "losses": losses}


@pytest.mark.parametrize("schedule", ["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_pipeline_by_data_parallel_on_sub_groups(schedule):
    """Pipeline x data parallel on braid sub-groups (dist.new_group): every rank's gradients are
    the replicas' average of the local model's, and bitwise those of the same layout on gloo (a
    two-rank average of the same two values rounds the same way in any order)."""
    if schedule not in AVAILABLE:
        pytest.skip(f"torch {torch.__version__} has no {schedule}")
    on_braid = run_ranks(pipeline_by_data_parallel, 4, schedule, "braid")
    on_gloo = run_ranks(pipeline_by_data_parallel, 4, schedule, "gloo")
    for r, (b, g) in enumerate(zip(on_braid, on_gloo)):
        assert not b["failures"] and not g["failures"], (r, b["failures"], g["failures"])
        for i in b["grads"]:
            assert all(torch.equal(x, y) for x, y in zip(b["grads"][i], g["grads"][i])), (r, i)
        assert (b["losses"] is None) == (g["losses"] is None), r
        assert b["losses"] is None or torch.equal(b["losses"], g["losses"]), r
