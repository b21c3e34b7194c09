"""Pipeline-parallel benchmark: torch.distributed.pipelining schedules on the braid backend vs gloo.

    python -m braid.bench pipeline                          # 2 then 4 pipeline ranks, every schedule
    python -m braid.bench pipeline --nproc 2 --microbatches 8 --schedules ScheduleGPipe,Schedule1F1B
    python -m braid.bench pipeline --json results/pipeline.json

A small transformer language model (bench/models.py: token embedding, pre-norm blocks, final
norm and head) is cut into consecutive stages: stage i holds blocks [i*L/S, (i+1)*L/S) of the S
stages, the first also the embedding, the last also the norm and the head. Single-stage schedules
(GPipe, 1F1B) give each of the P ranks one stage (S = P); the looped ones (interleaved 1F1B,
looped BFS, interleaved zero bubble) two, rank r holding stages r and r + P (S = 2P). Each schedule
runs in the same processes on a ``dist.new_group(backend="braid")`` group (``braid``) and on the
run's gloo group (``gloo``), with stage modules copied from the same model: the same arithmetic on
the same microbatches, only the point-to-point transport differs. Shapes between stages are
inferred by the stages themselves (``send_object_list`` at the first step).

A step is ``zero_grad`` and ``schedule.step`` over one batch of ``BATCH`` sequences cut into ``M``
microbatches, cross-entropy loss, no optimizer. Timing: implementations take turns (bench/turns.py):
per round a gloo barrier, then ``--steps`` steps of one implementation timed together; a round's
time per step is the slowest rank's; the figure is the median over ``--rounds`` rounds after
``--warmup`` steps. ``compute`` runs each rank's share of the arithmetic (forward and backward of
its stages over every microbatch, fixed inputs and output gradients) with no communication, all
ranks at once, and its figure is the slowest rank's CPU time per step (see _compute_seconds).
Bubble = 1 - compute / step: the fraction of the step that is not the slowest rank's arithmetic
(idle slots, communication, the schedule's own overhead, waiting for a core), against the
textbook (P-1)/(M+P-1) of GPipe and 1F1B with equal stages and free communication (the looped
schedules aim lower: (P-1)/(2M+P-1) for two stages per rank, and zero bubble near 0).

``floor`` is the step the same schedule would take with instant transfers: each rank's compute
actions of the timed steps are recorded in the order the schedule ran them, with their thread CPU
time (forward, backward, and the input- and weight-gradient halves of the zero-bubble schedules)
and the rank's own CPU work before each outside the point-to-point calls (the schedule's Python,
the loss, zero_grad), and replayed with every action starting once its rank is free and its input
from the neighbouring stage is computed (schedule_floor); where more ranks than cores run, the
cores bound the replay too. No transport, braid's or gloo's, can make that schedule's step
shorter. ``err``
is the largest difference of the losses and this rank's gradients from the whole model run
locally on the same microbatches; ``exact`` says whether braid's losses and gradients are
bitwise those of gloo.

--json writes {"benchmark": "pipeline", "date", "machine", "config", "records": [{"impl",
"schedule", "ranks", "stages_per_rank", "microbatches", "shape", "step_ms", "ratio_vs_gloo",
"bubble", "ideal_bubble", "floor_ms", "floor_vs_gloo", "err", "exact"}]}.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import launch, report, turns
from .models import SCHEDULE_STAGES, LanguageModel, available_schedules, local_stage_indices

IMPLS = ("braid", "gloo", "compute")
# The target: every schedule's step on braid at most this fraction of its step on gloo.
TARGET = 0.8


@dataclass(frozen=True)
class Shape:
    vocab: int
    dim: int
    heads: int
    hidden: int
    layers: int
    batch: int
    seq: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        return turns.parse_dims(cls, text, "VOCABxDIMxHEADSxHIDDENxLAYERSxBATCHxSEQ")

    __str__ = turns.format_dims


# A tiny model whose microbatches (a 32-token sequence or two) take a few milliseconds per stage,
# so that each transfer's latency weighs against the arithmetic, and one with 8x the tokens and
# 2x the width: ~30x the arithmetic per microbatch, 4x the bytes per transfer.
DEFAULT_SHAPES = (Shape(256, 64, 4, 256, 8, 8, 32), Shape(1024, 128, 4, 512, 8, 16, 64))
DEFAULT_MICROBATCHES = (4, 8)


@dataclass(frozen=True)
class Config:
    run: turns.RunOptions
    shapes: tuple[Shape, ...]
    microbatches: tuple[int, ...]
    schedules: tuple[str, ...]
    records_path: str | None  # spawned runs: rank 0 leaves its records here for the launcher


class Stage(nn.Sequential):
    """Stage ``index`` of ``count`` of a :class:`LanguageModel`, as copies of its modules applied in
    order; ``sources[k]`` is the model's name of module ``k`` (to find its reference gradients)."""

    def __init__(self, model: LanguageModel, index: int, count: int):
        layers = len(model.blocks)
        lo, hi = index * layers // count, (index + 1) * layers // count
        names = (["embed"] if index == 0 else []) + [f"blocks.{i}" for i in range(lo, hi)]
        names += ["norm", "head"] if index == count - 1 else []
        super().__init__(*(copy.deepcopy(model.get_submodule(n)) for n in names))
        self.sources = names

    def source_name(self, local: str) -> str:
        """The model's name of this stage's parameter ``local`` (``"1.attn.wq.weight"``)."""
        k, _, rest = local.partition(".")
        return f"{self.sources[int(k)]}.{rest}"


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a microbatch."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@dataclass
class Batch:
    ids: torch.Tensor     # (BATCH, SEQ) token ids, stage 0's input
    target: torch.Tensor  # (BATCH, SEQ) next tokens


