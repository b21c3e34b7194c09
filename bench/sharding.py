"""Sharded data-parallel benchmark: a ~25M-parameter transformer LM's training step on CPU, FSDP2 vs braid.

    python -m braid.bench sharding                      # 2 ranks, the default model
    python -m braid.bench sharding --impls fsdp2-gloo,braid-zero3 --json results/sharding.json
    python -m braid.bench sharding --carrier nccl --nproc 8      # on 8 GPUs

Implementations (:data:`IMPLS`; each entry says how to wrap the model, so adding one is one entry),
in the same processes, on the same model (bench/models.py ``LanguageModel``, every block its own
unit / ``fully_shard`` module) and the same batches:

- ``fsdp2-gloo``: ``fully_shard`` on a gloo DeviceMesh;
- ``fsdp2-braid-comms``: the same, with braid's all-gather and reduce-scatter installed through
  ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (braid.comm.fsdp2.use_braid_comms);
- ``fsdp2-braid-backend``: ``fully_shard`` on a DeviceMesh over a process group of braid's
  torch.distributed backend (``dist.new_group(backend="braid")``): every FSDP2 collective on braid;
- ``fsdp2-gloo-overlap``, ``fsdp2-braid-comms-overlap``: both again with async unshards and
  explicit forward prefetch, which on CPU is what lets FSDP2's all-gathers overlap compute;
- ``braid-zero2``, ``braid-zero3``: braid's own wrapper (braid.comm.zero.shard) at stages 2 and 3;
- ``braid-zero2-on-gloo``, ``braid-zero3-on-gloo``: the same wrapper over the gloo group FSDP2
  uses (braid's group interface over a ProcessGroup): the carrier held equal, the schedules compared;
- ``fsdp2-nccl``, ``fsdp2-braid-comms-on-nccl``, ``braid-zero3-on-nccl``: FSDP2, FSDP2 with braid's
  comm objects and braid's wrapper on an NCCL group, every tensor on the rank's GPU
  (``--carrier nccl``; those rows compare with ``fsdp2-nccl``);
- ``braid-zero3-int8-weights``, ``braid-zero3-int4-grads``, ``braid-zero3-int8-weights-int4-grads``:
  ZeRO++ on braid's Communicator: int8 weight gathers (qwZ), int4 gradient reduce-scatters
  (qgZ), both; for slow links between hosts (``multihost --sharding-links``), not one host;
- ``braid-zero3-auto-grads``: the gradient reduce-scatters compressed as ``comm.Adaptive()``
  decides per bucket from the link, codec costs and windows it measures (exact on one host);
- ``braid-zero3-hpz``, ``braid-zero3-int8-weights-int4-grads-hpz``: the same over the
  Communicator split by host (``split_by_host``): hpZ's in-host backward gathers, exact and with
  int8 weights and int4 gradients summed exactly inside the host and quantized across;
- ``fsdp2-nocomm``: FSDP2 with stand-in collectives that move nothing (bench/tp.py
  ``LocalCommunicator``): FSDP2's own work plus the arithmetic, the floor of FSDP2 on any backend;
- ``local``: no communication, each rank trains an unsharded copy: the compute floor of a step;
- ``braid-zero3-offload``, ``braid-zero3-offload-delayed``: ZeRO-Offload in braid's wrapper
  (``offload_optimizer=True``, braid.optim's AdamW stepped on the host thread during the backward
  by ``step_in_backward``, or one step later with ``delay=True``); ``fsdp2-gloo-offload``,
  ``fsdp2-gloo-offload-braid-optim``: FSDP2 with ``CPUOffloadPolicy``, torch's AdamW or
  braid.optim's; ``braid-zero3-offload-on-nccl``, ``braid-zero3-offload-delayed-on-nccl``,
  ``fsdp2-nccl-offload``, ``fsdp2-nccl-offload-braid-optim``: the same on an NCCL group. On the
  CPU the optimizer state is where it was; on a GPU these rows compare ZeRO-Offload with FSDP2's.

A step is ``zero_grad``, forward, cross-entropy loss, backward and an AdamW step. Timing: the
implementations take turns (so a slow phase of the machine hits them alike), in an order that
rotates every round (bench/turns.py): each turn a gloo barrier, then ``--steps`` steps timed
together; a round's time per step is the slowest rank's; the result is the median over
``--rounds`` rounds after ``--warmup`` steps. Memory: the bytes a
rank holds between steps for parameters, gradients and optimizer state, summed from tensor sizes
(storage shared by several tensors counted once). ``err``: the largest difference between the
implementation's losses over the warm-up steps and fsdp2-gloo's, a check that each runs the same
training (the two stand-ins compute something else: no check).

--json writes {"benchmark": "sharding", "date", "machine", "config", "records": [{"impl",
"params", "world_size", "batch", "seq", "step_ms", "carrier", "ratio_vs_fsdp2", "mem_mb",
"sent_mb_per_step", "uplink_mb_per_step", "link_floor_ms", "below_link_floor", "err"}, with
"decisions" ({bucket: [choice, reason]}) for an Adaptive's rows]};
``uplink_mb_per_step`` (with ``--uplink IFACE``) is what the busiest host sent through that interface
per step, by the kernel's counter; ``link_floor_ms`` (with ``--link-mbit``) the least step time the
link allows those bytes (turns.UplinkCounter: per round, the busiest host's bytes less the bucket
of the interface's tbf shaper, at its rate); a step below its floor is a finding (exit status 3);
ratio_vs_fsdp2 and err are against FSDP2 on the same carrier: ``fsdp2-nccl`` for NCCL rows, else
``fsdp2-gloo``.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from braid import comm, optim
from braid.comm import fsdp2, zero

from . import launch, report, turns
from .models import LanguageModel
from .tp import LocalCommunicator

REFERENCE = "fsdp2-gloo"


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    dim: int
    heads: int
    hidden: int
    layers: int

    @classmethod
    def parse(cls, text: str) -> "ModelShape":
        return turns.parse_dims(cls, text, "VOCABxDIMxHEADSxHIDDENxLAYERS")

    __str__ = turns.format_dims


# 24.1M parameters: 5 blocks of 3.15M, embedding and head of 4.2M each.
DEFAULT_MODEL = ModelShape(8192, 512, 8, 2048, 5)


def _fsdp2(model: LanguageModel, c, braid_comms: bool, overlap: bool = False,
           group: dist.ProcessGroup | None = None, offload: bool = False) -> torch.nn.Module:
    """``fully_shard`` per block and at the root, on a mesh over ``group`` (default: the gloo
    default group). ``overlap``: FSDP2 on CPU runs every all-gather
    synchronously (its implicit prefetch relies on CUDA streams), so its collectives never overlap
    compute; async unshards with explicit forward prefetch of the next block (and FSDP2's default
    backward prefetch, then async too) let them. ``offload``: ``CPUOffloadPolicy`` (the shards,
    gradients and optimizer state in host memory, pinned on a GPU)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    device = next(model.parameters()).device.type
    if group is None:
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    else:
        mesh = DeviceMesh.from_group(group, device)
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=device == "cuda")} if offload else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if braid_comms:
        fsdp2.use_braid_comms(model, c)
    if overlap:
        blocks = list(model.blocks)
        for block, following in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([following])
        model._set_unshard_async_op(True)  # torch 2.13 has no public spelling of this switch
    return model


