"""MoE expert parallelism: braid.comm.moe vs the same layer written with torch's all_to_all_single on gloo.

    python -m braid.bench moe                       # 2 and 4 ranks here, then 2 simulated hosts x 2 at 1 Gbit
    python -m braid.bench moe --nproc 4 --hosts-link 0        # one host only, 4 ranks
    python -m braid.bench moe --shape 2048x512x1024x16x2 --json results/moe.json

One MoE layer (``--shape`` TOKENSxDMODELxHIDDENxEXPERTSxTOPK: tokens per rank, and GELU-MLP experts
split evenly over the ranks), forward and backward, in float32, every implementation from the same
weights on the same tokens:

- ``gloo``: the layer as a torch user writes it today (Megatron's all-to-all token dispatcher):
  route, sort the assignments by expert, exchange the counts with ``dist.all_to_all_single`` and
  read them on the host, move one row per assignment with the differentiable
  ``torch.distributed.nn.functional.all_to_all_single``, run the local experts, send the rows back
  the same way and sum them weighted on the token's rank, over the gloo group
  (:class:`TorchAllToAllMoE`);
- ``braid``: ``braid.comm.moe.MoE`` over a braid Communicator (shared memory on one host, TCP
  between hosts);
- ``braid-on-gloo``: the same layer over the gloo group (the carrier held equal: what the layer's
  own algorithm costs or saves);
- across hosts: ``braid-hier`` (each token crosses to a host once, fans out over shared memory
  there, partial sums cross back) and ``braid-hier-int8`` (the same with int8 dispatch).

A step is ``zero_grad``, forward, ``(y * g).sum() + aux`` and backward. Timing as the model
benchmarks (bench/turns.py): implementations take turns in an order that rotates every round,
each turn a barrier and ``--steps`` steps, a round's time the slowest rank's, the figure the
median over ``--rounds``. tokens/s = tokens per rank x ranks / step time. ``comm ms`` = step -
``local``'s step: what communication adds to a step, not how long the exchanges last (the two
medians come from different turns, and where ranks outnumber cores a rank waiting on a transfer
can lend its core to another rank's experts, which ``local`` never can).

``err``: the largest difference of the first forward's output from gloo's, on any rank; ``check``
says what it is held to. A token's output is the sum of its top-k weighted expert rows, computed
alike by every implementation, summed in float32 in each one's own order (by expert, or per host
first). At top-k <= 2 that order cannot matter (0 + a + b rounds as 0 + b + a): the exact
implementations must equal gloo's output bit for bit (``torch.equal``). At top-k >= 3 orders
round differently: each element must lie within 2 gamma(k - 1) sum|terms| of gloo's (gamma(n) =
n u / (1 - n u), u = 2^-24: the most two summation orders of k float32 terms can differ by), the
terms' magnitudes summed from gloo's layer. int8/fp8 dispatch carries its rounding: reported,
not held to a bound. A failed check is a finding (exit status 3).

Across hosts (``--hosts-link`` Mbit/s, default 1000; simulated hosts, root only): ``rows/token``
are the dispatched rows that cross between hosts per token, by the layer's statistics (the
baseline: one per assignment to a rank on the other host, counted from its splits);
``bound/token`` the least any dispatch sends, one row per (token, remote host) holding one of its
experts; ``uplink/token``: bytes a host's uplink carried per token and step (the kernel's counter:
dispatch, combine and both backwards, TCP/IP headers included); ``floor ms``: the least step time
the link allows those bytes (turns.UplinkCounter: per round, the busiest host's bytes less the
shaper's bucket at its rate). It bounds ``step ms``, not ``comm ms``: a step below its floor is a
finding (the bytes or the rate would be wrong).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from braid import comm
from braid.comm import moe
from braid.comm.core.hosts import host_identity, host_numbers
from torch import nn

from . import launch, report, turns
from .simhosts import INTERFACE, SimulatedHosts, unavailable_reason

ONE_HOST_IMPLS = ("local", "gloo", "braid", "braid-on-gloo")
HOSTS_IMPLS = ("local", "gloo", "braid", "braid-hier", "braid-hier-int8")
ALL_IMPLS = ("local", "gloo", "braid", "braid-on-gloo", "braid-hier", "braid-hier-int8", "braid-hier-fp8",
             "braid-int8")
EXACT = ("local", "braid", "braid-on-gloo", "braid-hier")
# The baseline uses the differentiable all_to_all_single users have written MoE layers with; torch
# 2.13 marks it deprecated (in favour of the functional collectives) without changing what it does.
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_to_all_single is deprecated",
                        category=FutureWarning)
STORE_PORT = 29531


@dataclass(frozen=True)
class Shape:
    tokens: int
    d_model: int
    hidden: int
    experts: int
    top_k: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        return turns.parse_dims(cls, text, "TOKENSxDMODELxHIDDENxEXPERTSxTOPK")

    __str__ = turns.format_dims


# Measured on the 2-core CI machine (docs/results/2026-11-26-xeon-2vcpu.md, "MoE"): the experts'
# arithmetic of a step is a few ms here, so the exchanges are a real share of the step, as on a GPU,
# where the experts' GEMMs take microseconds and MoE steps are communication-bound.
DEFAULT_SHAPE = Shape(1024, 256, 256, 8, 2)


class TorchAllToAllMoE(nn.Module):
    """The baseline: an expert-parallel MoE as written with torch's collectives (Megatron's
    all-to-all dispatcher): one row per assignment, counts read on the host to size the token
    exchange, ``torch.distributed.nn.functional.all_to_all_single`` forward and backward."""

    def __init__(self, router: nn.Linear, experts: Sequence[nn.Module], top_k: int, group: dist.ProcessGroup,
                 host_of_rank: Sequence[int]):
        super().__init__()
        self.group, self.top_k = group, top_k
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = router.out_features
        self.local = self.num_experts // self.n
        self.router = router
        self.experts = nn.ModuleList(experts[self.rank * self.local:(self.rank + 1) * self.local])
        self.remote = [h != host_of_rank[self.rank] for h in host_of_rank]
        self.rows_across = 0

    def forward(self, x: torch.Tensor) -> tuple:
        token, terms = self._terms(x)
        return torch.zeros_like(x).index_add(0, token, terms), x.new_zeros(())

    def term_magnitudes(self, x: torch.Tensor) -> torch.Tensor:
        """Per token and feature, the sum of its terms' magnitudes in float64 (what bounds the
        rounding of summing them in another order). A collective, as ``forward``."""
        token, terms = self._terms(x)
        return x.new_zeros(x.shape, dtype=torch.float64).index_add(0, token, terms.double().abs())

    def _terms(self, x: torch.Tensor) -> tuple:
        """(token of each returned row, the row weighted): the layer's output before its sum."""
        n, local, k = self.n, self.local, self.top_k
        probs = torch.softmax(F.linear(x.float(), self.router.weight.float()), -1)
        weights, ids = probs.topk(k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=self.group)
        send = counts.view(n, local).sum(1).tolist()
        got = arriving.view(n, local)
        recv = got.sum(1).tolist()
        self.rows_across = sum(s for s, r in zip(send, self.remote) if r)
        rows = dist_nn.all_to_all_single(x.new_empty(sum(recv), x.shape[1]), x[token], recv, send,
                                         group=self.group)
        # Rows arrive by source rank, then expert: run each expert on its rows from every source.
        blocks = rows.split(got.reshape(-1).tolist())
        outs = [None] * len(blocks)
        for e, expert in enumerate(self.experts):
            mine = [blocks[s * local + e] for s in range(n)]
            done = expert(torch.cat(mine)).split([b.shape[0] for b in mine])
            for s in range(n):
                outs[s * local + e] = done[s]
        back = dist_nn.all_to_all_single(x.new_empty(sum(send), x.shape[1]), torch.cat(outs), send, recv,
                                         group=self.group)
        w = weights.reshape(-1)[order].unsqueeze(1)
        return token, back * w


