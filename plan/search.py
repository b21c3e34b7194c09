"""The search: every valid layout of a model on a cluster, its memory and step time, the ones
that fit ranked by predicted step time, each with the reasons it wins and the code to apply it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .cluster import GiB, Cluster, span_of
from .cost import (
    COMPRESSIONS,
    WIRE_BYTES,
    ZERO_STAGES,
    Assumptions,
    Candidate,
    Memory,
    StepTime,
    check,
    dp_sizes,
    experts_apart,
    invalid_reason,
    memory,
    mfu,
    spans,
    stage_layers,
    step_time,
)
from .model import TransformerShape

PARALLELISMS = ("dp", "tp", "pp", "cp", "ep")


class NoLayoutFits(ValueError):
    """No valid layout fits in device memory; the message names the closest one."""


def _opt_positive(value: Any, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")


@dataclass(frozen=True)
class Constraints:
    """What the search may choose.

    Args:
        headroom: fraction of device memory kept free (allocator fragmentation, the runtime's own
            buffers); a layout fits when its bytes <= device_memory x (1 - headroom).
        dp, tp, pp, cp, ep: force a degree (None: search it).
        micro_batches: force the micro-batch count (None: search the divisors of batch / dp).
        interleave: force the pipeline chunks per rank (1: plain 1F1B; None: search).
        max_tp: largest TP degree searched (default: devices per host, so TP stays in a host).
        max_pp: largest PP degree searched (default: layers).
        max_cp: largest CP degree searched.
        max_ep: largest EP degree searched (default: experts).
        max_interleave: most pipeline chunks per rank searched (interleaved 1F1B).
        parallelisms: the dimensions allowed above 1 (any of "dp", "tp", "pp", "cp", "ep").
        zero_stages: ZeRO stages allowed (0: plain data parallelism).
        recompute: activation recomputation settings allowed (False, True or both).
        compression: gradient compressions allowed ("none", "int8", "int4"); the compressed ones
            are tried only when the data-parallel exchange crosses hosts.
        uneven_pp: allow pp that does not divide layers (see ``cost.stage_layers``).
        replicate_kv_heads: allow tp a multiple of kv_heads, each key/value head replicated
            tp / kv_heads times; otherwise tp must divide kv_heads.
    """

    headroom: float = 0.1
    dp: Optional[int] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    cp: Optional[int] = None
    ep: Optional[int] = None
    micro_batches: Optional[int] = None
    interleave: Optional[int] = None
    max_tp: Optional[int] = None
    max_pp: Optional[int] = None
    max_cp: int = 16
    max_ep: Optional[int] = None
    max_interleave: int = 8
    parallelisms: Tuple[str, ...] = PARALLELISMS
    zero_stages: Tuple[int, ...] = ZERO_STAGES
    recompute: Tuple[bool, ...] = (False, True)
    compression: Tuple[str, ...] = COMPRESSIONS
    uneven_pp: bool = False
    replicate_kv_heads: bool = True

    def __post_init__(self) -> None:
        h = self.headroom
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
            raise ValueError(f"headroom must be a fraction in [0, 1), got {h!r}")
        for name in (
            "dp",
            "tp",
            "pp",
            "cp",
            "ep",
            "micro_batches",
            "interleave",
            "max_tp",
            "max_pp",
            "max_cp",
            "max_ep",
            "max_interleave",
        ):
            _opt_positive(getattr(self, name), name)
        for name, allowed in (
            ("parallelisms", PARALLELISMS),
            ("zero_stages", ZERO_STAGES),
            ("recompute", (False, True)),
            ("compression", COMPRESSIONS),
        ):
            value = getattr(self, name)
            if isinstance(value, (str, int)):
                value = (value,)
            value = tuple(value)
            object.__setattr__(self, name, value)
            bad = [v for v in value if v not in allowed or (name == "recompute") != isinstance(v, bool)]
            if bad:
                raise ValueError(f"{name}: {bad[0]!r} is not one of {allowed}")
            if not value and name != "parallelisms":
                raise ValueError(f"{name} must allow at least one of {allowed}")
        for name in ("uneven_pp", "replicate_kv_heads"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) not in (None, 1) and name not in self.parallelisms:
                raise ValueError(
                    f"{name}={getattr(self, name)} is forced but {name!r} is not in "
                    f"parallelisms={self.parallelisms}"
                )

    def to_dict(self) -> Dict[str, Any]:
        """The fields, JSON-ready."""
        return dataclasses.asdict(self)

    def check(self, model: TransformerShape, cluster: Cluster) -> None:
        """Raises ValueError when a forced degree cannot work for ``model`` on ``cluster``, naming it."""
        n = cluster.devices
        dph = cluster.devices_per_host
        if self.tp is not None:
            if dph % self.tp and self.tp % dph:
                raise ValueError(
                    f"tp={self.tp} neither divides nor is a multiple of devices_per_host={dph} "
                    "(its groups would straddle hosts)"
                )
            if model.heads % self.tp:
                raise ValueError(f"tp={self.tp} does not divide heads={model.heads}")
            if model.kv_heads % self.tp and (not self.replicate_kv_heads or self.tp % model.kv_heads):
                raise ValueError(
                    f"tp={self.tp} does not divide kv_heads={model.kv_heads}"
                    + ("" if self.replicate_kv_heads else " (kv-head replication is off)")
                )
            if model.ffn % self.tp:
                raise ValueError(f"tp={self.tp} does not divide ffn={model.ffn}")
        if self.pp is not None:
            if self.pp > model.layers:
                raise ValueError(f"pp={self.pp} is more than layers={model.layers}")
            if model.layers % self.pp and not self.uneven_pp:
                raise ValueError(
                    f"pp={self.pp} does not divide layers={model.layers} (uneven_pp=True splits it unevenly)"
                )
        if self.cp is not None and self.cp > 1 and model.seq % (2 * self.cp):
            raise ValueError(f"cp={self.cp}: seq={model.seq} is not divisible by 2*cp={2 * self.cp}")
        if self.dp is not None and model.batch % self.dp:
            raise ValueError(f"batch={model.batch} is not divisible by dp={self.dp}")
        if self.ep is not None and self.ep > 1:
            if not model.moe:
                raise ValueError(f"ep={self.ep} needs experts (the model is dense)")
            if model.experts % self.ep:
                raise ValueError(f"ep={self.ep} does not divide experts={model.experts}")
            if self.dp is not None and self.dp % self.ep:
                raise ValueError(f"ep={self.ep} does not divide dp={self.dp}")
        forced = 1
        for name in ("dp", "tp", "pp", "cp"):
            value = getattr(self, name)
            if value is not None:
                forced *= value
                if n % value:
                    raise ValueError(f"{name}={value} does not divide the device count {n}")
        if n % forced or (
            all(getattr(self, k) is not None for k in ("dp", "tp", "pp", "cp")) and forced != n
        ):
            raise ValueError(
                f"the forced degrees multiply to {forced}, which does not fit the device count {n}"
            )
        if self.interleave is not None and self.interleave > 1:
            if self.pp == 1 or (self.pp is None and "pp" not in self.parallelisms):
                raise ValueError(f"interleave={self.interleave} needs pipeline parallelism (pp > 1)")
            if self.pp is not None and max(stage_layers(model.layers, self.pp)) % self.interleave:
                raise ValueError(
                    f"interleave={self.interleave} does not divide the blocks of the largest of "
                    f"pp={self.pp} stages ({max(stage_layers(model.layers, self.pp))})"
                )
        if self.micro_batches is not None and model.batch % self.micro_batches:
            raise ValueError(f"micro_batches={self.micro_batches} does not divide batch={model.batch}")
        if (
            self.micro_batches is not None
            and self.dp is not None
            and (model.batch // self.dp) % self.micro_batches
        ):
            raise ValueError(
                f"micro_batches={self.micro_batches} does not divide batch/dp="
                f"{model.batch}/{self.dp}={model.batch // self.dp}"
            )


@dataclass
class Layout:
    """One evaluated layout: its degrees and settings (``candidate``), memory per device, step time,
    MFU, whether it fits, and for a ranked layout the reasons it wins and the code to apply it."""

    candidate: Candidate
    memory: Memory
    time: StepTime
    mfu: float
    fits: bool
    memory_limit: float
    rank: int = 0
    reasons: List[str] = field(default_factory=list)
    snippet: str = ""

    @property
    def dp(self) -> int:
        """Data-parallel degree."""
        return self.candidate.dp

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return self.candidate.tp

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return self.candidate.pp

    @property
    def cp(self) -> int:
        """Context-parallel degree."""
        return self.candidate.cp

    @property
    def ep(self) -> int:
        """Expert-parallel degree (inside dp)."""
        return self.candidate.ep

    @property
    def zero(self) -> int:
        """ZeRO stage over the data-parallel ranks."""
        return self.candidate.zero

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step."""
        return self.candidate.micro_batches

    @property
    def interleave(self) -> int:
        """Pipeline chunks per rank (1: plain 1F1B)."""
        return self.candidate.interleave

    @property
    def recompute(self) -> bool:
        """Full activation recomputation."""
        return self.candidate.recompute

    @property
    def compression(self) -> str:
        """Gradient compression between hosts."""
        return self.candidate.compression

    @property
    def step(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.time.step

    def label(self) -> str:
        """The candidate's one-line form."""
        return self.candidate.label()

    def to_dict(self) -> Dict[str, Any]:
        """Everything, JSON-ready: degrees and settings, time and memory split into parts, MFU,
        reasons and snippet."""
        d: Dict[str, Any] = {"rank": self.rank, "label": self.label()}
        d.update(self.candidate.to_dict())
        d.update(
            {
                "step_s": self.step,
                "mfu": self.mfu,
                "fits": self.fits,
                "time": self.time.to_dict(),
                "memory": self.memory.to_dict(),
                "memory_limit": self.memory_limit,
                "reasons": list(self.reasons),
                "snippet": self.snippet,
            }
        )
        return d


def _divisors(n: int) -> List[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _options(forced: Optional[int], name: str, constraints: Constraints, values: Sequence[int]) -> List[int]:
    if forced is not None:
        return [forced]
    if name not in constraints.parallelisms:
        return [1]
    return list(values)


def evaluate(
    model: TransformerShape,
    cluster: Cluster,
    candidate: Candidate,
    constraints: Optional[Constraints] = None,
    assumptions: Optional[Assumptions] = None,
) -> Layout:
    """Memory, step time and MFU of one layout (ValueError when it is not a valid layout)."""
    constraints = constraints or Constraints()
    check(
        model,
        cluster,
        candidate,
        uneven_pp=constraints.uneven_pp,
        replicate_kv_heads=constraints.replicate_kv_heads,
    )
    return _evaluate(model, cluster, candidate, constraints, assumptions or Assumptions(), None)


def _evaluate(
    model: TransformerShape,
    cluster: Cluster,
    c: Candidate,
    constraints: Constraints,
    assumptions: Assumptions,
    stages: Optional[Sequence[int]],
    detail: bool = True,
    mem: Optional[Memory] = None,
) -> Layout:
    stages = stages or stage_layers(model.layers, c.pp)
    mem = mem or memory(model, cluster, c, assumptions, stages)
    limit = cluster.device_memory * (1 - constraints.headroom)
    t = step_time(model, cluster, c, assumptions, stages, detail=detail)
    return Layout(c, mem, t, mfu(model, cluster, t.step), mem.total <= limit, limit)


def candidates(
    model: TransformerShape,
    cluster: Cluster,
    constraints: Optional[Constraints] = None,
    assumptions: Optional[Assumptions] = None,
    prune: bool = False,
    tally: Optional[Dict[str, int]] = None,
) -> Iterator[Layout]:
    """Every valid layout the constraints allow, evaluated (fitting or not): dp x tp x pp x cp =
    devices, ep dividing dp and experts, micro-batches dividing batch / dp, each allowed ZeRO stage,
    recomputation setting and (when the gradient exchange crosses hosts) compression.

    ``prune=True`` (what ``search`` does) skips layouts that a fitting sibling beats on step time:
    recomputation when the same layout fits without it, and without pipeline parallelism every
    micro-batch count above the smallest that fits (more micro-batches only add collectives and
    shorten the backward the gradient exchange hides behind). ``tally["examined"]`` (when a dict
    is given) counts the layouts whose memory was computed, pruned or not, ``tally["smallest"]``
    holds (bytes, candidate, Memory) of the least memory seen and ``tally["invalid"]`` the first
    reason a combination of degrees was rejected."""
    constraints = constraints or Constraints()
    assumptions = assumptions or Assumptions()
    constraints.check(model, cluster)
    n = cluster.devices
    divs = _divisors(n)
    kw = dict(uneven_pp=constraints.uneven_pp, replicate_kv_heads=constraints.replicate_kv_heads)
    max_tp = constraints.max_tp or cluster.devices_per_host
    max_pp = min(constraints.max_pp or model.layers, model.layers)
    tps = _options(constraints.tp, "tp", constraints, [d for d in divs if d <= max_tp])
    pps = _options(constraints.pp, "pp", constraints, [d for d in divs if d <= max_pp])
    cps = _options(constraints.cp, "cp", constraints, [d for d in divs if d <= constraints.max_cp])
    zero_all = sorted(set(constraints.zero_stages))
    limit = cluster.device_memory * (1 - constraints.headroom)
    rcs = sorted(set(constraints.recompute))  # False first
    tally = tally if tally is not None else {}
    tally.setdefault("examined", 0)
    for tp in tps:
        for pp in pps:
            stages = stage_layers(model.layers, pp) if pp <= model.layers else []
            for cp in cps:
                if n % (tp * pp * cp):
                    continue
                dp = n // (tp * pp * cp)
                if constraints.dp is not None and dp != constraints.dp:
                    continue
                if dp > 1 and "dp" not in constraints.parallelisms:
                    continue
                base = Candidate(dp, tp, pp, cp)
                reason = invalid_reason(model, cluster, base, **kw)
                if reason:
                    tally.setdefault("invalid", reason)
                    continue
                if model.moe:
                    max_ep = constraints.max_ep or model.experts
                    eps = _options(
                        constraints.ep,
                        "ep",
                        constraints,
                        [e for e in _divisors(dp) if model.experts % e == 0 and e <= max_ep],
                    )
                else:
                    eps = [1]
                ms = (
                    [constraints.micro_batches]
                    if constraints.micro_batches is not None
                    else _divisors(model.batch // dp)
                )
                if pp == 1:
                    vs = [1]
                elif constraints.interleave is not None:
                    vs = [constraints.interleave]
                else:
                    vs = [v for v in _divisors(max(stages)) if v <= constraints.max_interleave]
                for ep in eps:
                    c0 = dataclasses.replace(base, ep=ep)
                    n_dp, n_edp = dp_sizes(c0)
                    sp = spans(tp, cp, dp, ep, pp, cluster.devices_per_host)
                    crosses = sp["dense"][1] > 1 or (model.moe and sp["expert"][1] > 1)
                    comps = [x for x in constraints.compression if x == "none" or crosses]
                    zeros = zero_all if max(n_dp, n_edp) > 1 else zero_all[:1]
                    for z in zeros:
                        for comp in comps:
                            # parameters, gradients, optimizer state, buffers and residual do not
                            # change with m, recomputation or interleaving: when they alone overflow,
                            # no micro-batch count helps (the probe, with the most micro-batches and
                            # recomputation when allowed, is also this group's least memory)
                            probe_c = Candidate(dp, tp, pp, cp, ep, z, ms[-1], rcs[-1], comp)
                            probe = memory(model, cluster, probe_c, assumptions, stages)
                            if "smallest" not in tally or probe.total < tally["smallest"][0]:
                                tally["smallest"] = (probe.total, probe_c, probe)
                            if prune and probe.total - probe.activations > limit:
                                tally["examined"] += len(ms) * len(vs) * len(rcs)
                                continue
                            done_rc = set()  # recomputation settings that already fit (pp = 1)
                            for m in ms:
                                for v in vs:
                                    if v > 1 and m % pp:
                                        continue
                                    fit_without_rc = False
                                    for rc in rcs:
                                        if prune and ((rc and fit_without_rc) or (pp == 1 and rc in done_rc)):
                                            continue
                                        # valid by construction: the base was checked, m divides
                                        # batch / dp, v fits the stages and divides by pp
                                        c = Candidate(dp, tp, pp, cp, ep, z, m, rc, comp, v)
                                        mem = memory(model, cluster, c, assumptions, stages)
                                        tally["examined"] += 1
                                        if prune and mem.total > limit:
                                            continue
                                        layout = _evaluate(
                                            model,
                                            cluster,
                                            c,
                                            constraints,
                                            assumptions,
                                            stages,
                                            detail=not prune,
                                            mem=mem,
                                        )
                                        if layout.fits:
                                            fit_without_rc = fit_without_rc or not rc
                                            done_rc.add(rc)
                                        yield layout


TIE = 0.001  # layouts whose predicted steps are within 0.1% count as tied


def _rank_key(layout: Layout, fastest: float) -> Tuple:
    """Step time in 0.1% buckets, then the simpler layout (no compression, lower ZeRO stage, no
    recomputation, fewer pipeline, context, expert and tensor ranks, fewer pipeline chunks and
    micro-batches), then less memory."""
    c = layout.candidate
    bucket = int(math.log(layout.step / fastest) / math.log1p(TIE) + 1e-9)
    return (
        bucket,
        c.compression != "none",
        c.zero,
        c.recompute,
        c.pp,
        c.cp,
        c.ep,
        c.tp,
        c.interleave,
        c.micro_batches,
        layout.memory.total,
        layout.step,
    )


@dataclass
class PlanResult:
    """What ``search`` found: the ranked layouts, how many layouts were examined (``evaluated``;
    the pruned ones included) and how many of the fully evaluated ones fit, with the inputs."""

    model: TransformerShape
    cluster: Cluster
    constraints: Constraints
    assumptions: Assumptions
    layouts: List[Layout]
    evaluated: int
    fitting: int

    def to_dict(self) -> Dict[str, Any]:
        """Inputs, counts and layouts, JSON-ready."""
        return {
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "constraints": self.constraints.to_dict(),
            "assumptions": self.assumptions.to_dict(),
            "evaluated": self.evaluated,
            "fitting": self.fitting,
            "layouts": [x.to_dict() for x in self.layouts],
        }


def search(
    model: TransformerShape,
    cluster: Cluster,
    constraints: Optional[Constraints] = None,
    top: Optional[int] = 5,
    assumptions: Optional[Assumptions] = None,
) -> PlanResult:
    """``plan`` with the counts of layouts evaluated and fitting (see ``plan``)."""
    if not isinstance(model, TransformerShape):
        raise TypeError(f"model must be a TransformerShape, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    if constraints is not None and not isinstance(constraints, Constraints):
        raise TypeError(f"constraints must be a Constraints or None, got {type(constraints).__name__}")
    if assumptions is not None and not isinstance(assumptions, Assumptions):
        raise TypeError(f"assumptions must be an Assumptions or None, got {type(assumptions).__name__}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top <= 0):
        raise ValueError(f"top must be a positive int or None, got {top!r}")
    constraints = constraints or Constraints()
    assumptions = assumptions or Assumptions()
    tally: Dict[str, int] = {}
    everything = list(candidates(model, cluster, constraints, assumptions, prune=True, tally=tally))
    fitting = [x for x in everything if x.fits]
    if not fitting:
        if "smallest" not in tally:
            example = f" (e.g. {tally['invalid']})" if "invalid" in tally else ""
            raise NoLayoutFits(
                f"no valid layout of {model.name or 'the model'} on {cluster.devices} devices: the "
                f"constraints and divisibility rules leave none{example}"
            )
        total, closest, mem = tally["smallest"]
        limit = cluster.device_memory * (1 - constraints.headroom)
        parts = ", ".join(f"{p} {getattr(mem, p) / GiB:.2f}" for p in Memory.PARTS)
        raise NoLayoutFits(
            f"no layout fits in {limit / GiB:.2f} GiB per device ({cluster.device_memory / GiB:.2f} "
            f"GiB less {constraints.headroom:.0%} headroom); the smallest, {closest.label()}, needs "
            f"{total / GiB:.2f} GiB ({parts} GiB)"
        )
    fastest = min(x.step for x in fitting)
    fitting.sort(key=lambda x: _rank_key(x, fastest))
    chosen = fitting if top is None else fitting[:top]
    for i, layout in enumerate(chosen):
        layout.time = step_time(model, cluster, layout.candidate, assumptions)  # with the notes
        layout.rank = i + 1
        layout.reasons = reasons(layout, model, cluster, fitting, constraints, assumptions)
        layout.snippet = snippet(layout, model, cluster)
    return PlanResult(model, cluster, constraints, assumptions, chosen, tally["examined"], len(fitting))


def plan(
    model: TransformerShape,
    cluster: Cluster,
    constraints: Optional[Constraints] = None,
    top: Optional[int] = 5,
    assumptions: Optional[Assumptions] = None,
) -> List[Layout]:
    """The ``top`` fastest layouts of ``model`` on ``cluster`` that fit in device memory (all of them
    for ``top=None``), by predicted step time, each with ``reasons`` and a ``snippet``.

    Raises TypeError/ValueError for bad inputs (naming the argument) and ``NoLayoutFits`` (a
    ValueError) when no valid layout fits, naming the closest one and what fills it."""
    return search(model, cluster, constraints, top, assumptions).layouts


# -- why a layout wins ------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def reasons(
    layout: Layout,
    model: TransformerShape,
    cluster: Cluster,
    fitting: Sequence[Layout],
    constraints: Constraints,
    assumptions: Assumptions,
) -> List[str]:
    """Short sentences on what makes ``layout`` fast or possible, against the alternatives."""
    c = layout.candidate
    out: List[str] = []
    dpc = cluster.devices_per_host
    t = layout.time
    if c.tp > 1:
        local, hosts = span_of([(c.tp, 1)], dpc)
        if hosts == 1:
            out.append(f"TP={c.tp} stays inside a host ({cluster.intra_bandwidth / 1e9:g} GB/s link)")
        else:
            out.append(
                f"TP={c.tp} spans {hosts} hosts: its all-reduces run on the "
                f"{cluster.inter_bandwidth / 1e9:g} GB/s link"
            )
    if c.recompute:
        alt = memory(model, cluster, dataclasses.replace(c, recompute=False), assumptions)
        if alt.total > layout.memory_limit:
            out.append(
                f"recomputation makes it fit: {_gib(alt.total)} without it, {_gib(layout.memory_limit)} "
                f"usable (+{t.recompute:.2f} s of compute)"
            )
        else:
            out.append(f"recomputation costs {t.recompute:.2f} s of compute")
    else:
        what = f"ZeRO-{c.zero} fits" if c.zero else "fits without ZeRO sharding and"
        usage = f"{_gib(layout.memory.total)} of {_gib(layout.memory_limit)} usable"
        out.append(f"{what} without recomputation ({usage})")
    if c.zero:
        plain = memory(model, cluster, dataclasses.replace(c, zero=0), assumptions)
        n_dp, _ = dp_sizes(c)
        sharded = {
            1: "optimizer state",
            2: "optimizer state and gradients",
            3: "optimizer state, gradients and parameters",
        }[c.zero]
        out.append(
            f"ZeRO-{c.zero} shards the {sharded} over {n_dp} ranks: "
            f"{_gib(plain.total - layout.memory.total)} less per device than ZeRO-0"
        )
    if c.compression != "none":
        ratio = model.dtype_bytes / WIRE_BYTES[c.compression]
        exact = step_time(model, cluster, dataclasses.replace(c, compression="none"), assumptions)
        out.append(
            f"{c.compression} gradients: the {cluster.inter_bandwidth / 1e9:g} GB/s link carries "
            f"{ratio:.1f}x fewer bytes than {model.dtype} ({exact.step - t.step:.3f} s less per step "
            "than exact)"
        )
    dp = t.comms.get("dp")
    if dp is not None:
        if dp.exposed <= 0.01 * t.step:
            out.append(f"the gradient exchange ({dp.total:.3f} s) hides behind the backward")
        else:
            out.append(f"the gradient exchange exposes {dp.exposed:.3f} s of its {dp.total:.3f} s")
    if c.pp > 1:
        chunks = f", {c.interleave} chunks per rank (interleaved)" if c.interleave > 1 else ""
        out.append(
            f"PP={c.pp} with {c.micro_batches} micro-batches{chunks}: the bubble is "
            f"{t.bubble / t.step:.0%} of the step"
        )
    if c.cp > 1:
        cpc = t.comms["cp"]
        hidden = (
            "hidden behind attention" if cpc.exposed <= 0.01 * cpc.total else f"{cpc.exposed:.3f} s exposed"
        )
        out.append(
            f"CP={c.cp} splits each {model.seq}-token sequence (activations / {c.cp}); its K/V "
            f"ring is {hidden}"
        )
    if c.ep > 1:
        per_device = model.experts // c.ep
        out.append(
            f"EP={c.ep}: {per_device} expert{'s' if per_device > 1 else ''} per device, all-to-alls on the "
            f"{t.comms['ep'].link} link ({t.comms['ep'].exposed:.3f} s)"
        )
    degrees = (c.dp, c.tp, c.pp, c.cp, c.ep)
    others = [x for x in fitting if (x.dp, x.tp, x.pp, x.cp, x.ep) != degrees]
    if others:
        other = others[0]
        gain = other.step / t.step - 1
        if gain >= 0.0005:
            out.append(
                f"{gain:.1%} faster than the best layout with other degrees ({other.label()}, "
                f"{other.step:.3f} s)"
            )
        elif gain >= -TIE:
            out.append(f"ties with {other.label()} ({other.step:.3f} s), ranked ahead as simpler or smaller")
    return out


# -- the code to apply it -------------------------------------------------------------------------
def snippet(layout: Layout, model: TransformerShape, cluster: Cluster) -> str:
    """Python that builds the layout's DeviceMesh and applies braid's and torch's parallel pieces.
    The mesh and groups are exact; module names (``layers.*.attention.wq``, ...) follow Llama
    conventions and stand for the model's own."""
    c = layout.candidate
    L: List[str] = []
    add = L.append
    add(f"# braid.plan: {c.label()} on {cluster.hosts} hosts x {cluster.devices_per_host} devices")
    add(f"# launch: torchrun --nnodes {cluster.hosts} --nproc-per-node {cluster.devices_per_host} train.py")
    add("import torch")
    add("import torch.distributed as dist")
    add("from torch.distributed.device_mesh import init_device_mesh")
    if c.zero == 0 and max(dp_sizes(c)) > 1:
        add("from torch.nn.parallel import DistributedDataParallel as DDP")
    if c.pp > 1:
        add(
            "from torch.distributed.pipelining import PipelineStage, "
            + ("ScheduleInterleaved1F1B" if c.interleave > 1 else "Schedule1F1B")
        )
    mods = [name for name, used in (("comm", c.compression != "none" and c.zero > 0),) if used]
    if mods:
        add("from braid import comm")
    braid_mods = [
        name
        for name, used in (
            ("cp", c.cp > 1),
            ("ddp", c.zero == 0 and c.compression != "none"),
            ("zero", c.zero > 0),
            ("moe", c.ep > 1 or model.moe),
            ("tp", c.tp > 1),
        )
        if used
    ]
    if braid_mods:
        add(f"from braid.comm import {', '.join(braid_mods)}")
    add("")
    add('dist.init_process_group("nccl")')
    add(f"torch.cuda.set_device(dist.get_rank() % {cluster.devices_per_host})")
    if c.ep > 1:
        shape = (c.pp, c.dp // c.ep, c.ep, c.cp, c.tp)
        names = ("pp", "dp_ep", "ep", "cp", "tp")
    else:
        shape = (c.pp, c.dp, c.cp, c.tp)
        names = ("pp", "dp", "cp", "tp")
    add("# ranks: tp fastest, then cp, (ep,) dp, pp slowest")
    quoted = ", ".join(f'"{n}"' for n in names)
    add(f'mesh = init_device_mesh("cuda", {shape}, mesh_dim_names=({quoted}))')
    dp_dims = ("dp_ep", "ep") if c.ep > 1 else ("dp",)
    if c.cp > 1:
        dp_dims = dp_dims + ("cp",)
    if len(dp_dims) == 1:
        add(f'dp_group = mesh["{dp_dims[0]}"].get_group()   # gradients and ZeRO: the dense replicas')
    else:
        dims = ", ".join(f'"{d}"' for d in dp_dims)
        add(
            f'dp_group = mesh[{dims}]._flatten("dp_all").get_group()   # gradients and ZeRO: the dense '
            "replicas"
        )
    if c.tp > 1:
        add('tp_group = mesh["tp"].get_group()')
    if c.cp > 1:
        add('cp_group = mesh["cp"].get_group()')
    if c.pp > 1:
        add('pp_group = mesh["pp"].get_group()')
    if c.ep > 1:
        add('ep_group = mesh["ep"].get_group()')
    if model.moe and (c.ep > 1 or c.tp > 1):
        outer = '"dp_ep"' if c.ep > 1 else '"dp"'
        add(
            f'expert_dp_group = mesh[{outer}, "cp", "tp"]._flatten("expert_dp").get_group()'
            "   # replicas of an expert"
        )
    add("# --- end of mesh ---")
    add("")
    add("model = build_model()   # your model, on this rank's device")
    if model.moe:
        group = "ep_group" if c.ep > 1 else "None"
        add(
            f"# MoE: {model.experts // c.ep} of the {model.experts} experts on each rank of the EP group "
            f"(pass expert= for {'gated ' if model.gated else ''}expert MLPs)"
        )
        add("for block in model.layers:")
        add(
            f"    block.feed_forward = moe.MoE({model.hidden}, {model.experts}, top_k={model.top_k}, "
            f"group={group}, hidden={model.ffn})"
        )
    if c.tp > 1:
        add("# tensor parallelism, sequence-parallel (Megatron split); the names stand for your submodules")
        tp_plan = [
            '"layers.*.attention.wq": "colwise"',
            '"layers.*.attention.wk": "colwise"',
            '"layers.*.attention.wv": "colwise"',
            '"layers.*.attention.wo": "rowwise"',
        ]
        if not model.moe:
            tp_plan += ['"layers.*.feed_forward.w1": "colwise"']
            if model.gated:
                tp_plan += ['"layers.*.feed_forward.w3": "colwise"']
            tp_plan += ['"layers.*.feed_forward.w2": "rowwise"']
        tp_plan += ['"layers.*.*_norm": "sequence"', '"tok_embeddings": "vocab"', '"output": "colwise"']
        add("model = tp.parallelize(model, tp_group, {")
        for i in range(0, len(tp_plan), 2):
            add("    " + ", ".join(tp_plan[i : i + 2]) + ",")
        add("}, sequence_parallel=True)")
    if c.cp > 1:
        add("# context parallelism: attention runs as ring attention over cp_group")
        add('cp.parallelize(model, cp_group, ["layers.*.attention"])')
        add(
            "# each step: ids = cp.shard(ids, cp_group, balanced=True, dim=1); positions from "
            f"cp.shard_indices({model.seq}, cp_group, balanced=True)"
        )
    if c.recompute:
        add(
            "# full recomputation: call each block as torch.utils.checkpoint.checkpoint(block, x, "
            "use_reentrant=False)"
        )
    if c.pp > 1:
        counts = stage_layers(model.layers, c.pp)
        add(
            f"# pipeline: rank i keeps its blocks ({'/'.join(map(str, counts))} of {model.layers}); "
            "the first also the embedding, the last the final norm and output"
        )
        add('stage_index = mesh["pp"].get_local_rank()')
        if c.interleave > 1:
            add(
                f"# interleaved: those blocks in {c.interleave} chunks, chunk k of rank i is stage "
                f"k * {c.pp} + i of {c.pp * c.interleave}"
            )
            add(
                f"chunks = [keep_stage(model, k * {c.pp} + stage_index) for k in range({c.interleave})]"
                "   # your split"
            )
        else:
            add("model = keep_stage(model, stage_index)   # your split")
    comp = c.compression
    chunked = c.interleave > 1

    def each(expr: str) -> None:
        # apply expr (on ``m``) to the model, or to every chunk when interleaved
        if chunked:
            add(f"chunks = [{expr.replace('MOD', 'ch')} for ch in chunks]")
        else:
            add(f"model = {expr.replace('MOD', 'model')}")

    apart = experts_apart(model, c)  # expert replicas != dense replicas
    loop, ind, target = ("for ch in chunks:", "    ", "ch") if chunked else ("", "", "model")
    if max(dp_sizes(c)) > 1 and not apart:
        if c.zero == 0:
            each("DDP(MOD, process_group=dp_group, gradient_as_bucket_view=True)")
            if comp != "none":
                add(
                    f"for ddp_module in {'chunks' if chunked else '[model]'}:   # exact in a host, {comp} "
                    "between hosts"
                )
                add(f'    state, hook = ddp.comm_hook(dp_group, "{comp}", hierarchical=True)')
                add("    ddp_module.register_comm_hook(state, hook)")
        else:
            quant = {"int8": "comm.Int8Quantizer()", "int4": "comm.Int4Quantizer()"}.get(comp)
            extra = f", grad_compression={quant}, hierarchical=True" if quant else ""
            add(f"# ZeRO-{c.zero} over the data-parallel ranks")
            each(f"zero.shard(MOD, dp_group, stage={c.zero}{extra})")
    elif max(dp_sizes(c)) > 1:
        add("# the experts differ from rank to rank: keep them out of the data-parallel wrapper")
        if loop:
            add(loop)
        if c.zero == 0:
            add(f"{ind}expert_ids = {{id(p) for p in moe.expert_parameters({target})}}")
            add(f"{ind}DDP._set_params_and_buffers_to_ignore_for_model(")
            add(f"{ind}    {target}, [n for n, p in {target}.named_parameters() if id(p) in expert_ids])")
            if chunked:
                add("chunks = [DDP(ch, process_group=dp_group, gradient_as_bucket_view=True)")
                add("          for ch in chunks]")
            else:
                add("model = DDP(model, process_group=dp_group, gradient_as_bucket_view=True)")
            if comp != "none":
                add(f'# compressed: ddp.comm_hook(dp_group, "{comp}", hierarchical=True) on each DDP module')
        else:
            quant = {"int8": "comm.Int8Quantizer()", "int4": "comm.Int4Quantizer()"}.get(comp)
            extra = f", grad_compression={quant}, hierarchical=True" if quant else ""
            add(f"{ind}for block in {target}.layers:   # ZeRO-{c.zero} for the dense weights")
            add(f"{ind}    block.attention = zero.shard(block.attention, dp_group, stage={c.zero}{extra})")
            add("# (likewise the embedding, the norms and the output projection)")
        add("# after each backward, the experts' gradients over their replicas:")
        add(
            f"# moe.reduce_gradients({target}, dp_group, expert_dp_group, dense=False)"
            + (" for each chunk" if chunked else "")
        )
    params = "[p for ch in chunks for p in ch.parameters()]" if chunked else "model.parameters()"
    add(
        f"optimizer = torch.optim.AdamW({params})"
        if model.optimizer == "adam"
        else f"optimizer = torch.optim.SGD({params}, lr=0.1, momentum=0.9)"
    )
    b = model.batch // (c.dp * c.micro_batches)
    if c.pp > 1:
        if chunked:
            add(
                f"stages = [PipelineStage(ch, k * {c.pp} + stage_index, {c.pp * c.interleave}, "
                'torch.device("cuda"), group=pp_group)'
            )
            add("          for k, ch in enumerate(chunks)]")
            add(f"schedule = ScheduleInterleaved1F1B(stages, n_microbatches={c.micro_batches},")
            add("                                   loss_fn=loss_fn)")
        else:
            add(f'stage = PipelineStage(model, stage_index, {c.pp}, torch.device("cuda"), group=pp_group)')
            add(f"schedule = Schedule1F1B(stage, n_microbatches={c.micro_batches}, loss_fn=loss_fn)")
        add(
            f"# each step: {model.batch // c.dp} sequences per data-parallel rank in {c.micro_batches} "
            f"micro-batches of {b}: schedule.step(ids) on the first rank, schedule.step(target=labels, "
            "losses=losses, return_outputs=False) on the last (the logits are not kept), schedule.step() "
            "between; then optimizer.step()"
        )
    elif c.micro_batches > 1:
        add(
            f"# each step: {c.micro_batches} micro-batches of {b} sequence{'s' if b > 1 else ''}, gradients "
            "accumulated (no_sync() on all but the last), then optimizer.step()"
        )
    return "\n".join(L)