_braid_groups: list = []


def _braid_group() -> dist.ProcessGroup:
    """One process group on braid's torch.distributed backend, made on first use (new_group is a
    collective: every rank builds the implementations in the same order)."""
    if not _braid_groups:
        _braid_groups.append(dist.new_group(backend="braid"))
    return _braid_groups[0]


_host_splits: list = []


def _split(c: comm.Communicator):
    """The run's Communicator split by host (``split_by_host``, collective: made on first use,
    every rank building the implementations in the same order)."""
    if not _host_splits:
        _host_splits.append(c.split_by_host())
    return _host_splits[0]


def _braid_wrapper(model: LanguageModel, c, stage: int, weights: str | None = None,
                   grads: str | None = None, hosts: bool = False, offload: bool = False) -> torch.nn.Module:
    """braid's wrapper; ``weights`` / ``grads``: "int8" or "int4" quantized gathers (qwZ) /
    reduce-scatters (qgZ), ZeRO++'s compression across slow links ("auto" for the gradients:
    ``comm.Adaptive()``, chosen per bucket from the measured link); ``hosts``: hierarchical
    (hpZ, and qgZ exact inside a host) over the Communicator split by host."""
    quantizers = {None: lambda: None, "int8": comm.Int8Quantizer, "int4": comm.Int4Quantizer,
                  "auto": comm.Adaptive}
    q = quantizers[grads]()
    wrapped = zero.shard(model, c, stage=stage, param_compression=quantizers[weights](), grad_compression=q,
                         hierarchical=_split(c) if hosts else False, offload_optimizer=offload)
    if isinstance(q, comm.Adaptive):
        _adaptive[id(wrapped)] = q  # its decisions go in the row
    return wrapped