@dataclass(frozen=True)
class Config:
    shape: Shape
    impls: tuple
    warmup: int
    steps: int
    rounds: int
    threads: int
    timeout: float
    bind: str
    json_path: str | None
    uplink: str | None = None
    link_mbit: int = 0


_host_splits: list = []
_solo_groups: list = []


def _solo() -> dist.ProcessGroup:
    """A group of this rank alone (new_group is collective: every rank makes every rank's)."""
    if not _solo_groups:
        for r in range(dist.get_world_size()):
            g = dist.new_group([r])
            if r == dist.get_rank():
                _solo_groups.append(g)
    return _solo_groups[0]


def _hosts(c: comm.Communicator):
    """The run's Communicator split by host (collective: made once, on first use)."""
    if not _host_splits:
        _host_splits.append(c.split_by_host())
    return _host_splits[0]


def _build(impl: str, router: nn.Linear, experts: list, c: comm.Communicator, shape: Shape,
           host_of_rank: list) -> nn.Module:
    router, experts = copy.deepcopy(router), copy.deepcopy(experts)
    k = shape.top_k
    if impl == "gloo":
        return TorchAllToAllMoE(router, experts, k, dist.group.WORLD, host_of_rank)
    if impl == "local":  # every expert here, nothing exchanged: the same arithmetic per rank
        return moe.MoE.from_dense(router, experts, _solo(), top_k=k)
    if impl == "braid-on-gloo":
        return moe.MoE.from_dense(router, experts, dist.group.WORLD, top_k=k)
    hier = impl.startswith("braid-hier")
    codec = impl.rsplit("-", 1)[1] if impl.endswith(("int8", "fp8")) else None
    return moe.MoE.from_dense(router, experts, c, top_k=k, hierarchical=_hosts(c) if hier else False,
                              dispatch_compression=codec)


