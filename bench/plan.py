"""python -m braid.bench plan: the planner's predictions against measured training steps.

A small GPT (bench.models.LanguageModel, float32, AdamW) is trained on 4 ranks spread over
simulated hosts (``--setups``: 2 hosts x 2 ranks and 4 x 1, on links shaped to 1 Gbit and
unshaped) with 13 layouts braid runs today: DDP with braid's hook (exact and int8), the ZeRO
wrapper at stages 1-3 (and stage 3 with int4 gradients, ZeRO++'s qgZ), TP x DP and TP 4
(sequence-parallel, the loss vocabulary-parallel), PP x DP and PP 4 (1F1B), CP x DP and CP 4 (ring
attention) and TP x PP; and its mixture-of-experts form (:data:`MOE`) with 3 more: every expert
on every rank under DDP, and braid's expert parallelism EP 2 and EP 4 inside 4-way data
parallelism. Each rank runs under a CPU quota (:class:`CpuShares`) so that it behaves as a device
of its own.
Per setup the ranks first measure what the planner needs, every rank at once: the links
(``braid.plan.measure.measure_links``, the same probe as ``python -m braid.plan --measure``), the
FLOP/s of each model's forward and backward, and torch AdamW's time per parameter. The planner then
predicts each layout's step time and peak memory on a cluster with those figures
(``braid.plan.evaluate``); the table puts them beside the measured ones, with Kendall's rank
correlation over all layouts, whether the planner's first choice for each model is within 10% of
that model's measured best, and the memory ratios.

Each layout is built fresh in each round (rounds rotate the order), runs warm-up steps, then timed
steps between barriers (the slowest rank's time, median over rounds); its peak memory is read in
one more, untimed step under :class:`PeakMemory` (the storage of every tensor an operator touches:
parameters, gradients, optimizer state, activations and temporaries, and a compressor's
error-feedback residuals; what else braid's C++ core holds out of the operators' sight is not in
it). Every layout's first loss over the whole batch is
printed: a model's layouts start from the same weights and batch, and the first loss comes before
any update, so they agree to rounding.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import launch, report
from .models import BLOCK_SEQUENCE_PLAN, LanguageModel, lm_plan

STORE_PORT = 29731
# The model and batch (one optimizer step); small enough for 4 ranks on 2 cores, large enough that
# the gradient exchange at 1 Gbit costs about as much as the compute.
MODEL = {"vocab": 2048, "dim": 256, "heads": 8, "hidden": 1024, "layers": 4}
# The same GPT with every MLP a mixture of experts (braid.comm.moe: 4 experts of width 512, top 2,
# dropless): a token's expert FLOPs equal the dense MLP's, the expert weights are twice its.
MOE = {"experts": 4, "top_k": 2, "expert_hidden": 512}
SEQ, BATCH = 128, 16
BUCKET_MB = 4  # DDP's and the ZeRO wrapper's bucket; the planner's bucket_bytes


@dataclass(frozen=True)
class Layout:
    """One way to train a model on 4 ranks: degrees (mesh pp, dp, cp, tp, tp fastest, as the
    planner numbers ranks; ep the inner factor of dp), ZeRO stage, micro-batches and gradient
    compression; ``moe``: the mixture-of-experts model (:data:`MOE`) instead of the dense one."""

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batches: int = 1
    compression: str = "none"
    moe: bool = False
    what: str = ""

    @property
    def dpe(self) -> int:
        """Data-parallel replicas of one expert-parallel group: dp / ep."""
        return self.dp // self.ep

    @property
    def model(self) -> str:
        return "moe" if self.moe else "dense"

    def candidate(self):
        from braid.plan import Candidate

        return Candidate(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, zero=self.zero,
                         micro_batches=self.micro_batches, compression=self.compression)


LAYOUTS = (
    Layout("ddp", dp=4, what="torch DDP, braid hook, exact"),
    Layout("ddp-int8", dp=4, compression="int8", what="torch DDP, braid hook, int8 + error feedback"),
    Layout("zero1", dp=4, zero=1, what="braid.comm.zero.shard(stage=1)"),
    Layout("zero2", dp=4, zero=2, what="braid.comm.zero.shard(stage=2)"),
    Layout("zero3", dp=4, zero=3, what="braid.comm.zero.shard(stage=3)"),
    Layout("zero3-int4", dp=4, zero=3, compression="int4", what="stage 3, int4 gradients (qgZ)"),
    Layout("tp2-dp2", dp=2, tp=2, what="braid.comm.tp.parallelize x DDP"),
    Layout("tp4", tp=4, what="braid.comm.tp.parallelize"),
    Layout("pp2-dp2", dp=2, pp=2, micro_batches=4, what="pipelining 1F1B x DDP"),
    Layout("pp4", pp=4, micro_batches=4, what="pipelining 1F1B"),
    Layout("cp2-dp2", dp=2, cp=2, what="braid.comm.cp ring attention x DDP"),
    Layout("cp4", cp=4, what="braid.comm.cp ring attention"),
    Layout("tp2-pp2", tp=2, pp=2, micro_batches=4, what="tp.parallelize x pipelining 1F1B"),
    Layout("moe-dp4", dp=4, moe=True, what="MoE model, every expert on every rank, torch DDP, braid hook"),
    Layout("moe-ep2-dp4", dp=4, ep=2, moe=True,
           what="MoE model, braid.comm.moe EP 2 x DP: DDP without the experts, moe.reduce_gradients"),
    Layout("moe-ep4-dp4", dp=4, ep=4, moe=True,
           what="MoE model, braid.comm.moe EP 4 x DP: DDP without the experts"),
)
LAYOUT_NAMES = tuple(x.name for x in LAYOUTS)
_BY_NAME = {x.name: x for x in LAYOUTS}


def parse_setups(text: str) -> list[tuple[int, int, int]]:
    """``HxL:MBIT,...`` (MBIT 0: unshaped) -> [(hosts, ranks per host, mbit)]; 4 ranks in all."""
    out = []
    for item in (t for t in text.split(",") if t):
        try:
            shape, _, mbit = item.partition(":")
            h, _, local = shape.partition("x")
            setup = (int(h), int(local), int(mbit or 0))
        except ValueError:
            raise argparse.ArgumentTypeError(f"setup {item!r} is not HOSTSxRANKS:MBIT (2x2:1000)") from None
        if setup[0] < 1 or setup[1] < 1 or setup[2] < 0 or setup[0] * setup[1] != 4:
            raise argparse.ArgumentTypeError(f"setup {item!r}: hosts x ranks must be 4 and MBIT >= 0")
        out.append(setup)
    if not out:
        raise argparse.ArgumentTypeError("no setup given")
    return out


def parse_layouts(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    bad = [n for n in names if n not in LAYOUT_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown layout(s) {bad}; choose from {', '.join(LAYOUT_NAMES)}")
    return names


# -- the ranks -------------------------------------------------------------------------------------
MESH = ("pp", "dpe", "ep", "cp", "tp")  # slowest to fastest; dp is dpe x ep


def _coords(rank: int, x: Layout) -> dict:
    dp = (rank // (x.tp * x.cp)) % x.dp
    return {"pp": rank // (x.tp * x.cp * x.dp), "dp": dp, "dpe": dp // x.ep, "ep": dp % x.ep,
            "cp": (rank // x.tp) % x.cp, "tp": rank % x.tp}


def group_members(x: Layout, dims: tuple[str, ...], world: int) -> list[tuple[int, ...]]:
    """The groups along mesh dimensions ``dims`` of layout ``x`` (of pp, dp, cp, tp, ep and dpe,
    dp being dpe x ep): ranks that differ only there."""
    along = {e for d in dims for e in (("dpe", "ep") if d == "dp" else (d,))}
    groups: dict = {}
    for r in range(world):
        c = _coords(r, x)
        groups.setdefault(tuple(c[d] for d in MESH if d not in along), []).append(r)
    return [tuple(g) for g in groups.values()]


class Groups:
    """The braid process groups of every mesh dimension (and dp x cp, the gradient replicas), made
    once per layout shape by every rank in the same order (new_group is collective)."""

    def __init__(self, world: int, timeout: float):
        self.world, self.timeout = world, timeout
        self._made: dict = {}

    def of(self, rank: int, x: Layout, dims: tuple[str, ...]) -> dist.ProcessGroup | None:
        """This rank's group along ``dims``; None where it would hold this rank alone."""
        if all(getattr(x, d) == 1 for d in dims):
            return None
        mine = None
        for members in group_members(x, dims, self.world):
            # a group per dimension even where two have the same ranks (cp4's ring and its
            # gradient replicas): their calls come from different threads (the ring from the
            # backward, DDP's from braid's issue thread), and one group's calls must be issued in
            # one order on every rank
            key = (members, dims)
            if key not in self._made:
                self._made[key] = dist.new_group(list(members), backend="braid",
                                                 timeout=timedelta(seconds=self.timeout))
            if rank in members:
                mine = self._made[key]
        return mine

    def alone(self, rank: int) -> dist.ProcessGroup:
        """A group of this rank alone (an expert-parallel group of one)."""
        if "alone" not in self._made:
            timeout = timedelta(seconds=self.timeout)
            self._made["alone"] = {r: dist.new_group([r], backend="braid", timeout=timeout)
                                   for r in range(self.world)}
        return self._made["alone"][rank]