def make_batch(shape: Shape) -> Batch:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def reference(model: LanguageModel, batch: Batch, microbatches: int) -> tuple[list[float], dict]:
    """The whole model on one process, microbatch by microbatch as the schedules cut the batch:
    the losses and the gradients (summed over microbatches, divided by their number, as the
    schedules' ``scale_grads`` does), by parameter name."""
    model = copy.deepcopy(model)
    losses = []
    for ids, target in zip(batch.ids.tensor_split(microbatches), batch.target.tensor_split(microbatches)):
        loss = lm_loss(model(ids), target)
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad / microbatches for n, p in model.named_parameters()}


class Pipeline:
    """One schedule over this rank's stages on one process group; ``step()`` trains one batch."""

    def __init__(self, model: LanguageModel, schedule: str, rank: int, ranks: int, microbatches: int,
                 batch: Batch, group: dist.ProcessGroup | None):
        from torch.distributed import pipelining

        per_rank = SCHEDULE_STAGES[schedule]
        count = ranks * per_rank
        self.modules = [Stage(model, i, count) for i in local_stage_indices(rank, ranks, per_rank)]
        stages = [pipelining.PipelineStage(m, i, count, torch.device("cpu"), group=group)
                  for m, i in zip(self.modules, local_stage_indices(rank, ranks, per_rank))]
        cls = getattr(pipelining, schedule)
        self.schedule = cls(stages if per_rank > 1 else stages[0], n_microbatches=microbatches,
                            loss_fn=lm_loss)
        self.first = rank == 0                # holds stage 0
        self.last = rank == ranks - 1         # holds stage count - 1
        self.batch = batch
        self.losses: list[torch.Tensor] = []
        self.actions: list[list[tuple]] = []  # per step: this rank's compute actions (ActionRecorder)
        ActionRecorder.install()

    def step(self) -> None:
        with ActionRecorder.recording() as actions:
            for m in self.modules:
                m.zero_grad(set_to_none=True)
            self.losses = []
            args = (self.batch.ids,) if self.first else ()
            kwargs = {"target": self.batch.target, "losses": self.losses} if self.last else {}
            self.schedule.step(*args, **kwargs)
        self.actions.append(actions)

    def gradients(self) -> dict[str, torch.Tensor]:
        return {m.source_name(n): p.grad for m in self.modules for n, p in m.named_parameters()}