_adaptive: dict = {}  # id(wrapped model) -> its Adaptive grad_compression


def _nccl() -> dist.ProcessGroup:
    """The run's NCCL group (made by the rank before the implementations are built)."""
    return _nccl_groups[0]


_nccl_groups: list = []

# name -> builder(model, communicator) returning the model to train.
IMPLS: dict[str, Callable] = {
    "fsdp2-gloo": lambda model, c: _fsdp2(model, c, braid_comms=False),
    "fsdp2-braid-comms": lambda model, c: _fsdp2(model, c, braid_comms=True),
    "fsdp2-braid-backend": lambda model, c: _fsdp2(model, c, braid_comms=False, group=_braid_group()),
    "fsdp2-gloo-overlap": lambda model, c: _fsdp2(model, c, braid_comms=False, overlap=True),
    "fsdp2-braid-comms-overlap": lambda model, c: _fsdp2(model, c, braid_comms=True, overlap=True),
    "braid-zero2": lambda model, c: _braid_wrapper(model, c, stage=2),
    "braid-zero3": lambda model, c: _braid_wrapper(model, c, stage=3),
    # braid's wrapper over the very gloo group FSDP2 runs on (comm/core/group.py's ProcessGroupAdapter):
    # what the wrapper's own scheduling costs or saves, the carrier held equal.
    "braid-zero2-on-gloo": lambda model, c: _braid_wrapper(model, dist.group.WORLD, stage=2),
    "braid-zero3-on-gloo": lambda model, c: _braid_wrapper(model, dist.group.WORLD, stage=3),
    # ZeRO++ on braid's Communicator: int8 weight gathers, int4 gradient reduce-scatters, both.
    "braid-zero3-int8-weights": lambda model, c: _braid_wrapper(model, c, stage=3, weights="int8"),
    "braid-zero3-int4-grads": lambda model, c: _braid_wrapper(model, c, stage=3, grads="int4"),
    "braid-zero3-int8-weights-int4-grads": lambda model, c: _braid_wrapper(model, c, stage=3, weights="int8",
                                                                           grads="int4"),
    # The gradient reduce-scatters' compression chosen per bucket from the measured link (Adaptive).
    "braid-zero3-auto-grads": lambda model, c: _braid_wrapper(model, c, stage=3, grads="auto"),
    # The same with the Communicator split by host: hpZ (the backward's gathers inside the host),
    # exact and with all of ZeRO++ (int8 weights, hpZ, int4 gradients summed exactly in the host).
    "braid-zero3-hpz": lambda model, c: _braid_wrapper(model, c, stage=3, hosts=True),
    "braid-zero3-int8-weights-int4-grads-hpz": lambda model, c: _braid_wrapper(
        model, c, stage=3, weights="int8", grads="int4", hosts=True),
    # On an NCCL group, every tensor on the rank's GPU (--carrier nccl): FSDP2 with its own
    # collectives and with braid's comm objects (built with None: FSDP2's NCCL group), braid's
    # wrapper at stage 3.
    "fsdp2-nccl": lambda model, c: _fsdp2(model, c, braid_comms=False, group=_nccl()),
    "fsdp2-braid-comms-on-nccl": lambda model, c: _fsdp2(model, None, braid_comms=True, group=_nccl()),
    "braid-zero3-on-nccl": lambda model, c: _braid_wrapper(model, _nccl(), stage=3),
    # ZeRO-Offload: the optimizer state and the float32 masters in host memory. braid's wrapper
    # with braid.optim's AdamW stepping each bucket on its host thread during the backward
    # (step_in_backward), and with the delayed update (each step during the next step); FSDP2
    # with CPUOffloadPolicy and torch's AdamW, and with braid.optim's AdamW (OPTIMIZERS).
    "braid-zero3-offload": lambda model, c: _braid_wrapper(model, c, stage=3, offload=True),
    "braid-zero3-offload-delayed": lambda model, c: _braid_wrapper(model, c, stage=3, offload=True),
    "fsdp2-gloo-offload": lambda model, c: _fsdp2(model, c, braid_comms=False, offload=True),
    "fsdp2-gloo-offload-braid-optim": lambda model, c: _fsdp2(model, c, braid_comms=False, offload=True),
    # The same on an NCCL group (--carrier nccl): the GPU's comparison of ZeRO-Offload with FSDP2's.
    "braid-zero3-offload-on-nccl": lambda model, c: _braid_wrapper(model, _nccl(), stage=3, offload=True),
    "braid-zero3-offload-delayed-on-nccl": lambda model, c: _braid_wrapper(model, _nccl(), stage=3,
                                                                           offload=True),
    "fsdp2-nccl-offload": lambda model, c: _fsdp2(model, c, braid_comms=False, group=_nccl(), offload=True),
    "fsdp2-nccl-offload-braid-optim": lambda model, c: _fsdp2(model, c, braid_comms=False, group=_nccl(),
                                                              offload=True),
    # FSDP2's step with collectives that move nothing (FSDP2's own work and the arithmetic): the
    # floor of FSDP2 on any backend.
    "fsdp2-nocomm": lambda model, c: _fsdp2(model, LocalCommunicator(c.rank, c.world_size), braid_comms=True),
    # No communication at all: each rank trains its own unsharded copy. The floor of a step.
    "local": lambda model, c: model,
}