def _model() -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(MODEL["vocab"], MODEL["dim"], MODEL["heads"], MODEL["hidden"], MODEL["layers"])


class MoEMLP(torch.nn.Module):
    """A block's MLP as a braid MoE layer (its routing losses left out: coefficients 0)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.moe = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def _moe_model(group) -> LanguageModel:
    """:func:`_model`'s GPT with every block's MLP a mixture of experts (:data:`MOE`) split over
    ``group`` (expert parallelism; a group of one holds every expert). Every rank draws the same
    weights, all experts included, and keeps its share: every layout trains the same model."""
    from braid.comm import moe

    model = _model()
    dim, experts = MODEL["dim"], MOE["experts"]
    for block in model.blocks:
        router = torch.nn.Linear(dim, experts, bias=False)
        dense = [moe.ExpertMLP(dim, MOE["expert_hidden"]) for _ in range(experts)]
        block.mlp = MoEMLP(moe.MoE.from_dense(router, dense, group, top_k=MOE["top_k"]))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MODEL["vocab"], (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _tp_plan(plan: dict, head: str) -> dict:
    """``plan`` with the output head column-parallel and its logits left split by vocabulary
    (the loss is vocab_parallel_cross_entropy): no rank holds all the logits, as the planner
    assumes."""
    return {**plan, head: "colwise"}


def _ddp(module: torch.nn.Module, group, compressor):
    """torch DDP over ``group`` with braid's hook (``compressor``: None for the exact exchange)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from braid.comm import ddp

    net = DDP(module, process_group=group, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)
    state, hook = ddp.comm_hook(group, compressor)
    net.register_comm_hook(state, hook)
    return net