class ActionRecorder:
    """Wraps the compute methods of torch's pipeline stages and the schedules' communication calls
    (once per process) so that, inside ``recording()``, each compute call appends ``(kind, stage,
    microbatch, seconds, host)``: kind "F" forward, "B" full backward, "I" input-gradient half, "W"
    weight-gradient half; ``seconds`` its thread CPU time; ``host`` the thread CPU time this rank
    spent since its previous action (or the step's start) outside communication calls: the
    schedule's own Python, the loss, zero_grad. The step's end appends ``("E", -1, -1, 0.0, host)``
    with what followed the last action. Time inside the schedules' point-to-point calls (posting
    and waiting, torch's wrappers included) is left out of both: it belongs to the transport."""

    _current: list | None = None
    _mark = 0.0    # thread CPU time at the end of the last action (or the step's start)
    _comm = 0.0    # thread CPU seconds inside communication calls since _mark
    _depth = 0     # nesting of communication calls (_sorted_batch_p2p calls _batch_p2p)

    @classmethod
    def install(cls) -> None:
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.stage import _PipelineStageBase

        def backward_kind(args: tuple, kwargs: dict) -> str:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return "B" if full else "I"

        for name, kind_of in (("forward_one_chunk", lambda a, k: "F"), ("backward_one_chunk", backward_kind),
                              ("backward_weight_one_chunk", lambda a, k: "W")):
            original = getattr(_PipelineStageBase, name)
            if getattr(original, "recorded_by_braid", False):
                continue

            @functools.wraps(original)
            def run(self, chunk, *args, _original=original, _kind_of=kind_of, **kwargs):
                actions = ActionRecorder._current
                if actions is None:
                    return _original(self, chunk, *args, **kwargs)
                begin = time.thread_time()
                host = begin - ActionRecorder._mark - ActionRecorder._comm
                try:
                    return _original(self, chunk, *args, **kwargs)
                finally:
                    end = time.thread_time()
                    actions.append((_kind_of(args, kwargs), self.stage_index, chunk, end - begin, host))
                    ActionRecorder._mark, ActionRecorder._comm = end, 0.0

            run.recorded_by_braid = True
            setattr(_PipelineStageBase, name, run)

        # The schedules call these through their module's globals, so replacing them there is seen.
        for name in ("_batch_p2p", "_sorted_batch_p2p", "_wait_batch_p2p"):
            original = getattr(schedules, name)
            if getattr(original, "recorded_by_braid", False):
                continue

            @functools.wraps(original)
            def communicate(*args, _original=original, **kwargs):
                if ActionRecorder._current is None or ActionRecorder._depth:
                    return _original(*args, **kwargs)
                begin = time.thread_time()
                ActionRecorder._depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    ActionRecorder._depth -= 1
                    ActionRecorder._comm += time.thread_time() - begin

            communicate.recorded_by_braid = True
            setattr(schedules, name, communicate)

    @classmethod
    @contextlib.contextmanager
    def recording(cls):
        actions: list = []
        cls._current, cls._mark, cls._comm = actions, time.thread_time(), 0.0
        try:
            yield actions
            actions.append(("E", -1, -1, 0.0, time.thread_time() - cls._mark - cls._comm))
        finally:
            cls._current = None


