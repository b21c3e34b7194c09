"""The model of adaptive compression: a pure function of measurements. :func:`decide` gives, per
bucket, the choice among exact and the candidates that the measured links (bandwidth and latency
per level), codec costs, host CPU, overlap windows and estimated errors predict to make the step
shortest, within an error budget, with its reason; :func:`fit_levels`, :func:`fit_link` and
:func:`contention` turn raw samples into those measurements. Nothing here measures or
communicates: the same :class:`Measurements` give the same decisions on every rank (controller.py
measures and exchanges them). docs/design/compression.md ("Adaptive compression") gives the
model and its reasons.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional, Sequence

import torch

from ..compressors import Cast, Compressor

EXACT = "exact"
CANDIDATES = (EXACT, "bf16", "fp16", "int8", "int4", "topk")
DEFAULT_CANDIDATES = (EXACT, "bf16", "int8", "int4", "topk")
IN_HOST, ACROSS_HOSTS = "in_host", "across_hosts"
LEVELS = (IN_HOST, ACROSS_HOSTS)
ALL_REDUCE, REDUCE_SCATTER = "all_reduce", "reduce_scatter"
# The caller's other collectives on the link (Adaptive.share_link): exact bytes this rank sends,
# flat over the group or inside its host. They time the link as the buckets' exact calls do.
OTHER, OTHER_IN_HOST = "other", "other_in_host"
# What each collective can carry. A reduce-scatter sends every rank one piece of the same size
# (the sharded wrapper's qgZ: an all-to-all of quantized or 16-bit pieces, summed in float32);
# top-k's selections differ from rank to rank, so it travels by all-gather, in all-reduces only.
COLLECTIVE_CANDIDATES = {ALL_REDUCE: CANDIDATES, REDUCE_SCATTER: (EXACT, "bf16", "fp16", "int8", "int4")}

# Codec work of one compressed all-reduce, in encode + decode round trips of the bucket (what the
# probe times). A block quantizer encodes the input, decodes and sums the n chunks it owns,
# re-encodes its reduced chunk and decodes the gathered result: two round trips of kernels, and as
# much again in the fused path's staging copies and phase waits, so 4; a cast rounds once, sums the
# 16-bit values in float32 and copies back (2); top-k selects, then scatters n selections (2).
# Measured on the Xeon VM (docs/results/2026-11-26-xeon-2vcpu.md, "Adaptive compression"): a 16 MB
# int8 all-reduce on one host took 24.5 ms against 7.6 ms exact, 4 round trips (21 ms) + its bytes.
# Each round's real calls then correct the estimate (Adaptive's codec correction).
# A reduce-scatter encodes each rank's bucket once and decodes the n pieces it receives (n x 1/n
# of the bucket): one round trip (1), staged straight from the gradient. Per collective.
CODEC_PASSES = {ALL_REDUCE: {"bf16": 2.0, "fp16": 2.0, "int8": 4.0, "int4": 4.0, "topk": 2.0},
                REDUCE_SCATTER: {"bf16": 1.0, "fp16": 1.0, "int8": 1.0, "int4": 1.0}}
# Roundings the reduced gradient carries: in an all-reduce the block quantizers round each rank's
# input and the reduced chunk, a cast and top-k round once (the sum is float32); in a
# reduce-scatter only each rank's input is rounded (the float32 sum is the result). Independent
# errors add in quadrature, so the estimate is the probe's relative error times sqrt(roundings),
# with no credit for the averaging over ranks (which only shrinks it): an upper estimate, as a
# budget wants.
ROUNDINGS = {ALL_REDUCE: {"bf16": 1, "fp16": 1, "int8": 2, "int4": 2, "topk": 1},
             REDUCE_SCATTER: {"bf16": 1, "fp16": 1, "int8": 1, "int4": 1}}
# Message rounds per call and level (each costs the level's latency): the exact all-reduce is one;
# the compressed ones an all-to-all and an all-gather (a cast over a group: the same two phases);
# a reduce-scatter, exact or an all-to-all of pieces, one.
ROUNDS = {ALL_REDUCE: {EXACT: 1, "bf16": 2, "fp16": 2, "int8": 2, "int4": 2, "topk": 2},
          REDUCE_SCATTER: {EXACT: 1, "bf16": 1, "fp16": 1, "int8": 1, "int4": 1},
          OTHER: {EXACT: 1}, OTHER_IN_HOST: {EXACT: 1}}
# Ranks on one host reduce through shared memory (or NVLink), which moves a byte for less than a
# codec encodes and decodes it: DESIGN section 8's "exact inside a host". Measured on the Xeon VM
# (docs/results/2026-11-26-xeon-2vcpu.md, "Adaptive compression"): 1 MB all-reduced exactly in
# 0.23 ms, with bf16 / int8 / int4 in 0.43 / 0.58 / 0.57 ms; 16 MB in 7.6 ms against 15.8-24.5 ms.
# A busy 2-core machine stretches the exact calls as much as the codecs, so measuring cannot be
# trusted to see it.
ONE_HOST_REASON = "exact: every rank is on one host, where memory moves a byte faster than a codec encodes it"
# Latency assumed where no call was measured.
DEFAULT_LATENCY_S = 100e-6
# Elements of a bucket the probe encodes and decodes: 4 MiB of float32, past a 2-vCPU VM's L2, so
# the per-element cost is the streaming cost a 25 MB bucket pays, at ~10 ms per probe for the five
# candidates (measured on the Xeon of docs/results/2026-11-26-xeon-2vcpu.md).
PROBE_ELEMS = 1 << 20
# A plan must beat the current one by this much (seconds) besides the hysteresis fraction: gains
# under a timer's noise on a loaded machine are not gains.
MIN_GAIN_S = 50e-6
# The most host CPU a call is taken to cost whatever its size (waking a thread, system calls, a
# callback), before its bytes are charged anything: measured between two simulated hosts on a
# 2-vCPU EPYC under load ~12 (docs/results/2026-11-28-epyc-2vcpu-adaptive.md), braid's exact
# all-reduce of 4-64 KiB used 50-90 us of its threads' CPU per call and gloo's 0.5-0.8 ms, where
# 25 MB cost 26-28 ms (~1 ns per byte) either way. A step's CPU beyond this per message round (or
# beyond the round's fitted latency, if less) is its bytes'.
CALL_CPU_S = 1e-3
# What each rank appends to its measurement vector about the host CPU its transfers cost: CPU
# seconds per byte sent in the host and across hosts (sending and receiving together: the calls
# are symmetric), then its kernel's identity, the machine's cores, the cores it may run on and
# torch's compute threads (from which the round finds whether a rank has a core to spare).
CPU_FIELDS = 6


# ----------------------------------------------------------------------------------------------
# The decision, a pure function of the measurements.


@dataclass(frozen=True)
class Level:
    """One level of the links a bucket crosses: bandwidth in bytes/s (per rank, as a point-to-point
    transport moves a call's bytes) and latency per message round in seconds."""

    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class Layout:
    """How the ranks sit: ``world`` ranks on ``hosts`` hosts of ``local`` ranks each.
    ``hierarchical``: compressed all-reduces are exact inside a host and compressed across;
    ``exact_hierarchical``: the exact all-reduce also reduces inside the host first (braid's
    communicator across hosts) rather than over all ranks flat (a process group)."""

    world: int
    hosts: int
    local: int
    hierarchical: bool = False
    exact_hierarchical: bool = False


@dataclass(frozen=True)
class BucketMeasure:
    """One bucket: ``numel`` elements of ``elem_size`` bytes, ``window_s`` from its being ready to
    the end of the backward, the estimated relative error of each candidate on it, the
    ``collective`` that carries it (ALL_REDUCE, or REDUCE_SCATTER: ``numel`` the whole input), and
    ``link_busy_s``: how long the link spends in the window on the caller's other collectives
    (the sharded wrapper's parameter all-gathers of the backward, :meth:`Adaptive.share_link`),
    which the bucket's transfer cannot hide behind."""

    key: Hashable
    numel: int
    elem_size: int
    window_s: float
    error: Mapping[str, float] = field(default_factory=dict)
    collective: str = ALL_REDUCE
    link_busy_s: float = 0.0

    @property
    def free_s(self) -> float:
        """The window's time the link has for this bucket and those after it (what the reasons
        compare its exact transfer with)."""
        return max(0.0, self.window_s - self.link_busy_s)


@dataclass(frozen=True)
class Measurements:
    """What a decision round knows: the layout, each level's link, each candidate's codec cost
    (seconds per element, one encode + decode round trip on this device) and the buckets.

    ``host_cpu_s_per_byte``: per level, the host CPU seconds a rank spends per byte it sends
    (sending and receiving together: a TCP transfer's copies and protocol work in the kernel, a
    shared-memory transfer's copies); ``cpu_contention``: the share of that CPU time taken from
    the cores the backward computes on (1: no core to spare, as with one rank per core; 0: a
    spare core per rank). Empty and 0 where not measured (on a GPU the transfers' host CPU does
    not compete with the backward)."""

    layout: Layout
    levels: Mapping[str, Level]
    codec_s_per_elem: Mapping[str, float]
    buckets: Sequence[BucketMeasure]
    host_cpu_s_per_byte: Mapping[str, float] = field(default_factory=dict)
    cpu_contention: float = 0.0


@dataclass(frozen=True)
class Decision:
    """The choice for one bucket and why: ``predicted_s`` is the step overhead the plan is predicted
    to cost (exposed transfer + codec time, the whole step's), ``exact_s`` the same with this
    bucket exact."""

    choice: str
    reason: str
    predicted_s: float = 0.0
    exact_s: float = 0.0


def piece_bytes(q: Compressor, per: int) -> int:
    """Bytes of one reduce-scatter piece of ``per`` elements encoded by ``q`` (a block quantizer's
    payload, or 16-bit values)."""
    if isinstance(q, Cast):
        return per * torch.finfo(q.dtype).bits // 8
    return q.wire_bytes(q.chunk_elems(per, 1))


def level_bytes(name: str, q: Optional[Compressor], numel: int, elem_size: int, layout: Layout,
                collective: str = ALL_REDUCE) -> tuple:
    """(bytes in the host, bytes across hosts) one rank moves in an all-reduce (or reduce-scatter)
    of the bucket with candidate ``name`` (``q`` its compressor, None for exact)."""
    n, hosts, local = layout.world, layout.hosts, layout.local
    if n == 1:
        return 0.0, 0.0
    if collective == OTHER_IN_HOST:  # ``numel`` bytes, inside the host
        return float(numel * elem_size), 0.0
    if collective == OTHER:  # ``numel`` bytes sent flat over the group
        share_in = (local - 1) / (n - 1)
        return numel * elem_size * share_in, numel * elem_size * (1 - share_in)
    if collective == REDUCE_SCATTER:
        return _reduce_scatter_bytes(q, numel, elem_size, layout)
    per = -(-numel // local)
    if q is None and layout.exact_hierarchical or q is not None and layout.hierarchical:
        in_host = 2.0 * (local - 1) * per * elem_size  # reduce-scatter + all-gather inside the host
        if q is None:
            across = 2.0 * (hosts - 1) * per * elem_size / hosts if hosts > 1 else 0.0
        else:
            across = float(q.wire_stats(numel, elem_size, hosts, local).sent) - in_host
        return in_host, across
    # Flat over every rank: of the n - 1 peers a rank sends to, local - 1 share its host.
    if q is None:
        total = 2.0 * (n - 1) * numel * elem_size / n
    else:
        total = float(q.wire_stats(numel, elem_size, n).sent)
    share_in = (local - 1) / (n - 1)
    return total * share_in, total * (1 - share_in)


def _reduce_scatter_bytes(q: Optional[Compressor], numel: int, elem_size: int, layout: Layout) -> tuple:
    """level_bytes of a reduce-scatter of ``numel`` elements into pieces of numel / world. Exact:
    one rank sends world - 1 dense pieces, over the group flat. Compressed: an all-to-all of
    encoded pieces; on a hierarchical layout the host first sums its ranks' inputs exactly (its
    own reduce-scatter of every piece, local - 1 host slices of ``hosts`` pieces) and only the
    ``hosts`` - 1 pieces across hosts are encoded."""
    n, hosts, local = layout.world, layout.hosts, layout.local
    per = -(-numel // n)
    if q is not None and layout.hierarchical:
        return float((local - 1) * hosts * per * elem_size), float((hosts - 1) * piece_bytes(q, per))
    total = float((n - 1) * (per * elem_size if q is None else piece_bytes(q, per)))
    share_in = (local - 1) / (n - 1)
    return total * share_in, total * (1 - share_in)


def transfer_s(name: str, q: Optional[Compressor], b: BucketMeasure, m: Measurements) -> float:
    """Predicted seconds the link spends on the bucket's collective with candidate ``name``."""
    by_level = level_bytes(name, q, b.numel, b.elem_size, m.layout, b.collective)
    t = 0.0
    for level, nbytes in zip(LEVELS, by_level):
        if nbytes > 0:
            link = m.levels[level]
            t += ROUNDS[b.collective][name] * link.latency_s + nbytes / link.bytes_per_s
    return t


def host_cpu_s(name: str, q: Optional[Compressor], b: BucketMeasure, m: Measurements) -> float:
    """Predicted seconds the bucket's transfer with candidate ``name`` takes from the backward's
    cores while both run: its bytes per level times the host CPU per byte, times the share of it
    the backward's cores pay (:class:`Measurements`)."""
    if m.cpu_contention <= 0 or not m.host_cpu_s_per_byte:
        return 0.0
    by_level = level_bytes(name, q, b.numel, b.elem_size, m.layout, b.collective)
    return m.cpu_contention * sum(nbytes * m.host_cpu_s_per_byte.get(level, 0.0)
                                  for level, nbytes in zip(LEVELS, by_level))


def codec_s(name: str, b: BucketMeasure, m: Measurements) -> float:
    """Predicted seconds of encoding and decoding the bucket with candidate ``name`` (0 for exact);
    on a hierarchical layout only this rank's slice (1 / local of the bucket) is compressed."""
    if name == EXACT:
        return 0.0
    numel = -(-b.numel // m.layout.local) if m.layout.hierarchical else b.numel
    return CODEC_PASSES[b.collective][name] * m.codec_s_per_elem[name] * numel


def plan_cost(m: Measurements, plan: Mapping[Hashable, str], compressors: Mapping[str, Optional[Compressor]]
              ) -> float:
    """Predicted step overhead of ``plan`` (bucket key -> candidate), in seconds, from the end of
    the backward without communication.

    The buckets' collectives run one after the other, in the order the buckets become ready (the
    order of their windows), on one engine (braid's progress thread, a group's issuing thread or
    stream): bucket i starts at max(its ready time, the end of bucket i - 1) and holds the engine
    for its codec time and then its transfer time (a compressed call encodes, sends, decodes and
    sums in turn: the next bucket waits for all of it). Codec kernels run on the cores (or the GPU)
    the backward computes on: one that starts before the backward ends pushes the rest of the
    backward, and the buckets it has still to make ready, later by its time. A transfer's host
    CPU (:func:`host_cpu_s`) is spread over the transfer: the part of the transfer that runs
    while the backward still computes pushes the backward by that share of it. The overhead is
    whichever ends last, the engine or the pushed backward.

    The caller's other traffic (``link_busy_s``: the sharded wrapper's parameter gathers) queues on
    the same engine: what was issued after bucket i and before bucket i + 1 (the difference of
    their ``link_busy_s``) follows bucket i's call, and the backward needs it when it reaches
    bucket i + 1 (a ZeRO-3 backward prefetches the gather of the unit after the next): where it
    is not there yet, the backward waits, and everything after it runs that much later."""
    order = sorted(m.buckets, key=lambda b: -b.window_s)
    engine_free = -math.inf
    pushed = 0.0  # how much later the backward runs than without communication
    for i, b in enumerate(order):
        name = plan[b.key]
        ready = -b.window_s + pushed
        start = max(ready, engine_free)
        codec = codec_s(name, b, m)
        if start < pushed:  # the backward is still computing
            pushed += codec
        sending = start + codec
        transfer = transfer_s(name, compressors[name], b, m)
        cpu = host_cpu_s(name, compressors[name], b, m)
        if cpu > 0 and sending < pushed and transfer > 0:  # its bytes' CPU, while the backward computes
            pushed += cpu * min(1.0, (pushed - sending) / transfer)
        engine_free = sending + transfer
        after = order[i + 1] if i + 1 < len(order) else None
        follow = b.link_busy_s - (after.link_busy_s if after is not None else 0.0)
        if follow > 0:
            engine_free += follow
            needed = -after.window_s + pushed if after is not None else pushed
            pushed += max(0.0, engine_free - needed)
    return max(0.0, engine_free, pushed)


def carried(b: BucketMeasure, candidates: Sequence[str]) -> list:
    """The candidates the collective of ``b`` can carry (COLLECTIVE_CANDIDATES), in order."""
    return [c for c in candidates if c in COLLECTIVE_CANDIDATES[b.collective]]


def admissible(b: BucketMeasure, candidates: Sequence[str], error_budget: float) -> list:
    """The candidates (of those its collective carries) whose estimated error on ``b`` is within
    the budget (exact always is)."""
    return [c for c in carried(b, candidates) if c == EXACT or b.error.get(c, math.inf) <= error_budget]


def decide(m: Measurements, current: Mapping[Hashable, str], *, candidates: Sequence[str],
           error_budget: float, hysteresis: float, compressors: Mapping[str, Optional[Compressor]]) -> dict:
    """The choice per bucket (key -> :class:`Decision`) from the measurements alone: the same on
    every rank for the same ``m``.

    The plan minimizes :func:`plan_cost` over the candidates within ``error_budget`` that each
    bucket's collective carries (top-k not in reduce-scatters): coordinate descent from the
    current plan, buckets in ready order, two sweeps, candidates in the order given (exact
    first: a tie keeps the cheaper codec). The new plan replaces the current one only
    when it is predicted faster by more than ``hysteresis`` of the current plan's overhead (and
    by MIN_GAIN_S); a current choice that the error budget now rules out is replaced anyway.
    A bucket whose exact transfer hides in its window stays exact unless its bytes' host CPU
    (charged where no core is spare) exceeds what a codec costs: otherwise compressing it only adds
    codec time. Ranks all on one host stay exact (ONE_HOST_REASON).
    """
    keys = [b.key for b in m.buckets]
    if m.layout.hosts == 1:  # every byte moves through memory: no codec encodes it for less
        return {b.key: Decision(EXACT, ONE_HOST_REASON) for b in m.buckets}
    allowed = {b.key: admissible(b, candidates, error_budget) for b in m.buckets}
    cur = {k: current.get(k, EXACT) for k in keys}
    forced = {k for k in keys if cur[k] not in allowed[k]}
    start = {k: (EXACT if k in forced else cur[k]) for k in keys}
    plan = dict(start)
    best = plan_cost(m, plan, compressors)
    for _ in range(2):
        for k in sorted(keys, key=lambda k: -next(b.window_s for b in m.buckets if b.key == k)):
            for name in allowed[k]:
                trial = {**plan, k: name}
                cost = plan_cost(m, trial, compressors)
                if cost < best * (1 - 1e-9):
                    plan, best = trial, cost
    current_cost = plan_cost(m, start, compressors)
    gain = current_cost - best
    switch = bool(forced) or (gain > hysteresis * current_cost and gain > MIN_GAIN_S)
    chosen = plan if switch else start
    cost = plan_cost(m, chosen, compressors)
    out = {}
    for b in m.buckets:
        k, name = b.key, chosen[b.key]
        exact_cost = plan_cost(m, {**chosen, k: EXACT}, compressors)
        ruled_out = [c for c in carried(b, candidates) if c not in allowed[k]]
        why = _reason(b, name, m, compressors, cost, exact_cost, switch, cur[k], gain, current_cost)
        if ruled_out:
            why += "; over the error budget: " + ", ".join(f"{c} ({b.error.get(c, math.inf):.3g})"
                                                         for c in ruled_out)
        out[k] = Decision(name, why, cost, exact_cost)
    return out


def _reason(b: BucketMeasure, name: str, m: Measurements, compressors: Mapping, cost: float,
            exact_cost: float, switched: bool, previous: str, gain: float, current_cost: float) -> str:
    exact_t = transfer_s(EXACT, None, b, m)
    busy = f" ({b.link_busy_s * 1e3:.3g} ms of it the link's other traffic)" if b.link_busy_s > 0 else ""
    exact_cpu = host_cpu_s(EXACT, None, b, m)
    cpu = f" and {exact_cpu * 1e3:.3g} ms of the backward's CPU" if exact_cpu > 0 else ""
    head = (f"exact transfer {exact_t * 1e3:.3g} ms{cpu}, window {b.window_s * 1e3:.3g} ms{busy}; "
            f"step overhead {cost * 1e3:.3g} ms")
    if name == EXACT:
        if exact_t <= b.free_s:
            text = f"exact: its transfer hides in the window ({head})"
        else:
            text = f"exact: no candidate predicted faster ({head})"
    else:
        q = compressors[name]
        cpu = f" + {host_cpu_s(name, q, b, m) * 1e3:.3g} ms of CPU" if exact_cpu > 0 else ""
        text = (f"{name}: {head} against {exact_cost * 1e3:.3g} ms with this bucket exact (transfer "
                f"{transfer_s(name, q, b, m) * 1e3:.3g} ms + codec {codec_s(name, b, m) * 1e3:.3g} ms{cpu})")
    if not switched and previous == name and gain > 0:
        text += (f"; kept: a new plan would gain {gain * 1e3:.3g} ms of {current_cost * 1e3:.3g} ms, "
                 "under the hysteresis")
    return text


# ----------------------------------------------------------------------------------------------
# Measuring: the link per level from the hook's own calls, the codecs by a probe.


def fit_levels(samples: Sequence[tuple]) -> dict:
    """Bandwidth per level (bytes/s; NaN where no sample crossed it, inf where the bytes took no
    measurable time) from samples (bytes in the host, bytes across hosts, seconds on the wire).
    Least squares of t = x_in / bw_in + x_across / bw_across; where the samples cannot tell the
    levels apart (every sample the same mix of the two, as exact-only steps are) or the fit is not
    positive, one rate for both."""
    s_in = sum(x for x, _, _ in samples)
    s_ac = sum(y for _, y, _ in samples)
    s_t = sum(t for _, _, t in samples)
    nan = math.nan
    if s_t <= 0:
        return {IN_HOST: math.inf if s_in else nan, ACROSS_HOSTS: math.inf if s_ac else nan}
    if s_ac == 0:
        return {IN_HOST: s_in / s_t if s_in else nan, ACROSS_HOSTS: nan}
    if s_in == 0:
        return {IN_HOST: nan, ACROSS_HOSTS: s_ac / s_t}
    a11 = sum(x * x for x, _, _ in samples)
    a12 = sum(x * y for x, y, _ in samples)
    a22 = sum(y * y for _, y, _ in samples)
    b1 = sum(x * t for x, _, t in samples)
    b2 = sum(y * t for _, y, t in samples)
    det = a11 * a22 - a12 * a12
    if det > 1e-3 * a11 * a22:  # the mixes differ enough (angle between them > ~2 degrees)
        inv_in, inv_ac = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if inv_in > 0 and inv_ac > 0:
            return {IN_HOST: 1 / inv_in, ACROSS_HOSTS: 1 / inv_ac}
    rate = (s_in + s_ac) / s_t
    return {IN_HOST: rate, ACROSS_HOSTS: rate}


def fit_link(samples: Sequence[tuple]) -> tuple:
    """(latency per message round and level, bandwidth per level) from the calls' samples (bytes in
    the host, bytes across hosts, message rounds, seconds without codec time).

    The latency is the intercept of a least-squares line of time against bytes where the calls'
    sizes differ (at least 2x), held within [0, the fastest call's time per round]; where they do
    not, the fastest call's time per round: a per-call cost that bytes cannot explain is not
    counted as bandwidth, so small equal buckets on a busy machine read as a fast link (that
    compression could not speed up) rather than a slow one."""
    if not samples:
        return math.nan, {IN_HOST: math.nan, ACROSS_HOSTS: math.nan}
    sizes = [x + y for x, y, _, _ in samples]
    floor = min(t / r for _, _, r, t in samples)
    latency = floor
    if len(samples) >= 2 and max(sizes) > 2 * min(sizes):
        # u = a r + b X: the 2x2 normal equations.
        rr = sum(r * r for _, _, r, _ in samples)
        rx = sum(r * x for (_, _, r, _), x in zip(samples, sizes))
        xx = sum(x * x for x in sizes)
        rt = sum(r * t for _, _, r, t in samples)
        xt = sum(x * t for (_, _, _, t), x in zip(samples, sizes))
        det = rr * xx - rx * rx
        if det > 0:
            latency = min(floor, max(0.0, (rt * xx - xt * rx) / det))
    wire = [(x, y, max(0.0, t - r * latency)) for x, y, r, t in samples]
    return latency, fit_levels(wire)


def contention(kernels: Sequence[float], machine_cores: Sequence[float], usable_cores: Sequence[float],
               threads: Sequence[float]) -> float:
    """The share of a transfer's host CPU that comes out of the backward's cores
    (:attr:`Measurements.cpu_contention`), from each rank's kernel identity, its machine's cores,
    the cores it may run on and torch's compute threads: ranks on one kernel share its cores, so a
    rank has min(its cores, the machine's cores / the ranks on its kernel) of them; what is left
    after its compute threads is spare for the communication (a whole core: nothing taken from
    the backward). The worst rank's share, which every rank's step waits for."""
    sharing: dict = {}
    for k in kernels:
        sharing[k] = sharing.get(k, 0) + 1
    shares = [min(1.0, max(0.0, 1.0 - (min(usable, machine / sharing[k]) - t)))
              for k, machine, usable, t in zip(kernels, machine_cores, usable_cores, threads)]
    return max(shares, default=0.0)