def _optimizer(impl: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The AdamW an implementation trains with: torch's, or braid.optim's where the row names it
    (stepped by the wrapper itself under step_in_backward: the step then calls no ``step()``)."""
    if impl not in OPTIMIZERS:
        return torch.optim.AdamW(model.parameters(), lr=lr)
    opt = optim.AdamW(model.parameters(), lr=lr)
    if OPTIMIZERS[impl] is not None:
        model.step_in_backward(opt, delay=OPTIMIZERS[impl] == "delayed")
    return opt


# Rows with braid.optim's AdamW: stepped by the wrapper during the backward ("in backward"), one
# step later ("delayed"), or after the backward by the loop (None).
OPTIMIZERS = {"braid-zero3-offload": "in backward", "braid-zero3-offload-delayed": "delayed",
              "fsdp2-gloo-offload-braid-optim": None, "braid-zero3-offload-on-nccl": "in backward",
              "braid-zero3-offload-delayed-on-nccl": "delayed", "fsdp2-nccl-offload-braid-optim": None}
# Stand-ins that compute something else on purpose, and the delayed update (each step's gradient
# computed with the parameters before the previous update): their losses are not checked.
UNCHECKED = ("fsdp2-nocomm", "local", "braid-zero3-offload-delayed", "braid-zero3-offload-delayed-on-nccl")
# Quantized runs follow the exact one within rounding of their weights and gradients: measured
# within 0.06-0.9% of the loss in tests/test_fsdp.py; the bound is 1% of a loss of order 10.
COMPRESSED = ("braid-zero3-int8-weights", "braid-zero3-int4-grads", "braid-zero3-int8-weights-int4-grads",
              "braid-zero3-int8-weights-int4-grads-hpz", "braid-zero3-auto-grads")
LOSS_TOL = 0.1
# The carrier of each implementation (--carrier keeps those it names; None moves nothing).
CARRIER_OF = {
    "fsdp2-gloo": "gloo", "fsdp2-gloo-overlap": "gloo",
    "braid-zero2-on-gloo": "gloo", "braid-zero3-on-gloo": "gloo",
    "fsdp2-braid-comms": "braid", "fsdp2-braid-comms-overlap": "braid", "fsdp2-braid-backend": "braid",
    "braid-zero2": "braid", "braid-zero3": "braid", "braid-zero3-int8-weights": "braid",
    "braid-zero3-int4-grads": "braid", "braid-zero3-int8-weights-int4-grads": "braid",
    "braid-zero3-auto-grads": "braid",
    "braid-zero3-hpz": "braid", "braid-zero3-int8-weights-int4-grads-hpz": "braid",
    "fsdp2-nccl": "nccl", "fsdp2-braid-comms-on-nccl": "nccl", "braid-zero3-on-nccl": "nccl",
    "fsdp2-nocomm": None, "local": None,
    "braid-zero3-offload": "braid", "braid-zero3-offload-delayed": "braid",
    "fsdp2-gloo-offload": "gloo", "fsdp2-gloo-offload-braid-optim": "gloo",
    "braid-zero3-offload-on-nccl": "nccl", "braid-zero3-offload-delayed-on-nccl": "nccl",
    "fsdp2-nccl-offload": "nccl", "fsdp2-nccl-offload-braid-optim": "nccl",
}


def _reference(impl: str) -> str:
    """The FSDP2 run a row is compared with: on NCCL for NCCL rows, else on gloo."""
    return "fsdp2-nccl" if CARRIER_OF[impl] == "nccl" else REFERENCE


@dataclass(frozen=True)
class Config:
    run: turns.RunOptions
    model: ModelShape
    batch: int
    seq: int
    uplink: str | None = None   # the interface whose sent bytes are counted (a host's uplink)
    link_mbit: int = 0          # its rate: the link floor of each step


def _memory_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters (local shards, and full buffers a wrapper keeps), gradients, optimizer state."""
    if isinstance(model, zero.ShardedModule):
        return sum(model.memory_stats(opt).values())
    seen: set = set()
    total = 0
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, vocab: int) -> float:
    opt.zero_grad(set_to_none=True)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward()
    if getattr(opt, "stepped_by", None) is None:  # else the wrapper stepped it in the backward
        opt.step()
    return loss.item()