def schedule_floor(per_rank: Sequence[Sequence[tuple]], stages: int, cores: int | None = None) -> float:
    """Seconds of one step of a schedule with instant transfers: every rank runs its recorded
    actions (``ActionRecorder``) in their order, each starting once the rank is free and, for a
    forward, the previous stage's forward of that microbatch, for a backward or input-gradient
    half, the next stage's of that microbatch is done (weight-gradient halves and the step's end,
    kind "E", wait for nothing else). An action's optional fifth field, ``host``, is the rank's own
    CPU work before it (the schedule's Python); it may overlap the wait for the neighbouring
    stage, never the rank's previous action.

    With ``cores`` shared by the ranks the step is also bounded by the cores: every piece of work
    (an action's host part or its arithmetic) can start no earlier than the replay above starts
    it, and must leave at least its tail (the longest chain of work that depends on it) before the
    step ends; for any times ``a`` and ``b``, all the work that starts at ``a`` or later and has a
    tail of ``b`` or more fits in ``step - a - b`` on the cores. The largest such bound is
    returned when it exceeds the replay (with a = b = 0 it is all the work over the cores)."""
    made_by: dict[tuple, tuple] = {}  # ("F"|"G"|kind, stage, mb) -> (rank, index)
    jobs: list[list[tuple]] = [[] for _ in per_rank]  # per action: (host start, host, start, seconds)
    clock = [0.0] * len(per_rank)
    pos = [0] * len(per_rank)
    needs: dict[tuple, tuple | None] = {}

    def product(action: tuple) -> tuple[tuple | None, tuple]:
        kind, stage, mb = action[:3]
        if kind == "F":
            return (("F", stage - 1, mb) if stage > 0 else None), ("F", stage, mb)
        if kind in ("B", "I"):
            return (("G", stage + 1, mb) if stage < stages - 1 else None), ("G", stage, mb)
        return None, (kind, stage, mb)

    def end(key: tuple) -> float:  # when the action at (rank, index) finished in the replay
        _, _, start, seconds = jobs[key[0]][key[1]]
        return start + seconds

    while any(p < len(a) for p, a in zip(pos, per_rank)):
        moved = False
        for r, actions in enumerate(per_rank):
            while pos[r] < len(actions):
                seconds, *rest = actions[pos[r]][3:]
                host = rest[0] if rest else 0.0
                need, made = product(actions[pos[r]])
                if need is not None and need not in made_by:
                    break
                needs[(r, pos[r])] = made_by[need] if need is not None else None
                start = max(clock[r] + host, end(made_by[need]) if need is not None else 0.0)
                jobs[r].append((clock[r], host, start, seconds))
                clock[r] = start + seconds
                made_by[made] = (r, pos[r])
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the recorded pipeline actions wait for each other: "
                               + ", ".join(str(a[p]) for p, a in zip(pos, per_rank) if p < len(a)))
    replay = max(clock)
    if not cores:
        return replay
    # Tails: after an action's arithmetic ends, its rank's next action (host part and arithmetic)
    # and the arithmetic of every action that needs its product must still run, one after another.
    dependents: dict[tuple, list[tuple]] = {}
    for key, need in needs.items():
        if need is not None:
            dependents.setdefault(need, []).append(key)
    def after(key: tuple) -> list[tuple]:
        r, i = key
        return ([(r, i + 1)] if i + 1 < len(jobs[r]) else []) + dependents.get(key, [])

    tail: dict[tuple, float] = {}
    for root in needs:  # depth first, each action after everything that follows it
        stack = [root]
        while stack:
            key = stack[-1]
            if key in tail:
                stack.pop()
                continue
            missing = [k for k in after(key) if k not in tail]
            if missing:
                stack += missing
                continue
            stack.pop()
            r, i = key
            t = 0.0
            if i + 1 < len(jobs[r]):
                _, host, _, seconds = jobs[r][i + 1]
                t = host + seconds + tail[(r, i + 1)]
            for d in dependents.get(key, ()):
                t = max(t, jobs[d[0]][d[1]][3] + tail[d])
            tail[key] = t
    # Pieces of work: (earliest start, tail after it, seconds).
    pieces = []
    for (r, i), t in tail.items():
        host_start, host, start, seconds = jobs[r][i]
        pieces.append((start, t, seconds))
        if host > 0:
            pieces.append((host_start, seconds + t, host))
    best = replay
    for a in sorted({p[0] for p in pieces}):
        later = sorted((p for p in pieces if p[0] >= a), key=lambda p: -p[1])
        work = 0.0
        for _, b, seconds in later:
            work += seconds
            best = max(best, a + b + work / cores)
    return best