def _host_of_rank(c: comm.Communicator) -> list:
    """Host number of every rank (host identity, as the Communicator tells hosts apart)."""
    every = [None] * c.world_size
    dist.all_gather_object(every, host_identity())
    return host_numbers(every)


def _bench(c: comm.Communicator, rank: int, world: int, config: Config, progress: report.Progress) -> list:
    shape = config.shape
    torch.manual_seed(0)
    router = nn.Linear(shape.d_model, shape.experts, bias=False)
    experts = [moe.ExpertMLP(shape.d_model, shape.hidden) for _ in range(shape.experts)]
    gen = torch.Generator().manual_seed(1 + rank)
    # The input needs its gradient, as a layer inside a model does: four exchanges per step.
    x = torch.randn(shape.tokens, shape.d_model, generator=gen).requires_grad_()
    g = torch.randn(shape.tokens, shape.d_model, generator=gen)
    host_of_rank = _host_of_rank(c)
    hosts = max(host_of_rank) + 1
    layers, first = {}, {}
    for impl in config.impls:
        layers[impl] = _build(impl, router, experts, c, shape, host_of_rank)
        with torch.no_grad():
            first[impl] = layers[impl](x)[0]

    def step(layer: nn.Module) -> Callable[[], None]:
        def run() -> None:
            layer.zero_grad(set_to_none=True)
            y, aux = layer(x)
            ((y * g).sum() + aux).backward()
        return run

    uplink = turns.UplinkCounter(config.uplink, reads=c.local_rank == 0, link_mbit=config.link_mbit)
    steps = {impl: step(layer) for impl, layer in layers.items()}
    for _ in range(config.warmup):
        for impl, run in steps.items():
            progress(impl, "warmup", None)
            run()
    seconds = turns.time_in_turns({impl: uplink.wrap(impl, run) for impl, run in steps.items()}, config,
                                  progress, None)
    sent, floor = uplink.busiest(list(layers), config.rounds, config.steps)
    checks = _check_outputs(first, layers, x, shape.top_k)
    # Rows crossing between hosts per step and their lower bound, summed over the ranks.
    crossing = []
    for layer in layers.values():
        if isinstance(layer, TorchAllToAllMoE):
            crossing += [float(layer.rows_across), -1.0]
        else:
            across = layer.stats()["across_hosts"]
            crossing += [float(across["rows"]), float(across["rows_lower_bound"])]
    totals = torch.tensor(crossing, dtype=torch.float64)
    dist.all_reduce(totals)
    tokens = shape.tokens * world
    local = seconds.get("local")
    records = []
    for i, impl in enumerate(layers):
        rows, bound = totals[2 * i].item(), totals[2 * i + 1].item()
        check, err, failed = checks[impl]
        records.append({
            "impl": impl, "world_size": world, "hosts": hosts, "shape": str(shape),
            "step_ms": round(seconds[impl] * 1e3, 2),
            "tokens_per_s": round(tokens / seconds[impl], 1),
            # The step over the same step without communication (every expert on the rank).
            "comm_ms": None if local is None or impl == "local" else round((seconds[impl] - local) * 1e3, 2),
            "err": float(f"{err:.3g}"),
            "check": check,  # "bitwise", "sum order" (within the bound above) or None (not held)
            "check_failed": failed,
            "rows_across_per_token": round(rows / tokens, 4) if hosts > 1 else None,
            "bound_per_token": round(bound / tokens, 4) if hosts > 1 and bound >= 0 else None,
            # The busiest host's uplink per step, over the tokens of one host.
            "uplink_bytes_per_token": (round(sent[impl] / (tokens / hosts), 1) if config.uplink else None),
            "link_floor_ms": None if floor[impl] is None else round(floor[impl] * 1e3, 2),
            "below_link_floor": floor[impl] is not None and seconds[impl] < floor[impl],
            "link_mbit": config.link_mbit,
        })
    return records