def _bench(c, rank: int, world_size: int, config: Config, progress: report.Progress,
           device: torch.device) -> list[dict]:
    shape = config.model
    ids = torch.randint(0, shape.vocab, (config.batch, config.seq + 1),
                        generator=torch.Generator().manual_seed(1 + rank)).to(device)
    models, opts, losses = {}, {}, {}
    nparams = 0
    run = config.run
    for impl in run.impls:
        torch.manual_seed(0)
        dense = LanguageModel(shape.vocab, shape.dim, shape.heads, shape.hidden, shape.layers).to(device)
        nparams = sum(p.numel() for p in dense.parameters())
        models[impl] = IMPLS[impl](dense, c)
        opts[impl] = _optimizer(impl, models[impl], lr=1e-4)
        progress(impl, "warmup", 4 * nparams)
        losses[impl] = [_step(models[impl], opts[impl], ids, shape.vocab) for _ in range(run.warmup)]
    uplink = turns.UplinkCounter(config.uplink, reads=c.local_rank == 0, link_mbit=config.link_mbit)
    steps = {impl: uplink.wrap(impl, turns.synchronized(
        functools.partial(_step, models[impl], opts[impl], ids, shape.vocab), device)) for impl in models}
    for m in models.values():
        if isinstance(m, zero.ShardedModule):
            m.wire_stats()  # counts the timed steps from here
    step = turns.time_in_turns(steps, run, progress, 4 * nparams)
    timed = run.rounds * run.steps
    sent = {impl: (sum(w.sent for w in m.wire_stats().values()) / timed if isinstance(m, zero.ShardedModule)
                   else None) for impl, m in models.items()}
    held = [float(_memory_bytes(models[i], opts[i])) for i in models]
    memory = dict(zip(models, turns.max_over_ranks(held)))
    through, floor = uplink.busiest(list(models), run.rounds, run.steps)
    errors = {}
    for impl in models:
        ref = losses.get(_reference(impl))
        errors[impl] = (max(abs(a - b) for a, b in zip(losses[impl], ref)) if ref and impl not in UNCHECKED
                        else None)
    records = []
    for impl in models:
        records.append({
            "impl": impl, "params": nparams, "world_size": world_size,
            "batch": config.batch, "seq": config.seq,
            "step_ms": round(step[impl] * 1e3, 2),
            "carrier": CARRIER_OF[impl],
            "ratio_vs_fsdp2": (round(step[impl] / step[_reference(impl)], 3) if _reference(impl) in step
                               else None),
            "mem_mb": round(memory[impl] / 2**20, 1),
            # braid's wrapper: bytes this rank sent per step (gathers and reduce-scatters).
            "sent_mb_per_step": None if sent[impl] is None else round(sent[impl] / 2**20, 3),
            # --uplink: bytes through the busiest host's uplink per step (the kernel's counter),
            # and with --link-mbit the least step time the link allows them (turns.UplinkCounter).
            "uplink_mb_per_step": round(through[impl] / 2**20, 3) if config.uplink else None,
            "link_floor_ms": None if floor[impl] is None else round(floor[impl] * 1e3, 1),
            "below_link_floor": floor[impl] is not None and step[impl] < floor[impl],
            "err": None if errors[impl] is None else float(f"{errors[impl]:.3g}"),
        })
        q = _adaptive.pop(id(models[impl]), None)
        if q is not None:  # what Adaptive chose per gradient bucket, and why
            records[-1]["decisions"] = {str(k[-1] if isinstance(k, tuple) else k): [d.choice, d.reason]
                                        for k, d in q.decisions().items()}
    return records