class StageCompute:
    """This rank's arithmetic of a pipeline step with no communication: forward and backward of
    each of its stages over every microbatch, on fixed inputs (token ids for stage 0, random
    activations otherwise) and fixed output gradients (the loss on the last stage)."""

    def __init__(self, model: LanguageModel, shape: Shape, rank: int, ranks: int, per_rank: int,
                 microbatches: int, batch: Batch):
        count = ranks * per_rank
        g = torch.Generator().manual_seed(2)
        rows = shape.batch // microbatches
        activation = (rows, shape.seq, shape.dim)
        self.work = []
        for i in local_stage_indices(rank, ranks, per_rank):
            module = Stage(model, i, count)
            ids = batch.ids.tensor_split(microbatches)
            inputs = ids if i == 0 else [torch.randn(activation, generator=g).requires_grad_()
                                         for _ in range(microbatches)]
            grads = None if i == count - 1 else [torch.randn(activation, generator=g)
                                                 for _ in range(microbatches)]
            self.work.append((module, inputs, grads, batch.target.tensor_split(microbatches)))

    def step(self) -> None:
        for module, inputs, grads, targets in self.work:
            module.zero_grad(set_to_none=True)
            for j, x in enumerate(inputs):
                out = module(x)
                if grads is None:
                    lm_loss(out, targets[j]).backward()
                else:
                    out.backward(grads[j])


def _compute_seconds(work: StageCompute, run: turns.RunOptions) -> float:
    """CPU seconds of one compute step: the median over ``rounds * steps`` steps, the slowest
    rank's. CPU time, not wall time: on a shared machine a process that computes without pause
    gets a smaller share of its core than one that sleeps between bursts (the scheduler favours
    the sleeper), so a wall-clock "compute only" step can take longer than the pipeline itself."""
    for _ in range(run.warmup):
        work.step()
    dist.barrier()
    spent = []
    for _ in range(run.rounds * run.steps):
        begin = time.process_time()
        work.step()
        spent.append(time.process_time() - begin)
    return turns.max_over_ranks([statistics.median(spent)])[0]


def _floors(pipes: dict, schedules: Sequence[str], ranks: int) -> dict[str, float]:
    """Each schedule's floor (schedule_floor) on the cores the ranks share: per implementation,
    the median over its timed steps of the replay of every rank's recorded actions of that step;
    then the lower of the implementations' (the arithmetic and the schedule's Python are the same
    in both, and the floor must not hold one transport's slower steps against the other)."""
    mine = {key: pipe.actions for key, pipe in pipes.items()}
    gathered: list = [None] * ranks
    dist.all_gather_object(gathered, mine)
    cores = min(ranks, os.cpu_count() or ranks)  # the ranks share the machine (a pinned rank sees one core)
    floors = {}
    for s in schedules:
        stages = ranks * SCHEDULE_STAGES[s]
        floors[s] = min(statistics.median(schedule_floor([g[key][k] for g in gathered], stages, cores)
                                          for k in range(len(mine[key])))
                        for key in mine if key[0] == s)
    return floors


def _max_error(pipe: Pipeline, ref_losses: list[float], ref_grads: dict) -> float:
    err = max((pipe.gradients()[n] - ref_grads[n]).abs().max().item() for n in pipe.gradients())
    if pipe.last:
        err = max([err] + [abs(a.item() - b) for a, b in zip(pipe.losses, ref_losses)])
    return err