# What each implementation's output is held to against gloo's (the module docstring says why).
BITWISE_TOP_K = 2  # up to two terms per token: 0 + a + b rounds the same in either order
UNIT_ROUNDOFF = 2.0 ** -24  # float32


def _check_outputs(first: dict, layers: dict, x: torch.Tensor, top_k: int) -> dict:
    """{impl: (check, err, failed)} over every rank (a collective): ``check`` "bitwise", "sum order"
    or None (the int8/fp8 dispatches, and every implementation without a gloo run to compare
    with), ``err`` the largest difference from gloo's first output, ``failed`` whether it broke
    its check on some rank."""
    if "gloo" not in first:
        return {impl: (None, 0.0, False) for impl in layers}
    ref = first["gloo"]
    check = "bitwise" if top_k <= BITWISE_TOP_K else "sum order"
    if check == "sum order":
        with torch.no_grad():
            magnitude = layers["gloo"].term_magnitudes(x)
        gamma = (top_k - 1) * UNIT_ROUNDOFF / (1 - (top_k - 1) * UNIT_ROUNDOFF)
        bound = 2 * gamma * magnitude
    errs, failed = [], []
    for impl, out in first.items():
        errs.append(float((out - ref).abs().max()))
        if impl not in EXACT:
            failed.append(0.0)
        elif check == "bitwise":
            failed.append(0.0 if torch.equal(out, ref) else 1.0)
        else:
            failed.append(0.0 if bool(((out.double() - ref.double()).abs() <= bound).all()) else 1.0)
    errs, failed = turns.max_over_ranks(errs), turns.max_over_ranks(failed)
    return {impl: (check if impl in EXACT else None, errs[i], failed[i] > 0) for i, impl in enumerate(first)}


def _run_rank(rank: int, world: int, store_port: int | None, config: Config) -> int:
    with turns.rank_session(rank, world, store_port, config) as c:
        progress = report.Progress(len(config.impls) * (config.warmup + config.rounds), enabled=rank == 0)
        records = _bench(c, rank, world, config, progress)
        progress.close()
        for hosts in _host_splits:
            hosts.intra.group.close()
            hosts.inter.group.close()
        _host_splits.clear()
    if rank == 0:
        print(table(records), flush=True)
        if config.json_path:
            report.write_json(config.json_path, {"benchmark": "moe", "records": records})
    return 0