def _run_rank(rank: int, world_size: int, store_port: int | None, config: Config) -> int:
    with turns.rank_session(rank, world_size, store_port, config.run) as c:
        device = turns.device_of(config.run, rank)
        _nccl_groups[:] = [turns.nccl_group(config.run)]
        progress = report.Progress(len(config.run.impls) * (1 + config.run.rounds), enabled=rank == 0)
        records = _bench(c, rank, world_size, config, progress, device)
        progress.close()
        for hosts in _host_splits:
            hosts.intra.group.close()
            hosts.inter.group.close()
        _host_splits.clear()
    return _report(config, records, world_size) if rank == 0 else 0


def _table(records: list[dict]) -> str:
    uplink = records[0].get("uplink_mb_per_step") is not None
    floor = records[0].get("link_floor_ms") is not None
    lines = ["#  impl                                      step (ms)       vs fsdp2  memory (MiB)"
             "  sent/step (MiB)      err" + ("  uplink/step (MiB)" if uplink else "")
             + ("  link floor (ms)" if floor else "")]
    for r in records:
        ratio = "-" if r["ratio_vs_fsdp2"] is None else f"{r['ratio_vs_fsdp2']:.3f}"
        err = "-" if r["err"] is None else f"{r['err']:.2g}"
        sent = "-" if r["sent_mb_per_step"] is None else f"{r['sent_mb_per_step']:.2f}"
        line = (f"   {r['impl']:<40} {r['step_ms']:>10.1f}  {ratio:>13}  {r['mem_mb']:>12.1f}"
                f"  {sent:>15}  {err:>7}")
        if uplink:
            line += f"  {r['uplink_mb_per_step']:>17.2f}"
        if floor:
            line += f"  {r['link_floor_ms']:>15.1f}"
        lines.append(line)
    return "\n".join(lines)