def _same(a: Pipeline, b: Pipeline) -> bool:
    ga, gb = a.gradients(), b.gradients()
    return all(torch.equal(ga[n], gb[n]) for n in ga) and all(
        torch.equal(x, y) for x, y in zip(a.losses, b.losses))


def _bench_case(shape: Shape, microbatches: int, config: Config, rank: int, ranks: int,
                groups: dict[str, dist.ProcessGroup | None], progress: report.Progress) -> list[dict]:
    run = config.run
    torch.manual_seed(0)
    model = LanguageModel(shape.vocab, shape.dim, shape.heads, shape.hidden, shape.layers)
    batch = make_batch(shape)
    ref_losses, ref_grads = reference(model, batch, microbatches)
    pipe_impls = [i for i in run.impls if i in groups]
    pipes = {(s, i): Pipeline(model, s, rank, ranks, microbatches, batch, groups[i])
             for s in config.schedules for i in pipe_impls}
    steps: dict[str, Callable[[], None]] = {}
    errors, exact = {}, {}
    activation_bytes = shape.batch // microbatches * shape.seq * shape.dim * 4
    for (schedule, impl), pipe in pipes.items():
        progress(impl, f"{schedule} P={ranks} M={microbatches} check", activation_bytes)
        pipe.step()  # the first step infers the shapes between stages
        errors[(schedule, impl)] = _max_error(pipe, ref_losses, ref_grads)
        for _ in range(run.warmup - 1):
            pipe.step()
        steps[f"{schedule}/{impl}"] = pipe.step
    for schedule in config.schedules:
        if {"braid", "gloo"} <= set(pipe_impls):
            exact[schedule] = _same(pipes[(schedule, "braid")], pipes[(schedule, "gloo")])
    for pipe in pipes.values():
        pipe.actions = []  # the timed steps only
    times = turns.time_in_turns(steps, run, progress, activation_bytes)
    floors = _floors(pipes, config.schedules, ranks)
    if "compute" in run.impls:
        for v in sorted({SCHEDULE_STAGES[s] for s in config.schedules}):
            progress("compute", f"{v} stage(s) per rank P={ranks} M={microbatches}", activation_bytes)
            times[f"compute/{v}"] = _compute_seconds(
                StageCompute(model, shape, rank, ranks, v, microbatches, batch), run)
    keys = list(errors)
    worst = dict(zip(keys, turns.max_over_ranks([errors[k] for k in keys])))
    agree = turns.max_over_ranks([0.0 if exact[s] else 1.0 for s in exact])
    exact = {s: a == 0.0 for s, a in zip(exact, agree)}
    ideal = (ranks - 1) / (microbatches + ranks - 1)
    records = []
    for schedule in config.schedules:
        v = SCHEDULE_STAGES[schedule]
        compute = times.get(f"compute/{v}")
        base = {"schedule": schedule, "ranks": ranks, "stages_per_rank": v, "microbatches": microbatches,
                "shape": str(shape), "ideal_bubble": round(ideal, 3)}
        gloo = times.get(f"{schedule}/gloo")
        floor = floors[schedule]
        for impl in pipe_impls:
            step = times[f"{schedule}/{impl}"]
            records.append({"impl": impl, **base, "step_ms": round(step * 1e3, 3),
                            "ratio_vs_gloo": None if gloo is None else round(step / gloo, 3),
                            "bubble": None if compute is None else round(1 - compute / step, 3),
                            "floor_ms": round(floor * 1e3, 3),
                            "floor_vs_gloo": None if gloo is None else round(floor / gloo, 3),
                            "err": float(f"{worst[(schedule, impl)]:.3g}"), "exact": exact.get(schedule)})
        if compute is not None:
            records.append({"impl": "compute", **base, "step_ms": round(compute * 1e3, 3),
                            "ratio_vs_gloo": None, "bubble": None, "floor_ms": None, "floor_vs_gloo": None,
                            "err": None, "exact": None})
    return records