def table(records: Sequence[dict]) -> str:
    r0 = records[0]
    link = f", {r0['link_mbit']} Mbit links" if r0["link_mbit"] else ""
    lines = [f"# {r0['world_size']} ranks on {r0['hosts']} host(s){link}, shape {r0['shape']} "
             "(tokens/rank x d_model x hidden x experts x top-k), float32 forward + backward"]
    across = r0["rows_across_per_token"] is not None
    floor = r0["link_floor_ms"] is not None
    # The link floor bounds the step time, so it stands beside it.
    head = f"   {'impl':<18} {'step ms':>9}" + (f" {'floor ms':>9}" if floor else "")
    head += f" {'tokens/s':>10} {'vs gloo':>8} {'comm ms':>8} {'vs gloo':>8} {'err':>8} {'check':<10}"
    if across:
        head += f" {'rows/token':>10} {'bound/token':>11} {'uplink/token':>12}"
    lines.append(head.rstrip())
    by = {r["impl"]: r for r in records}
    gloo = by.get("gloo")
    for r in records:
        ratio = f"{gloo['step_ms'] / r['step_ms']:.2f}x" if gloo else "-"
        comm_ms = "-" if r["comm_ms"] is None else f"{r['comm_ms']:.1f}"
        comm_ratio = "-"  # only where both expose communication (noise can make a difference negative)
        if gloo and (gloo["comm_ms"] or 0) > 0 and (r["comm_ms"] or 0) > 0:
            comm_ratio = f"{gloo['comm_ms'] / r['comm_ms']:.2f}x"
        check = "-" if r["check"] is None else r["check"] + (" FAILED" if r["check_failed"] else "")
        line = f"   {r['impl']:<18} {r['step_ms']:>9.1f}" + (f" {r['link_floor_ms']:>9.1f}" if floor else "")
        line += (f" {r['tokens_per_s']:>10.0f} {ratio:>8} {comm_ms:>8} {comm_ratio:>8} {r['err']:>8.2g}"
                 f" {check:<10}")
        if across:
            bound = "-" if r["bound_per_token"] is None else f"{r['bound_per_token']:.3f}"
            up = r["uplink_bytes_per_token"]
            up = "-" if up is None else report.human_bytes(up)
            line += f" {r['rows_across_per_token']:>10.3f} {bound:>11} {up:>12}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def _one_host(config: Config, nproc: int, deadline_s: float) -> list:
    with tempfile.TemporaryDirectory(prefix="braid-moe-") as tmp:
        out = os.path.join(tmp, "moe.json")
        status = launch.spawn(_run_rank, nproc, config.timeout, time.time() + deadline_s,
                              replace(config, json_path=out))
        if status != 0 or not os.path.exists(out):
            raise RuntimeError(f"the {nproc}-rank run failed (exit status {status})")
        with open(out) as f:
            return json.load(f)["records"]


def _across_hosts(config: Config, link: int, deadline_s: float) -> list:
    from .multihost import run_bench_ranks

    with tempfile.TemporaryDirectory(prefix="braid-moe-hosts-") as tmp, \
            SimulatedHosts(2, rate_mbit=link or None) as hosts:
        out = os.path.join(tmp, "moe.json")
        argv = ["moe", "--shape", str(config.shape), "--impls", ",".join(config.impls), "--warmup",
                str(config.warmup), "--steps", str(config.steps), "--rounds", str(config.rounds),
                "--timeout", str(config.timeout), "--json", out, "--uplink", INTERFACE,
                "--link-mbit", str(link)]
        run_bench_ranks(hosts, 2, argv, STORE_PORT, deadline_s, "moe")
        with open(out) as f:
            return json.load(f)["records"]