def _stage_plan(stage) -> dict:
    """The tensor-parallel plan of a pipeline stage (bench.pipeline.Stage: the model's modules
    numbered in order), as lm_plan gives the whole model's (sequence-parallel)."""
    whole = _tp_plan(lm_plan(True), "head")
    plan: dict = {}
    for k, source in enumerate(stage.sources):
        if source.startswith("blocks."):
            plan.update({f"{k}.{name}": style for name, style in BLOCK_SEQUENCE_PLAN.items()})
        elif source in whole:
            plan[str(k)] = whole[source]
    return plan


class PeakMemory(TorchDispatchMode):
    """The most bytes of CPU tensor storage alive at once inside the block: ``roots`` (parameters,
    gradients, optimizer state) and every storage an operator reads or writes there, each counted
    from the moment it is first seen until it is freed (a weak reference) or resized
    (``UntypedStorage.resize_``, which ZeRO-3 uses to free gathered parameters). Storages braid's C++
    core or torch's collectives hold without passing them to an operator are not seen."""

    def __init__(self, roots: Sequence[torch.Tensor]):
        super().__init__()
        self._bytes: dict = {}
        self._refs: dict = {}
        self.current = self.peak = 0
        for t in roots:
            self._track(t)

    def _count(self, key, nbytes: int) -> None:
        self.current += nbytes - self._bytes.get(key, 0)
        self._bytes[key] = nbytes
        self.peak = max(self.peak, self.current)

    def _gone(self, key, _ref) -> None:
        self.current -= self._bytes.pop(key, 0)
        self._refs.pop(key, None)

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._bytes:
            self._refs[key] = weakref.ref(st, functools.partial(self._gone, key))
            self._count(key, st.nbytes())

    def __enter__(self):
        resize, tracker = torch.UntypedStorage.resize_, self

        def tracked_resize(st, size):
            out = resize(st, size)
            if st._cdata in tracker._bytes:
                tracker._count(st._cdata, st.nbytes())
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pytree.tree_map_only(torch.Tensor, self._track, (args, kwargs))
        out = func(*args, **kwargs)
        pytree.tree_map_only(torch.Tensor, self._track, out)
        return out