def _report(config: Config, records: list[dict], world_size: int) -> int:
    r0 = records[0]
    print(f"# model {config.model} ({r0['params'] / 1e6:.1f}M parameters), batch {config.batch} x seq "
          f"{config.seq}, {world_size} ranks, AdamW; memory = parameters + gradients + optimizer state "
          "per rank")
    print(_table(records))
    for r in records:
        if "decisions" in r:
            ordered = sorted(r["decisions"].items(), key=lambda i: int(i[0]))
            chose = ", ".join(f"{k}: {c}" for k, (c, _) in ordered)
            print(f"# {r['impl']} chose per gradient bucket {{{chose}}}")
    # Losses of order 9 in float32; the implementations reduce in different orders, which moves
    # them by rounding only. A wrong gradient changes the loss after one step by far more.
    bad = [r for r in records if r["err"] is not None
           and not r["err"] <= (LOSS_TOL if r["impl"] in COMPRESSED else 1e-3)]
    if bad:
        print("# losses differ from FSDP2's on the same carrier: "
              + ", ".join(f"{r['impl']} ({r['err']:.3g})" for r in bad))
    # The floor is what the link allows the bytes counted: a step below it means the count or the
    # link's rate is wrong, and with them every floor of the run.
    below = [r for r in records if r["below_link_floor"]]
    if below:
        print("# steps below their link floor: "
              + ", ".join(f"{r['impl']} ({r['step_ms']:.1f} < {r['link_floor_ms']:.1f} ms)" for r in below))
    print(f"# wall time {time.time() - config.run.started:.1f} s, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    if config.run.json_path:
        turns.write_json(config.run, "sharding",
                         {"model": str(config.model), "batch": config.batch, "seq": config.seq}, records)
    return launch.EXIT_FINDINGS if bad or below else 0


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=ModelShape.parse, default=DEFAULT_MODEL,
                   help=f"VOCABxDIMxHEADSxHIDDENxLAYERS (default {DEFAULT_MODEL})")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step (default 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    turns.add_run_arguments(p, IMPLS, warmup=2, steps=2, rounds=5, timeout=300.0, deadline=3600.0,
                            nproc_help="ranks to spawn")
    turns.add_carrier_argument(p)
    p.add_argument("--uplink", default=None, metavar="IFACE",
                   help="count the bytes each step sends through this network interface (a host's uplink, "
                        "read by one rank per host; python -m braid.bench multihost passes eth0)")
    p.add_argument("--link-mbit", type=int, default=0,
                   help="the --uplink's rate (Mbit/s): adds each step's link floor, the least step time "
                        "the link allows its uplink bytes (a tbf qdisc on the interface gives the rate and "
                        "bucket; default 0: none)")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the sharding benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    run = turns.with_carriers(parser, args, turns.run_options(parser, args, IMPLS, started), CARRIER_OF)
    if args.warmup < 2:  # the first loss comes before any update: alone it checks nothing
        parser.error("--warmup must be at least 2: the losses of the warm-up steps after the first "
                     "update are what is compared with fsdp2-gloo")
    for name in ("batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.model.dim % args.model.heads:
        parser.error(f"--model {args.model}: dim must divide by heads")
    if args.link_mbit < 0:
        parser.error("--link-mbit must be 0 (no link floor) or positive")
    if args.link_mbit and not args.uplink:
        parser.error("--link-mbit needs --uplink (the floor is the uplink's bytes over the link's rate)")
    if args.uplink and not os.path.exists(f"/sys/class/net/{args.uplink}/statistics/tx_bytes"):
        parser.error(f"--uplink {args.uplink}: no such network interface here")
    config = Config(run, args.model, args.batch, args.seq, args.uplink, args.link_mbit)
    return turns.start(_run_rank, config, run, "sharding")


if __name__ == "__main__":
    sys.exit(main())