def summary(records: Sequence[dict]) -> str:
    """Each configuration's braid rows against gloo's tokens/s, with the issue's targets."""
    lines = ["# tokens/s against the gloo layer (targets: one host >= 2x, across hosts at 1 Gbit >= 3x)"]
    by = {}
    for r in records:
        by.setdefault((r["world_size"], r["hosts"], r["link_mbit"]), {})[r["impl"]] = r
    for (world, hosts, link), rows in by.items():
        gloo = rows.get("gloo")
        if gloo is None:
            continue
        where = f"{world} ranks, 1 host" if hosts == 1 else f"{hosts} hosts x {world // hosts}, {link} Mbit"
        ratios = ", ".join(f"{impl} {r['tokens_per_s'] / gloo['tokens_per_s']:.2f}x"
                           for impl, r in rows.items() if impl != "gloo")
        lines.append(f"   {where}: {ratios}")
    return "\n".join(lines)


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=Shape.parse, default=DEFAULT_SHAPE,
                   help=f"TOKENSxDMODELxHIDDENxEXPERTSxTOPK, tokens per rank (default {DEFAULT_SHAPE})")
    p.add_argument("--nproc", default="2,4", help="ranks of the one-host runs, comma-separated (default 2,4; "
                   "empty for none); ignored under torchrun")
    p.add_argument("--impls", default=None, help=f"comma-separated, from {','.join(ALL_IMPLS)} (default "
                   f"{','.join(ONE_HOST_IMPLS)} on one host, {','.join(HOSTS_IMPLS)} across hosts)")
    p.add_argument("--hosts-link", type=int, default=1000,
                   help="Mbit/s of the links of the 2 simulated hosts x 2 ranks run (default 1000; 0: "
                        "unshaped; -1: no run across hosts)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per impl (default 2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round (default 3)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take (default 120)")
    p.add_argument("--deadline", type=float, default=600.0,
                   help="seconds each configuration may take (default 600)")
    p.add_argument("--bind", choices=("auto", "core", "none"), default="auto",
                   help="rank placement, as for the collectives benchmark (default auto)")
    p.add_argument("--json", type=report.output_path(), help="write the records as JSON")
    p.add_argument("--uplink", default=None, help=argparse.SUPPRESS)      # set by the run across hosts
    p.add_argument("--link-mbit", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _impls(text: str | None, default: tuple, parser: argparse.ArgumentParser) -> tuple:
    if text is None:
        return default
    chosen = tuple(dict.fromkeys(i.strip() for i in text.split(",") if i.strip()))
    unknown = [i for i in chosen if i not in ALL_IMPLS]
    if unknown or not chosen:
        parser.error(f"--impls: unknown {', '.join(unknown) or '(none given)'}; choose from "
                     f"{', '.join(ALL_IMPLS)}")
    return chosen


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the MoE benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    for name in ("warmup", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    shape = args.shape
    if shape.top_k > shape.experts:
        parser.error(f"--shape {shape}: top-k must be at most the number of experts")
    try:
        sizes = [int(n) for n in args.nproc.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--nproc: expected comma-separated integers, got {args.nproc!r}")
    bad = [n for n in sizes if n < 1 or shape.experts % n]
    if bad:
        parser.error(f"--nproc {bad}: every rank count must divide the {shape.experts} experts")
    base = Config(shape, (), args.warmup, args.steps, args.rounds, args.threads, args.timeout, "auto",
                  args.json, args.uplink, args.link_mbit)
    if launch.launcher() == "torchrun":  # one configuration, this process one of its ranks
        world = int(os.environ["WORLD_SIZE"])
        config = replace(base, impls=_impls(args.impls, HOSTS_IMPLS, parser),
                         bind=launch.resolve_bind(args.bind, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        return launch.run_rank_reporting(_run_rank, int(os.environ["RANK"]), world, None, config)
    records = []
    for n in sizes:
        config = replace(base, impls=_impls(args.impls, ONE_HOST_IMPLS, parser), json_path=None,
                         bind=launch.resolve_bind(args.bind, n))
        print(f"# braid.bench moe: {n} ranks on this host", flush=True)
        records += _one_host(config, n, args.deadline)
    if args.hosts_link >= 0:
        reason = unavailable_reason(rate=args.hosts_link > 0)
        if reason is not None:
            print(f"# across hosts: simulated hosts cannot be made here ({reason}); not measured")
        elif shape.experts % 4:
            print(f"# across hosts: 4 ranks must divide the {shape.experts} experts; not measured")
        else:
            print(f"# braid.bench moe: 2 simulated hosts x 2 ranks, {args.hosts_link} Mbit links", flush=True)
            config = replace(base, impls=_impls(args.impls, HOSTS_IMPLS, parser), json_path=None)
            records += _across_hosts(config, args.hosts_link, args.deadline)
    if records:
        print(summary(records))
    print(f"# wall time {time.time() - started:.1f} s, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    if args.json:
        report.write_json(args.json, {"benchmark": "moe", "machine": report.machine_info(),
                                      "torch": torch.__version__, "records": records})
    differ = [r for r in records if r["check_failed"]]
    if differ:
        print("# outputs differ from the gloo layer's beyond their check: "
              + ", ".join(f"{r['impl']} at {r['world_size']} ranks ({r['check']}, err {r['err']:.3g})"
                          for r in differ))
    # The floor is what the link allows the bytes counted: a step below it means the count or the
    # link's rate is wrong, and with them every floor of the run.
    below = [r for r in records if r["below_link_floor"]]
    if below:
        print("# steps below their link floor: "
              + ", ".join(f"{r['impl']} ({r['step_ms']:.1f} < {r['link_floor_ms']:.1f} ms)" for r in below))
    return launch.EXIT_FINDINGS if differ or below else 0


if __name__ == "__main__":
    sys.exit(main())