class Trainer:
    """One layout's model, optimizer and step on this rank; ``step()`` trains one batch and returns
    the loss where this rank computes it (else None)."""

    def __init__(self, x: Layout, rank: int, groups: Groups):
        from braid.comm import cp, moe, tp, zero
        from braid import comm

        model = _moe_model(groups.of(rank, x, ("ep",)) or groups.alone(rank)) if x.moe else _model()
        self.x, self.rank = x, rank
        co = _coords(rank, x)
        ids, target = _batch()
        per_dp = BATCH // x.dp
        ids, target = (t[co["dp"] * per_dp:(co["dp"] + 1) * per_dp] for t in (ids, target))
        # tensor parallelism sequence-parallel (Megatron's split), as the planner models it: what
        # the heads do not split (norms, residuals) is split along the sequence
        if x.tp > 1 and x.pp == 1:
            tp.parallelize(model, groups.of(rank, x, ("tp",)), _tp_plan(lm_plan(True), "head"),
                           sequence_parallel=True)
        if x.cp > 1:
            g_cp = groups.of(rank, x, ("cp",))
            cp.parallelize(model, g_cp, ["blocks.*.attn"])
            ids, target = (cp.shard(t, g_cp, balanced=True, dim=1) for t in (ids, target))
        self.ids, self.target = ids, target
        self.loss_fn = _loss
        if x.tp > 1:
            g_tp = groups.of(rank, x, ("tp",))
            self.loss_fn = functools.partial(tp.vocab_parallel_cross_entropy, group=g_tp)
        replicas = groups.of(rank, x, ("dp", "cp"))
        q = {"none": None, "int8": comm.Int8Quantizer, "int4": comm.Int4Quantizer}[x.compression]
        self.compressor = None if q is None else q()  # its error-feedback residuals count in the peak
        self.pipe = None
        self.experts_apart = None  # the group reducing the experts' gradients apart from DDP's
        if x.moe and x.ep > 1:
            if x.pp > 1 or x.zero or x.tp > 1 or x.compression != "none":
                raise ValueError(f"layout {x.name}: expert parallelism is benchmarked with DDP alone")
            # DDP for the dense weights; the experts (different on the ranks of an EP group) are
            # reduced over their replicas after the backward, as the planner's snippet does
            ids_of_experts = {id(p) for p in moe.expert_parameters(model)}
            from torch.nn.parallel import DistributedDataParallel as DDP

            DDP._set_params_and_buffers_to_ignore_for_model(
                model, [n for n, p in model.named_parameters() if id(p) in ids_of_experts])
            # (a replica group of one still divides by the world: an expert's gradient sums the
            # losses of its whole EP group)
            self.experts_apart = (replicas, groups.of(rank, x, ("dpe", "cp", "tp")) or groups.alone(rank))
        if x.pp > 1:
            from torch.distributed import pipelining

            from .pipeline import Stage

            stage = Stage(model, co["pp"], x.pp)
            if x.tp > 1:
                tp.parallelize(stage, groups.of(rank, x, ("tp",)), _stage_plan(stage), sequence_parallel=True)
            self.params_of = stage
            net = _ddp(stage, replicas, self.compressor) if replicas is not None else stage
            self.pipe = pipelining.Schedule1F1B(
                pipelining.PipelineStage(net, co["pp"], x.pp, torch.device("cpu"),
                                         group=groups.of(rank, x, ("pp",))),
                n_microbatches=x.micro_batches, loss_fn=self.loss_fn)
            self.first, self.last = co["pp"] == 0, co["pp"] == x.pp - 1
            self.net = net
        elif x.zero:
            self.net = zero.shard(model, replicas, stage=x.zero, bucket_cap_mb=BUCKET_MB,
                                  grad_compression=self.compressor)
            self.params_of = self.net
        elif replicas is not None:
            self.net = _ddp(model, replicas, self.compressor)
            self.params_of = model
        else:
            self.net = self.params_of = model
        self.opt = torch.optim.AdamW(self.params_of.parameters(), lr=1e-4)

    def step(self) -> float | None:
        self.opt.zero_grad(set_to_none=True)
        loss = None
        if self.pipe is not None:
            losses: list = []
            if self.first:
                self.pipe.step(self.ids)
            elif self.last:
                self.pipe.step(target=self.target, losses=losses, return_outputs=False)
            else:
                self.pipe.step()
            if self.last:
                loss = float(torch.stack(losses).mean().detach())
        else:
            out = self.loss_fn(self.net(self.ids), self.target)
            out.backward()
            loss = float(out.detach())
        if self.experts_apart is not None:
            from braid.comm import moe

            moe.reduce_gradients(self.params_of, *self.experts_apart, dense=False)
        self.opt.step()
        return loss

    def peak_bytes(self) -> int:
        """Peak bytes of tensor storage during one step (:class:`PeakMemory`)."""
        roots = [*self.params_of.parameters(), *self.params_of.buffers()]
        roots += [p.grad for p in roots if p.grad is not None]
        roots += [v for st in self.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        # the compressor's error-feedback residuals, which braid's codecs update in C++ (no operator
        # the tracker sees touches them)
        if self.compressor is not None:
            roots += self.compressor.residuals()
        # braid's ZeRO wrapper: its flat buffers, ZeRO-1's persistent full gradient among them (the
        # backward writes into it only after the step's peak, as the loss's backward starts)
        schedule = getattr(self.net, "_schedule", None)
        if schedule is not None:
            for bucket in schedule.buckets():
                roots += [t for t in (bucket.full, getattr(bucket.full, "grad", None)) if t is not None]
        with PeakMemory(roots) as tracker:
            self.step()
        return tracker.peak


def _compute_rate(dp: int, warmup: int, steps: int, alone=None) -> float:
    """FLOP/s of one rank's forward + backward of the whole model on the batch share of ``dp``-way
    data parallelism, every rank computing at once (the ranks share the machine's cores); with
    ``alone`` (a group of this rank alone), of the MoE model holding every expert."""
    model = _model() if alone is None else _moe_model(alone)
    ids, target = (t[: BATCH // dp] for t in _batch())
    shape = _shape(model, moe=alone is not None)
    flops = 3 * (shape.layers * shape.layer_forward_flops() + shape.head_forward_flops()) * (BATCH // dp)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        _loss(model(ids), target).backward()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return flops / statistics.median(times)


def _optimizer_rate(warmup: int, steps: int) -> float:
    """Seconds of torch's AdamW step per parameter on this rank, every rank stepping at once."""
    model = _model()
    params = list(model.parameters())
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / sum(p.numel() for p in params)


def _overlap(group) -> dict:
    """How much of the backward the whole gradient's all-reduce hides behind on these ranks
    (``braid.plan.measure.measure_overlap``): DDP's exchange, 4 MiB buckets, beside the backward
    of one rank's share of the batch under 4-way data parallelism."""
    from braid.plan.measure import measure_overlap

    model = _model()
    ids, target = (t[: BATCH // 4] for t in _batch())
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    return measure_overlap(group, lambda loss: loss.backward(), nbytes, bucket_bytes=BUCKET_MB << 20,
                           prepare=lambda: _loss(model(ids), target))


def _shape(model: torch.nn.Module | None = None, moe: bool = False):
    """The planner's description of the dense GPT or (``moe``) its MoE form; ``model``, when given,
    supplies the parameter count (the MoE model's whole: holding every expert)."""
    from braid.plan import TransformerShape

    params = None if model is None else sum(p.numel() for p in model.parameters())
    experts = {"experts": MOE["experts"], "top_k": MOE["top_k"], "ffn": MOE["expert_hidden"]} if moe else {
        "ffn": MODEL["hidden"]}
    return TransformerShape(layers=MODEL["layers"], hidden=MODEL["dim"], heads=MODEL["heads"],
                            vocab=MODEL["vocab"], seq=SEQ, batch=BATCH, dtype="fp32",
                            optimizer="adam", gated=False, flash_attention=True, params=params,
                            name="bench GPT (MoE)" if moe else "bench GPT", **experts)


def _global_loss(loss: float | None, x: Layout, rank: int) -> float:
    """The whole batch's mean loss from each rank's (the last pipeline stage's ranks hold one, the
    same on every rank of a TP group; the dp x cp replicas each hold the mean of an equal share)."""
    mine = loss / (x.dp * x.cp) if loss is not None and _coords(rank, x)["tp"] == 0 else 0.0
    t = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rank_main(settings: dict) -> int:
    """One rank of one setup: measure the links and compute, then every layout in rounds."""
    from braid.plan.measure import measure_links

    import braid.comm  # noqa: F401  (registers the backend)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    launch.start_rank(rank, world, None, bind="none", threads=1, timeout_s=settings["timeout"])
    try:
        groups = Groups(world, settings["timeout"])
        whole = dist.new_group(backend="braid", timeout=timedelta(seconds=settings["timeout"]))
        links = measure_links(whole)
        layouts = [x for x in LAYOUTS if x.name in settings["layouts"]]
        # the slowest rank's rate sets the pace; the MoE model's measured apart (its routing and
        # its experts' small matrices run at a rate of their own)
        rate = -_max([-_compute_rate(LAYOUTS[0].dp, 1, 3)])[0]
        rate_moe = None
        if any(x.moe for x in layouts):
            rate_moe = -_max([-_compute_rate(LAYOUTS[0].dp, 1, 3, alone=groups.alone(rank))])[0]
        optimizer = _max([_optimizer_rate(1, 3)])[0]
        overlap = _overlap(whole)
        times: dict = {x.name: [] for x in layouts}
        memory: dict = {}
        losses: dict = {}
        progress = report.Progress(settings["rounds"] * len(layouts), enabled=rank == 0)
        for round_index in range(settings["rounds"]):
            turn = round_index % len(layouts)
            for x in layouts[turn:] + layouts[:turn]:
                progress(x.name, "step", 0)
                trainer = Trainer(x, rank, groups)
                for i in range(settings["warmup"]):
                    loss = trainer.step()
                    if i == 0 and x.name not in losses:
                        losses[x.name] = _global_loss(loss, x, rank)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(settings["steps"]):
                    trainer.step()
                times[x.name].append((time.perf_counter() - t0) / settings["steps"])
                if x.name not in memory:
                    memory[x.name] = trainer.peak_bytes()
                dist.barrier()
                del trainer
                gc.collect()
        progress.close()
        names = [x.name for x in layouts]
        rounds = {n: _max(times[n]) for n in names}  # per round, the slowest rank's
        step = {n: statistics.median(rounds[n]) for n in names}
        peak = dict(zip(names, _max([float(memory[n]) for n in names])))
        # every rank's peak too: which pipeline stage (or shard) holds the largest
        mine = torch.tensor([float(memory[n]) for n in names], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        peak_by_rank = {n: [float(t[i]) for t in every] for i, n in enumerate(names)}
        launch.end_gloo_use()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(settings["out"], "w") as f:
            json.dump({"links": dataclasses.asdict(links), "rate": rate, "rate_moe": rate_moe,
                       "optimizer_s_per_param": optimizer, "overlap": overlap,
                       "step": step, "step_rounds": rounds, "peak": peak, "peak_by_rank": peak_by_rank,
                       "loss": losses}, f)
    return 0


# -- the launcher ----------------------------------------------------------------------------------
class CpuShares:
    """A fixed share of CPU time per rank (a cgroup per rank with a CFS quota), so that each rank
    behaves as a device of its own: on a machine with fewer cores than ranks, a rank that waits (a
    pipeline bubble, a collective) would otherwise lend its core to the others, which no
    accelerator does. ``reason`` says why there are none (no writable cgroup cpu controller)."""

    V1 = "/sys/fs/cgroup/cpu"
    V2 = "/sys/fs/cgroup"
    PERIOD_US = 10_000  # short, so that a throttled rank waits at most a few milliseconds

    def __init__(self, count: int, cores_each: float):
        self.dirs: list[str] = []
        self.reason: str | None = None
        v2 = os.path.exists(os.path.join(self.V2, "cgroup.controllers"))
        root = self.V2 if v2 else self.V1
        quota = max(1000, int(cores_each * self.PERIOD_US))
        try:
            for i in range(count):
                path = os.path.join(root, f"braid-bench-plan-{os.getpid()}-{i}")
                os.mkdir(path)
                self.dirs.append(path)
                if v2:
                    self._write(path, "cpu.max", f"{quota} {self.PERIOD_US}")
                else:
                    self._write(path, "cpu.cfs_period_us", str(self.PERIOD_US))
                    self._write(path, "cpu.cfs_quota_us", str(quota))
        except OSError as e:
            self.close()
            self.reason = f"no cgroup CPU quota here ({e.strerror}: {e.filename})"

    @staticmethod
    def _write(path: str, name: str, value: str) -> None:
        with open(os.path.join(path, name), "w") as f:
            f.write(value)

    def add(self, index: int, pid: int) -> None:
        """Moves process ``pid`` (all its threads, and what it starts later) into share ``index``."""
        if self.dirs:
            self._write(self.dirs[index], "cgroup.procs", str(pid))

    def close(self) -> None:
        for path in self.dirs:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        self.dirs = []


def run_setup(hosts: int, per_host: int, mbit: int, args: argparse.Namespace) -> dict:
    """The ranks of one setup on simulated hosts, started as torchrun would; rank 0's figures."""
    from .simhosts import SimulatedHosts

    world = hosts * per_host
    with tempfile.TemporaryDirectory(prefix="braid-bench-plan-") as tmp, \
            SimulatedHosts(hosts, rate_mbit=mbit or None) as sim:
        out = os.path.join(tmp, "rank0.json")
        settings = {"layouts": args.layouts, "rounds": args.rounds, "warmup": args.warmup,
                    "steps": args.steps, "timeout": args.timeout, "out": out}
        shares = CpuShares(world, args.rank_cores) if args.rank_cores > 0 else None
        procs = []
        for rank in range(world):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_host),
                   "LOCAL_WORLD_SIZE": str(per_host), "MASTER_ADDR": sim.addresses[0],
                   "MASTER_PORT": str(STORE_PORT), "OMP_NUM_THREADS": "1"}
            argv = [sys.executable, "-m", "braid.bench.plan", "--rank-main", json.dumps(settings)]
            # rank 0's progress goes to our terminal; every rank's output also to a log read on failure
            with open(os.path.join(tmp, f"rank{rank}.log"), "w") as log:
                procs.append(sim.popen(rank // per_host, argv, env=env, stdout=log,
                                       stderr=None if rank == 0 else subprocess.STDOUT))
            if shares is not None:
                shares.add(rank, procs[-1].pid)
        if shares is not None and shares.reason:
            print(f"ranks not held to {args.rank_cores:g} core each: {shares.reason}", flush=True)
        deadline = time.monotonic() + args.deadline
        failed = []
        try:
            for rank, p in enumerate(procs):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                        q.wait()
                    raise RuntimeError(f"plan: rank {rank} did not finish within {args.deadline} s") from None
                if p.returncode != 0:
                    with open(os.path.join(tmp, f"rank{rank}.log")) as log:
                        failed.append(f"rank {rank} exited {p.returncode}:\n{log.read()[-3000:]}")
        finally:
            if shares is not None:
                shares.close()
        if failed:
            raise RuntimeError("plan: " + "\n".join(failed))
        with open(out) as f:
            measured = json.load(f)
        measured["rank_cores"] = args.rank_cores if shares is not None and not shares.reason else None
        return measured


def predict(measured: dict, hosts: int, per_host: int, overlap: float | None = None) -> tuple:
    """(cluster, assumptions, {layout: planner Layout}) for one setup's measured links, rates and
    overlap (``overlap``: this figure instead of the measured one)."""
    from braid.plan import Assumptions, Cluster, evaluate

    links = measured["links"]
    lat = {lvl: links[f"{lvl}_latency"] for lvl in ("intra", "inter") if links.get(f"{lvl}_latency")}
    bw = {lvl: links[f"{lvl}_bandwidth"] for lvl in ("intra", "inter") if links.get(f"{lvl}_bandwidth")}
    # a level no pair of ranks crosses takes the other's figures (no group spans it)
    for a, b in (("intra", "inter"), ("inter", "intra")):
        lat.setdefault(a, lat.get(b))
        bw.setdefault(a, bw.get(b))
    memory_per_rank = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (hosts * per_host)

    def cluster_at(rate: float) -> "Cluster":
        return Cluster(hosts=hosts, devices_per_host=per_host, device_memory=memory_per_rank, peak_flops=rate,
                       fp32_peak_flops=rate, intra_bandwidth=bw["intra"], inter_bandwidth=bw["inter"],
                       intra_latency=lat["intra"], inter_latency=lat["inter"],
                       name=f"{hosts}x{per_host} measured")

    # each model's measured rate is what the ranks sustain on it: full efficiency, no small-batch knee
    clusters = {"dense": cluster_at(measured["rate"])}
    if measured.get("rate_moe"):
        clusters["moe"] = cluster_at(measured["rate_moe"])
    overlap = measured["overlap"]["overlap"] if overlap is None else overlap
    assumptions = Assumptions(efficiency=1.0, half_efficiency_tokens=0, bucket_bytes=BUCKET_MB << 20,
                              optimizer_seconds_per_param=measured["optimizer_s_per_param"], overlap=overlap)
    dense = _model()
    models = {"dense": _shape(dense), "moe": _shape(moe=True)}
    models["moe"] = dataclasses.replace(models["moe"], params=moe_parameters(dense))
    return clusters["dense"], assumptions, {
        n: evaluate(models[_BY_NAME[n].model], clusters[_BY_NAME[n].model], _BY_NAME[n].candidate(),
                    assumptions=dataclasses.replace(assumptions, loss_logits=_loss_logits(_BY_NAME[n])))
        for n in measured["step"]}


def _loss_logits(x: Layout) -> int:
    """The float32 logits-sized tensors the layout's loss holds as its backward starts (the
    planner's ``loss_logits``): F.cross_entropy's log-softmax, its gradient and the logits'
    gradient; tp.vocab_parallel_cross_entropy's kept exponentials and their gradient."""
    return 2 if x.tp > 1 else 3


def moe_parameters(dense: LanguageModel) -> int:
    """Parameters of the whole MoE model (every expert) from the dense one's: each block's MLP
    traded for a router and :data:`MOE`'s experts."""
    dim, hid, experts = MODEL["dim"], MOE["expert_hidden"], MOE["experts"]
    mlp = sum(p.numel() for p in dense.blocks[0].mlp.parameters())
    expert = dim * hid + hid + hid * dim + dim
    per_block = dim * experts + experts * expert - mlp
    return sum(p.numel() for p in dense.parameters()) + MODEL["layers"] * per_block


def kendall_tau(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Kendall's tau-b of two equally long sequences (ties in either count as neither)."""
    n = len(xs)
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denom if denom else 0.0


def compare(measured: dict, predicted: dict, model_of: dict | None = None) -> dict:
    """The validation's figures for one setup: Kendall's tau over every layout (both models: the
    planner predicts across them too), per model (``model_of``: layout -> model; default one
    model) the planner's first choice, the measured best and the first's measured time over the
    best's, and the memory ratios."""
    names = list(measured["step"])
    model_of = model_of or dict.fromkeys(names, "dense")
    pred = [predicted[n].step for n in names]
    meas = [measured["step"][n] for n in names]
    choices = {}
    for model in dict.fromkeys(model_of[n] for n in names):
        mine = [n for n in names if model_of[n] == model]
        first = min(mine, key=lambda n: predicted[n].step)
        best = min(mine, key=lambda n: measured["step"][n])
        choices[model] = {"first_choice": first, "measured_best": best,
                          "first_over_best": measured["step"][first] / measured["step"][best]}
    mem = {n: predicted[n].memory.total / measured["peak"][n] for n in names if measured["peak"].get(n)}
    # how well the measurement agrees with itself: tau between every two rounds' measured times
    # (each round builds every layout anew), the ceiling no prediction can be held above
    rounds = measured.get("step_rounds") or {}
    count = min((len(rounds.get(n, ())) for n in names), default=0)
    between = [kendall_tau([rounds[n][i] for n in names], [rounds[n][j] for n in names])
               for i in range(count) for j in range(i + 1, count)]
    return {"kendall_tau": kendall_tau(pred, meas), "rounds_tau": between, "choices": choices,
            "memory_ratio": mem, "memory_within_15": sum(abs(r - 1) <= 0.15 for r in mem.values())}


def setup_name(hosts: int, per_host: int, mbit: int) -> str:
    link = "unshaped" if mbit == 0 else f"{mbit / 1000:g} Gbit" if mbit >= 1000 else f"{mbit} Mbit"
    return f"{hosts}x{per_host} {link}"


def table(record: dict) -> str:
    m, p, c = record["measured"], record["predicted"], record["comparison"]
    lines = [f"{'layout':<11} {'planner':<28} {'pred ms':>8} {'meas ms':>8} {'p/m':>5} "
             f"{'pred MiB':>8} {'meas MiB':>8} {'p/m':>5} {'1st loss':>8}"]
    for n in m["step"]:
        ps, ms = p[n]["step_s"], m["step"][n]
        pm, mm = p[n]["memory_bytes"], m["peak"].get(n)
        lines.append(f"{n:<11} {p[n]['label']:<28} {ps * 1e3:8.1f} {ms * 1e3:8.1f} {ps / ms:5.2f} "
                     f"{pm / 2**20:8.1f} {mm / 2**20 if mm else float('nan'):8.1f} "
                     f"{pm / mm if mm else float('nan'):5.2f} {m['loss'][n]:8.4f}")
    lines.append(f"Kendall tau {c['kendall_tau']:.2f} over the {len(m['step'])} layouts (target >= 0.7); "
                 f"memory within 15%: {c['memory_within_15']} of {len(c['memory_ratio'])}")
    if c.get("rounds_tau"):
        lines.append("the measurement against itself: Kendall tau between rounds "
                     + ", ".join(f"{t:.2f}" for t in c["rounds_tau"]))
    for model, ch in c["choices"].items():
        lines.append(f"{model} model: the planner's first choice {ch['first_choice']} runs at "
                     f"{ch['first_over_best']:.2f}x the measured best ({ch['measured_best']}; "
                     "target <= 1.10)")
    return "\n".join(lines)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"--overlap must be a number from 0 to 1, got {text!r}")
    return value


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", type=parse_setups, default=parse_setups("2x2:1000,4x1:1000,2x2:0,4x1:0"),
                   help="HOSTSxRANKS:MBIT,... (4 ranks in all; MBIT 0: unshaped; "
                        "default 2x2:1000,4x1:1000,2x2:0,4x1:0)")
    p.add_argument("--layouts", type=parse_layouts, default=list(LAYOUT_NAMES),
                   help=f"layouts to train (default all: {','.join(LAYOUT_NAMES)})")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each layout once per round (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per layout and round (default 2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout and round (default 3)")
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--rank-cores", type=float, default=cores / 4,
                   help=f"CPU time each rank may use, in cores (a cgroup quota; default this machine's "
                        f"{cores} cores / 4 ranks; 0: no limit)")
    p.add_argument("--overlap", type=_fraction, default=None,
                   help="the planner's overlap (0-1) instead of the one measured on the ranks")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of one collective (s)")
    p.add_argument("--deadline", type=float, default=1800.0, help="deadline of one setup (s)")
    p.add_argument("--json", type=report.output_path(".json"), help="write the records to this path")
    p.add_argument("--rank-main", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = _parser(prog).parse_args(argv)
    if args.rank_main:
        return launch.run_rank_reporting(lambda *_: rank_main(json.loads(args.rank_main)),
                                         int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None)
    for name in ("rounds", "warmup", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    from .simhosts import unavailable_reason

    reason = unavailable_reason(rate=any(mbit for _, _, mbit in args.setups))
    if reason is not None:
        # as multihost: a machine that cannot make them (not root) runs the rest of `make bench`
        print(f"braid.bench plan: simulated hosts cannot be made here ({reason}); nothing measured")
        return 0
    print(f"# braid.bench plan: {MODEL} seq {SEQ} batch {BATCH}, float32 AdamW, 4 ranks; "
          f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed steps) per layout", flush=True)
    records = []
    for hosts, per_host, mbit in args.setups:
        name = setup_name(hosts, per_host, mbit)
        print(f"\n## {name}", flush=True)
        measured = run_setup(hosts, per_host, mbit, args)
        cluster, assumptions, predicted = predict(measured, hosts, per_host, args.overlap)
        record = {
            "setup": name, "hosts": hosts, "per_host": per_host, "link_mbit": mbit, "measured": measured,
            "cluster": cluster.to_dict(), "assumptions": assumptions.to_dict(),
            "predicted": {n: {"label": lay.candidate.label(), "step_s": lay.time.step,
                              "memory_bytes": lay.memory.total, "time": lay.time.to_dict(),
                              "memory": lay.memory.to_dict()} for n, lay in predicted.items()},
            "comparison": compare(measured, predicted, {n: x.model for n, x in _BY_NAME.items()}),
        }
        links, ov = measured["links"], measured["overlap"]
        print(f"links: in a host {_link(links, 'intra')}; between hosts {_link(links, 'inter')}")
        moe_rate = f" (MoE model {measured['rate_moe'] / 1e9:.2f})" if measured.get("rate_moe") else ""
        print(f"compute {measured['rate'] / 1e9:.2f} GFLOP/s per rank{moe_rate}, AdamW "
              f"{measured['optimizer_s_per_param'] * 1e9:.2f} ns per parameter (all ranks at once)")
        if args.overlap is not None:
            print(f"overlap {assumptions.overlap:.2f} (given)")
        else:
            print(f"overlap {assumptions.overlap:.2f}{' or more' if ov['bound'] else ''} (measured: backward "
                  f"{ov['compute_s'] * 1e3:.0f} ms, gradient all-reduce {ov['comm_s'] * 1e3:.0f} ms, "
                  f"both at once {ov['both_s'] * 1e3:.0f} ms)")
        print(table(record), flush=True)
        records.append(record)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "plan", "machine": report.machine_info(), "model": MODEL, "moe": MOE,
                       "seq": SEQ, "batch": BATCH, "records": records}, f, indent=1)
    return 0


def _link(links: dict, level: str) -> str:
    bw, lat = links.get(f"{level}_bandwidth"), links.get(f"{level}_latency")
    return "not crossed" if bw is None else f"{bw / 1e9:.3g} GB/s, {lat * 1e6:.0f} us"


if __name__ == "__main__":
    sys.exit(main())