def _run_rank(rank: int, world_size: int, store_port: int | None, config: Config) -> int:
    run = config.run
    launch.start_rank(rank, world_size, store_port, bind=run.bind, threads=run.threads, timeout_s=run.timeout)
    try:
        groups: dict[str, dist.ProcessGroup | None] = {"gloo": None}  # the run's default group
        if "braid" in run.impls:
            import braid.comm  # noqa: F401  (registers the backend)

            groups["braid"] = dist.new_group(backend="braid", timeout=timedelta(seconds=run.timeout))
        cells = len(config.schedules) * sum(i in groups for i in run.impls)
        per_case = (1 + run.rounds) * cells
        per_case += len({SCHEDULE_STAGES[s] for s in config.schedules}) if "compute" in run.impls else 0
        cases = len(config.shapes) * len(config.microbatches)
        progress = report.Progress(cases * per_case, enabled=rank == 0)
        records = []
        for shape in config.shapes:
            for m in config.microbatches:
                records += _bench_case(shape, m, config, rank, world_size, groups, progress)
        progress.close()
        launch.end_gloo_use()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    if config.records_path is not None:
        with open(config.records_path, "w") as f:
            json.dump(records, f)
        return 0
    return _report(config, records)


def _table(records: list[dict]) -> str:
    lines = ["#  P   M  shape (VxDxHxFxLxBxS)       schedule                       impl     step (ms)"
             "  vs gloo  floor/gloo  bubble  (P-1)/(M+P-1)      err  exact"]
    for r in records:
        ratio = "-" if r["ratio_vs_gloo"] is None else f"{r['ratio_vs_gloo']:.3f}"
        floor = "-" if r["floor_vs_gloo"] is None or r["impl"] != "braid" else f"{r['floor_vs_gloo']:.3f}"
        bubble = "-" if r["bubble"] is None else f"{r['bubble']:.2f}"
        err = "-" if r["err"] is None else f"{r['err']:.2g}"
        exact = "-" if r["exact"] is None or r["impl"] != "braid" else ("yes" if r["exact"] else "NO")
        lines.append(f"  {r['ranks']:>2} {r['microbatches']:>3}  {r['shape']:<25} {r['schedule']:<30} "
                     f"{r['impl']:<8} {r['step_ms']:>9.2f}  {ratio:>7}  {floor:>10}  {bubble:>6}  "
                     f"{r['ideal_bubble']:>13.2f}  {err:>7}  {exact:>5}")
    return "\n".join(lines)


def _report(config: Config, records: list[dict]) -> int:
    print(_table(records))
    # The stages compute in float32 what the whole model computes, microbatch by microbatch: a
    # correct pipeline differs from it by rounding only. braid and gloo move the same bytes.
    bad = [r for r in records if (r["err"] is not None and not r["err"] <= 1e-4) or r["exact"] is False]
    ratios = [r["ratio_vs_gloo"] for r in records if r["impl"] == "braid" and r["ratio_vs_gloo"] is not None]
    if ratios:
        print(f"# braid step / gloo step: worst {max(ratios):.3f}, best {min(ratios):.3f}")
        cells = [r for r in records if r["impl"] == "braid" and r["floor_vs_gloo"] is not None]
        reachable = [r for r in cells if r["floor_vs_gloo"] <= TARGET]
        met = sum(r["ratio_vs_gloo"] <= TARGET for r in cells)
        met_reachable = sum(r["ratio_vs_gloo"] <= TARGET for r in reachable)
        above = len(cells) - len(reachable)
        print(f"# cells at or below {TARGET:.2f}x gloo: {met} of {len(cells)}; {above} where the schedule "
              f"with instant transfers is already above {TARGET:.2f}x gloo; of the {len(reachable)} others, "
              f"{met_reachable} at or below {TARGET:.2f}x")
    settings = {"world_size": sorted({r["ranks"] for r in records}),
                "shapes": [str(s) for s in config.shapes], "microbatches": list(config.microbatches),
                "schedules": list(config.schedules)}
    return turns.finish(config.run, "pipeline", settings, records, bad,
                        "# results differ from the local model or between braid and gloo: "
                        + ", ".join(f"{r['impl']} {r['schedule']} P={r['ranks']} M={r['microbatches']}"
                                    for r in bad))


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=Shape.parse, nargs="+", default=DEFAULT_SHAPES,
                   help="models as VOCABxDIMxHEADSxHIDDENxLAYERSxBATCHxSEQ (default: "
                        + " ".join(map(str, DEFAULT_SHAPES)) + ")")
    p.add_argument("--microbatches", type=int, nargs="+", default=DEFAULT_MICROBATCHES,
                   help="microbatch counts M (default: " + " ".join(map(str, DEFAULT_MICROBATCHES)) + ")")
    p.add_argument("--schedules", default=None,
                   help="comma-separated schedule classes of torch.distributed.pipelining (default: "
                        + ",".join(SCHEDULE_STAGES) + ", those the installed torch has)")
    turns.add_run_arguments(p, IMPLS, warmup=2, steps=3, rounds=5, timeout=120.0, deadline=1800.0,
                            nproc_help="pipeline ranks P; default: a run with 2, then one with 4")
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace,
           ranks: Sequence[int]) -> tuple[str, ...]:
    """Checks the shapes and microbatch counts against the pipeline sizes; returns the schedules."""
    known = available_schedules()
    if args.schedules is None:
        schedules = tuple(known)
    else:
        schedules = tuple(dict.fromkeys(s.strip() for s in args.schedules.split(",") if s.strip()))
        unknown = [s for s in schedules if s not in known]
        if unknown or not schedules:
            parser.error(f"--schedules: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}")
    for m in args.microbatches:
        if m < 1:
            parser.error(f"--microbatches: {m} must be at least 1")
    for shape in args.shapes:
        if shape.dim % shape.heads:
            parser.error(f"--shapes {shape}: dim must divide by heads")
        for m in args.microbatches:
            if shape.batch % m:
                parser.error(f"--shapes {shape}: batch {shape.batch} does not divide into {m} microbatches")
        for p in ranks:
            if shape.layers < p * max(SCHEDULE_STAGES[s] for s in schedules):
                parser.error(f"--shapes {shape}: {shape.layers} layers cannot fill "
                             f"{p * max(SCHEDULE_STAGES[s] for s in schedules)} stages")
    return schedules


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the pipeline benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    run = turns.run_options(parser, args, IMPLS, started)
    if run.launcher == "torchrun":
        ranks: tuple[int, ...] = (run.world_size,)
    else:
        ranks = (args.nproc,) if args.nproc is not None else (2, 4)
    if min(ranks) < 2:
        parser.error("a pipeline needs at least 2 ranks (--nproc)")
    schedules = _check(parser, args, ranks)
    config = Config(run, tuple(args.shapes), tuple(args.microbatches), schedules, None)
    if run.launcher == "torchrun":
        return turns.start(_run_rank, config, run, "pipeline")
    records: list[dict] = []
    status = 0
    with tempfile.TemporaryDirectory(prefix="braid-bench-pipeline-") as tmp:
        for p in ranks:
            path = os.path.join(tmp, f"records{p}.json")
            sized = dataclasses.replace(run, world_size=p, bind=launch.resolve_bind(args.bind, p))
            sized_config = dataclasses.replace(config, run=sized, records_path=path)
            status = max(status, turns.start(_run_rank, sized_config, sized, "pipeline"))
            if not os.path.exists(path):
                return status or launch.EXIT_FAILED
            with open(path) as f:
                records += json.load(f)
    return max(status, _report(config, records))


if __name__ == "__main__":
    sys.exit(main())
