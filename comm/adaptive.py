"""Adaptive gradient compression: per bucket, the choice among exact, bf16, int8, int4 and top-k that
braid's own measurements (link per level, codec cost on this device, overlap window) predict to
make the step shortest, within an error budget, identical on every rank.

    q = comm.Adaptive()                                  # candidates, error_budget=0.3, interval=8
    state, hook = ddp.comm_hook(c, compression="auto")   # or compression=q
    state.decisions()                                    # {bucket: Decision(choice, reason, ...)}
    model = fsdp.shard(model, c, grad_compression=q)     # the sharding's gradient reduce-scatters
    q.decisions()

The engine is split in two. :func:`decide` is a pure function of :class:`Measurements` (each
level's bandwidth and latency, each candidate's codec seconds per element, the host CPU a
transfer's bytes cost and how much of it the backward's cores pay, each bucket's size, window,
estimated error and collective) and the current choices; :class:`Adaptive` is a
compressor that measures, every ``interval`` steps all-gathers one small vector of measurements
(so every rank decides from the same numbers), calls :func:`decide` and runs each bucket through
the compressor chosen for it: all-reduces (the DDP hook, compressed all-reduces) and the sharded
wrapper's reduce-scatters (:meth:`Adaptive.reduce_scatter`). docs/design/compression.md ("Adaptive
compression") gives the model and its reasons.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, Union

import torch

from . import group_carrier
from .compression import Cast, CompressedWork, Compressor, check_tensor, compressor, copy_back
from .device_kernels import kernels_for
from .group import Group, GroupWork
from .group_carrier import GroupCarrier, HostGroups
from .hosts import host_identity
from .vocabulary import AVG, Op, compressed_op_code
from .wire import BraidCollectives, CompressionHost, WireStats
from .work import Work

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


def _other_threads_cpu() -> float:
    """CPU seconds (user and system) this process's threads other than the calling one have used.
    With torch computing on the calling thread alone, they are the communication's: braid's
    progress thread, a group's issuing thread, gloo's, and the kernel's work in their system
    calls (which, without IRQ time accounting, includes the network stack's softirq work)."""
    return time.process_time() - time.thread_time()


def _cpu_layout() -> list:
    """This rank's [kernel identity, machine's cores, cores it may run on, torch's compute
    threads], for :func:`contention`. Processes on one kernel (simulated hosts in network
    namespaces too) share its cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            kernel = f.read().strip()
    except OSError:
        kernel = socket.gethostname()
    machine = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    return [float(zlib.crc32(kernel.encode())), float(machine), float(usable), float(torch.get_num_threads())]


def _probe(name: str, q: Compressor, x: torch.Tensor, scratch: dict) -> tuple:
    """One encode + decode round trip of ``x`` (float32, 1-D) with candidate ``name``'s own kernels,
    twice, into buffers kept in ``scratch`` (as the compressors keep theirs): (the faster run's
    seconds, the relative error of the decoded values). Leaves ``x`` as it was."""
    kern = kernels_for(x.device)
    numel = x.numel()
    bufs = scratch.get(name)
    if bufs is None or bufs[0].numel() != numel or bufs[0].device != x.device:
        dtype = q.dtype if name in ("bf16", "fp16") else torch.float32
        bufs = scratch[name] = [torch.empty(numel, dtype=torch.float32, device=x.device),
                                torch.empty(numel, dtype=dtype, device=x.device), None]
    y, sent, payload = bufs
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best = math.inf
    for _ in range(2):  # the first run may fault its buffers' pages in: the second is the steady cost
        sync()
        t0 = time.perf_counter()
        if name in ("bf16", "fp16"):
            kern.cast(x, None, sent)
            y.copy_(sent)
        elif name == "topk":
            values, indices = kern.top_k(x, q.k(numel))
            kern.scatter_add(y.zero_(), indices, values)
        else:
            chunk = q.chunk_elems(numel, 1)  # whole blocks, zero padded
            payload = bufs[2] = q.encode(x, None, 1, 0, chunk, 1, out=payload)
            q.decode(payload, y, chunk)
        sync()
        best = min(best, time.perf_counter() - t0)
    norm = float(x.norm())
    err = float((y - x).norm()) / norm if norm > 0 else 0.0
    return best, err if math.isfinite(err) else math.inf


# ----------------------------------------------------------------------------------------------
# The compressor.


class DeviceMarks:
    """Timing marks on a CUDA device: events recorded on its current stream, read once they have
    completed. A CUDA call's host-side moments (when its kernels were enqueued) say nothing of
    when the device ran them, so a call on a GPU is timed by the device: issued when the stream
    reaches it (its gradient is ready), done when the collective's result is ready on the stream
    its future's callbacks run on (synchronized with the collective's kernels)."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def seconds(origin: Any, event: Any) -> float:
        """Seconds from ``origin`` to ``event`` on the device (both completed)."""
        return origin.elapsed_time(event) / 1e3

    @staticmethod
    def wait(event: Any) -> None:
        event.synchronize()


def _marks_for(device: Optional[torch.device]) -> Optional[DeviceMarks]:
    """The device's marks (CUDA), or None where the host's clock times the calls (the CPU, or a
    work whose device the caller did not name: a CPU work)."""
    return DeviceMarks(device) if device is not None and device.type == "cuda" else None


class _Call:
    """One collective of a step, for the link fit: what went, by which collective, when it was
    issued and finished. ``work``: a braid work that knows when it completed (``completed_at()``,
    on time.perf_counter()'s clock), read when asked; other calls are stamped by a callback; calls on
    a CUDA device by marks on the device (:class:`DeviceMarks`), read at the next round."""

    __slots__ = ("key", "numel", "elem_size", "choice", "issued", "collective", "done", "window", "work",
                 "marks", "issued_mark", "done_mark", "end_mark", "shared")

    def __init__(self, key: Hashable, numel: int, elem_size: int, choice: str, issued: float,
                 collective: str = ALL_REDUCE, marks: Optional[DeviceMarks] = None):
        self.key, self.numel, self.elem_size, self.choice, self.issued = key, numel, elem_size, choice, issued
        self.collective = collective
        self.done: Optional[float] = None
        self.window: Optional[float] = None
        self.work: Any = None
        # On a device: its marks, issued now, done and the end of the step's backward later
        # (read into issued / done / window at the next round).
        self.marks = marks
        self.issued_mark = marks.mark() if marks is not None else None
        self.done_mark: Any = None
        self.end_mark: Any = None
        self.shared = (0.0, 0.0)  # the caller's other bytes after this call in its step: (flat, in-host)

    def stamp(self, _fut: Any = None) -> None:
        if self.marks is not None:
            # On a device: a future's callback runs on a stream synchronized with the call's
            # kernels, so a mark recorded now is reached when the call's result is ready.
            self.done_mark = self.marks.mark()
        else:
            self.done = time.perf_counter()

    def finished(self) -> Optional[float]:
        """When the call completed (None: not yet)."""
        if self.done is None and self.work is not None:
            self.done = self.work.completed_at()
        return self.done


class Adaptive(Compressor):
    """Per bucket (per ``key``), the candidate that minimizes the step, re-decided every
    ``interval`` steps from braid's measurements, the same on every rank.

    Args:
        candidates: names among "exact", "bf16", "fp16", "int8", "int4", "topk" (each with its
            defaults: ``Cast``, ``Int8Quantizer()``, ``Int4Quantizer()``, ``TopK(0.01)``).
        error_budget: the largest estimated relative error of a reduced bucket a candidate may
            bring (the probe's round-trip error on the bucket times sqrt(roundings)); the default
            0.3 admits int4 (about 0.23 on Gaussian gradients) and rules out top-k 1% (about 1.0).
        interval: steps between decision rounds (each all-gathers one small vector); decisions
            change at most this often.
        hysteresis: a new plan must be predicted faster than the current one by this fraction of
            the current plan's overhead.
        link: bandwidths (bytes/s) that replace the measured ones, per level: {"in_host": ...,
            "across_hosts": ...}; for a network you know (or a test).
        error_feedback, warmup_steps, seed: as every compressor's; the residual of a bucket follows
            it from one compressor to the next, and is added to the bucket at its first exact
            all-reduce (or reduce-scatter) after a switch to exact (nothing that was dropped is
            lost).

    Steps: the DDP hook and the sharded wrapper tell it where a step ends (:meth:`end_step`);
    used directly, call ``end_step()`` after each step's last all-reduce. The first
    ``warmup_steps`` steps are exact and measured; the first decision round is at step
    ``warmup_steps``. Over a braid communicator or any process group (gloo, NCCL, HostGroups:
    exact inside a host, the choice across); as the sharded wrapper's ``grad_compression``, its
    gradient reduce-scatters (:meth:`reduce_scatter`: exact, bf16, fp16, int8 or int4). A caller
    whose backward runs other collectives on the same group tells it of them (:meth:`share_link`)
    and of its waits on them (:meth:`stalled`), as the sharded wrapper does for its gathers."""

    def __init__(self, candidates: Sequence[str] = DEFAULT_CANDIDATES, *, error_budget: float = 0.3,
                 interval: int = 8, hysteresis: float = 0.1, link: Optional[Mapping[str, float]] = None,
                 error_feedback: bool = True, warmup_steps: int = 2, seed: int = 0):
        super().__init__(error_feedback=error_feedback, warmup_steps=warmup_steps, seed=seed)
        candidates = tuple(candidates)
        unknown = [c for c in candidates if c not in CANDIDATES]
        if unknown or not candidates or len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must be distinct names among {', '.join(CANDIDATES)}, "
                             f"got {candidates}")
        if EXACT not in candidates:
            candidates = (EXACT, *candidates)
        for name, value in (("error_budget", error_budget), ("hysteresis", hysteresis)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be an int >= 1, got {interval!r}")
        link = dict(link or {})
        if set(link) - set(LEVELS) or any(not (isinstance(v, (int, float)) and v > 0) for v in link.values()):
            raise ValueError(f"link maps 'in_host' and/or 'across_hosts' to bytes per second > 0, "
                             f"got {link!r}")
        self.candidates = candidates
        self.error_budget = float(error_budget)
        self.interval = interval
        self.hysteresis = float(hysteresis)
        self.link = link
        self._compressors: dict[str, Optional[Compressor]] = {EXACT: None}
        for name in candidates[1:]:
            made = compressor(name)  # the named default, with this compressor's common settings
            self._compressors[name] = type(made)(**{**made._config(), "error_feedback": error_feedback,
                                                    "warmup_steps": warmup_steps, "seed": seed})
        self._decisions: dict[Hashable, Decision] = {}
        self._reset_measuring()

    def _reset_measuring(self) -> None:
        """What is measured, not state: a resumed run measures afresh."""
        self._steps = 0                      # steps ended (end_step) since built or loaded
        self._next_round = self.warmup_steps if not self._decisions else self.warmup_steps + self.interval
        self._rounds = 0
        self._step_calls: list[_Call] = []   # this step's calls
        self._shared: list[tuple] = []       # this step's other traffic since its first call (share_link)
        self._other_calls: list[_Call] = []  # ... those of it with a work: link samples
        self._stalls: list[tuple] = []       # this step's waits on other traffic: (end, seconds)
        self._calls_since: list[_Call] = []  # calls of the steps since the last round
        self._errors: dict[Hashable, dict] = {}
        self._codec: dict[str, float] = {}   # seconds per element, EWMA over probe steps
        self._probe_sum: dict[str, list] = {}  # this probe step's [seconds, elements] per candidate
        self._probe_scratch: dict[str, list] = {}
        self._correction: dict[str, float] = {}  # real codec time / the probe's, per candidate
        self._link_fit: Optional[tuple] = None  # (latency, bandwidth per level) of the last exact calls
        # Host CPU of the transfers: the step in progress (thread, the other threads' CPU at its
        # first call, that call's issue), the steps since the last round (calls, from, to, CPU
        # seconds), and the last fit (CPU seconds per byte sent, per level).
        self._cpu_open: Optional[list] = None
        self._cpu_steps: list = []
        self._cpu_fit: dict = {}
        self._one_host = False  # known from the first round: nothing to probe
        self._probed: set = set()
        self._hosts: Optional[tuple] = None  # (hosts, ranks per host) of a process group, once known

    # -- state -------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"candidates": self.candidates, "error_budget": self.error_budget, "interval": self.interval,
                "hysteresis": self.hysteresis, "link": dict(self.link), **super()._config()}

    def state_dict(self) -> dict:
        """The base state, every candidate's (its residuals), and the decisions with their reasons."""
        state = super().state_dict()
        state["compressors"] = {n: q.state_dict() for n, q in self._compressors.items() if q is not None}
        state["decisions"] = {k: (d.choice, d.reason, d.predicted_s, d.exact_s)
                              for k, d in self._decisions.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for name, q in self._compressors.items():
            if q is not None:
                q.load_state_dict(state["compressors"][name])
        self._decisions = {k: Decision(*v) for k, v in state["decisions"].items()}
        self._reset_measuring()

    def decisions(self) -> dict:
        """The current choice per key (DDP: bucket index; the sharded wrapper: ("braid.fsdp.grad",
        bucket index)) with its reason: {key: Decision}."""
        return dict(self._decisions)

    @property
    def compressors(self) -> dict:
        """The candidates' compressors by name (None for exact), with this compressor's common
        settings: what each choice runs (the sharded wrapper pads its shards to their blocks)."""
        return dict(self._compressors)

    def choice(self, key: Hashable) -> str:
        """The candidate the next call of ``key`` runs after the warm-up (exact until decided)."""
        d = self._decisions.get(key)
        return EXACT if d is None else d.choice

    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        for q in self._compressors.values():
            if q is not None and q.residual(key) is not None:
                return q.residual(key)
        return self._residuals.get(key)

    # -- steps -------------------------------------------------------------------------------
    def end_step(self) -> None:
        """The backward of a step ended now (the DDP hook calls it at the last bucket): each call of
        the step gets its window (the backward's time from the call to now, less the waits
        :meth:`stalled` reported in it and the codec probes run in it), and the step counts toward
        the next decision round."""
        now = time.perf_counter()
        opened, self._cpu_open = self._cpu_open, None
        if opened is not None and opened[0] == threading.get_ident():
            self._cpu_steps.append((self._step_calls + self._other_calls, opened[2], now,
                                    _other_threads_cpu() - opened[1]))
        for call in self._step_calls:
            after = [(n, host) for t, n, host in self._shared if t >= call.issued]
            call.shared = (sum(n for n, host in after if not host), sum(n for n, host in after if host))
        self._shared = []
        stalls, self._stalls = self._stalls, []
        # On a device the backward ends, in stream order, where its last bucket was issued.
        marked = [c for c in self._step_calls if c.marks is not None]
        end_mark = marked[-1].issued_mark if marked else None
        for call in self._step_calls:
            # Step 0's buckets are DDP's first layout, rebuilt after it: their calls measure the
            # link, but their windows and sizes are not the buckets' to come.
            if self._steps < 1:
                call.window = None
            elif call.marks is not None:
                call.end_mark = end_mark
            else:
                waited = sum(min(seconds, end - call.issued) for end, seconds in stalls if end > call.issued)
                call.window = max(0.0, now - call.issued - waited)
        for call in self._other_calls:
            # Its work may hold the gather's buffers (a quantized gather's payloads): not kept until
            # the round. Done by now as a rule (the backward waited for it); else its future stamps it.
            if call.work is not None:
                call.finished()
                if call.done is None:
                    call.work.get_future().then(call.stamp)
                call.work = None
        self._calls_since.extend(self._step_calls)
        self._calls_since.extend(self._other_calls)
        self._step_calls, self._other_calls = [], []
        self._steps += 1

    def share_link(self, nbytes: int, *, in_host: bool = False, work: Any = None,
                   device: Optional[torch.device] = None) -> None:
        """The caller issued now, during the backward, another collective on the same group that
        sends ``nbytes`` (this rank's bytes on the wire): the sharded wrapper's parameter
        all-gathers, flat over the group or (``in_host``) inside this rank's host (hpZ). A bucket
        whose window holds such traffic has that much less of the link to hide behind. With its
        ``work`` (async, on ``device``; default the CPU) the call also times the link: it queues
        with the buckets' calls, and both ranks start it from the queue together, where a bucket's
        call issued by a late rank finds its peer's bytes already buffered and looks fast. Counted
        only after the step's first call (earlier traffic is in no bucket's window)."""
        if not self._step_calls:
            return
        now = time.perf_counter()
        self._shared.append((now, float(nbytes), bool(in_host)))
        if work is not None:
            call = _Call(OTHER, int(nbytes), 1, EXACT, now, OTHER_IN_HOST if in_host else OTHER,
                         _marks_for(device))
            if call.marks is None and hasattr(work, "completed_at"):
                call.work = work
            else:
                work.get_future().then(call.stamp)
            self._other_calls.append(call)

    def stalled(self, seconds: float) -> None:
        """The backward waited ``seconds``, ending now, on the caller's other collectives (the
        sharded wrapper, blocked on a parameter gather): time the bucket windows that span it do
        not compute in. Windows are the backward's compute from a bucket to its end; a wait the
        link's traffic caused belongs to the communication the plan is deciding."""
        if self._step_calls and seconds > 0:
            self._stalls.append((time.perf_counter(), float(seconds)))

    # -- the all-reduce ----------------------------------------------------------------------
    def all_reduce(self, comm: Any, tensor: torch.Tensor, op: Op = "avg", *, key: Hashable = "default",
                   async_op: bool = False, step: Optional[int] = None
                   ) -> Optional[Union[CompressedWork, GroupWork]]:
        if isinstance(comm, CompressionHost):
            return comm.all_reduce(tensor, op, async_op, compression=self, key=key, step=step)
        code = compressed_op_code(op)
        check_tensor(tensor)
        carrier = group_carrier.carrier_of(comm, "comm")
        step = self._step_of(step)
        group = carrier.group if isinstance(carrier, HostGroups) else carrier
        name, call = self._begin(key, tensor, step, carrier.size,
                                 lambda out, inp: self._gather_on_group(group, out, inp),
                                 lambda: self._layout_of_group(carrier))
        if name == EXACT:
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
            self._count(self.exact_wire_stats(flat.numel() * flat.element_size(), carrier.size))
            slice_of = self._slice_of_group(carrier)
            flush = step >= self.warmup_steps  # never into a warm-up step's (maybe first) layout

            def job() -> None:
                if flush:
                    self._flush(key, flat, slice_of)
                carrier.all_reduce(flat, code == AVG)
                copy_back(flat, tensor)

            work = GroupWork(group_carrier.issue(job, [tensor], tensor.device, group.inline))
            if not async_op:
                work.wait()
                work = None
        else:
            q = self._compressors[name]
            work = q.all_reduce(carrier, tensor, op, key=key, async_op=async_op, step=step)
            self._count(q.last_wire_bytes)
        return self._record(call, work)

    def all_reduce_on(self, comm: BraidCollectives, tensor: torch.Tensor, op: Op = "avg", *,
                      key: Hashable = "default", async_op: bool = False,
                      step: Optional[int] = None) -> tuple[Optional[Union[CompressedWork, Work]], WireStats]:
        code = compressed_op_code(op)
        check_tensor(tensor)
        if tensor.device.type != "cpu":
            raise ValueError(f"tensor must be a CPU tensor to travel through a braid Communicator, got a "
                             f"tensor on {tensor.device} (reduce CUDA tensors over a torch process group)")
        step = self._step_of(step)
        name, call = self._begin(key, tensor, step, comm.world_size,
                                 lambda out, inp: comm.all_gather(out, inp, False),
                                 lambda: self._layout_of_braid(comm))
        if name == EXACT:
            flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
            local = comm.local_world_size if comm.num_hosts > 1 and comm.uniform_hosts else 1
            if step >= self.warmup_steps:  # never into a warm-up step's (maybe first) layout
                self._flush(key, flat, (comm.local_rank, local))
            stats = self.exact_wire_stats(flat.numel() * flat.element_size(), comm.world_size)
            raw = comm.all_reduce(flat, code, async_op)
            if raw is None:
                copy_back(flat, tensor)
                work = None
            elif flat.data_ptr() == tensor.data_ptr():
                # The result is already in the tensor: the plain work, timed by its own completion
                # (a Python callback on the progress thread would wait for the GIL, and the next
                # bucket behind it: the exact plan then costs what the exact hook costs).
                work = Work(raw, "all_reduce")
                call.work = raw
            else:
                work = CompressedWork(raw, lambda: copy_back(flat, tensor), tensor)
        else:
            work, stats = self._compressors[name].all_reduce_on(comm, tensor, op, key=key, async_op=async_op,
                                                                step=step)
        self._count(stats)
        return self._record(call, work), stats

    # -- the reduce-scatter ------------------------------------------------------------------
    def reduce_scatter(self, group: Group, tensor: torch.Tensor,
                       issue: Callable[[Optional[Compressor], Optional[torch.Tensor]], tuple], *,
                       key: Hashable = "default", hosts: Optional[HostGroups] = None,
                       step: Optional[int] = None) -> tuple:
        """The reduce-scatter of ``tensor`` (this rank's input, ``group.world_size`` pieces) with
        the candidate decided for ``key``, measured and decided as the all-reduces are: the
        sharded wrapper's gradients (``fsdp.shard(..., grad_compression=q)``, which calls
        :meth:`end_step` at the end of each backward).

        The caller owns the algorithm: ``issue(compressor, residual)`` issues the call and returns
        ``(work, finish)``, ``work`` an async work (``get_future()``) or None once done.
        ``compressor`` None asks for the exact reduce-scatter, with ``residual`` (None, or what
        the bucket's compression dropped before it switched to exact: float32, the size of what
        was encoded) added to this rank's input; otherwise it is the chosen candidate's
        compressor, whose residual for ``key`` the encoding uses and updates (one per bucket,
        carried from candidate to candidate). ``group``: a braid Group (comm/group.py) serving
        ``tensor``'s device; ``hosts``: the group split by host where the caller's compressed
        reduce-scatters sum exactly inside a host and encode only across hosts, None where they
        run flat over the group (whose hosts are then found from the ranks' host identities).
        Returns what ``issue`` returned."""
        check_tensor(tensor)
        n, step = group.world_size, self._step_of(step)
        gather = functools.partial(_gather_on, group, tensor.device)
        name, call = self._begin(key, tensor, step, n, gather, lambda: self._layout_of(n, hosts, gather),
                                 REDUCE_SCATTER)
        if name == EXACT:
            # Never into a warm-up step's call, as the all-reduce's flush.
            residual = self.take_residual(key) if step >= self.warmup_steps else None
            work, finish = issue(None, residual)
        else:
            work, finish = issue(self._compressors[name], None)
        self._record(call, work)
        return work, finish

    def _step_of(self, step: Optional[int]) -> int:
        return self._steps if step is None else step

    def _active(self, key: Hashable, step: int, world: int) -> str:
        if step < self.warmup_steps or world == 1:
            return EXACT
        return self.choice(key)

    def _record(self, call: _Call, work: Any) -> Any:
        if work is None:
            call.stamp()
        elif call.work is None:  # (set only for host-timed braid calls)
            work.get_future().then(call.stamp)
        self._step_calls.append(call)
        return work

    def _flush(self, key: Hashable, flat: torch.Tensor, slice_of: tuple) -> None:
        """A bucket switched to exact: its residual (what compression dropped so far) joins this
        exact all-reduce, and leaves. A host path's residual is this rank's slice ``slice_of`` =
        (local index, local ranks) of the host's sum: added to that slice of this rank's input,
        the exact sum carries it all the same."""
        r = self.take_residual(key)
        if r is None:
            return
        index, local = slice_of
        per = -(-flat.numel() // local)
        if r.numel() == flat.numel():
            flat.add_(r.to(flat.device))
        elif r.numel() == per:
            part = flat[index * per:(index + 1) * per]
            part.add_(r[:part.numel()].to(flat.device))

    def _slice_of_group(self, carrier: Any) -> tuple:
        return (carrier.intra.rank, carrier.intra.size) if isinstance(carrier, HostGroups) else (0, 1)

    # -- decision rounds ---------------------------------------------------------------------
    def _begin(self, key: Hashable, tensor: torch.Tensor, step: int, world: int, gather: Any, layout: Any,
               collective: str = ALL_REDUCE) -> tuple:
        """What every call does first: a round or a probe when due (_before_call), then the choice in
        force for ``key`` and the call's timing record: (choice, _Call). The first call of a step,
        timed on the host with torch computing on one thread, opens the step's host CPU sample
        (after the round, whose gather is no step's), which :meth:`end_step` closes."""
        first = not self._step_calls
        self._before_call(key, tensor, step, world, gather, layout, collective)
        name = self._active(key, step, world)
        call = _Call(key, tensor.numel(), tensor.element_size(), name, time.perf_counter(), collective,
                     _marks_for(tensor.device))
        if first and call.marks is None and torch.get_num_threads() == 1:
            self._cpu_open = (threading.get_ident(), _other_threads_cpu(), call.issued)
        return name, call

    def _before_call(self, key: Hashable, tensor: torch.Tensor, step: int, world: int, gather: Any,
                     layout: Any, collective: str = ALL_REDUCE) -> None:
        """At the first call of a step due for a round: the round. At each call of the step before
        a round that re-measures the codecs: the probe of this bucket (for ``collective``)."""
        if world == 1:
            return
        if not self._step_calls and step >= self._next_round and step >= self.warmup_steps:
            self._round(gather, layout())
            self._next_round = step + self.interval
        if step + 1 == self._next_round and self._probing() and key not in self._probed:
            self._probe_bucket(key, tensor, collective)

    def _probing(self) -> bool:
        """Whether the coming round re-measures the codecs: the first one, then every fourth (never
        on one host, where nothing is compressed)."""
        return not self._one_host and (not self._codec or self._rounds % 4 == 0)

    def _probe_bucket(self, key: Hashable, tensor: torch.Tensor, collective: str) -> None:
        """Times each candidate ``collective`` carries on (up to PROBE_ELEMS of) this rank's bucket
        with its kernels, and keeps the error each would make on it."""
        self._probed.add(key)
        began = time.perf_counter()
        x = tensor.detach().reshape(-1)[:PROBE_ELEMS].to(torch.float32)
        errors = {}
        for name, q in self._compressors.items():
            if q is None or name not in COLLECTIVE_CANDIDATES[collective]:
                continue
            seconds, err = _probe(name, q, x, self._probe_scratch)
            acc = self._probe_sum.setdefault(name, [0.0, 0])
            acc[0] += seconds
            acc[1] += x.numel()
            errors[name] = err * math.sqrt(ROUNDINGS[collective][name])
        self._errors[key] = errors
        # The probe is no part of the backward: the windows of the calls before it leave it out.
        end = time.perf_counter()
        self._stalls.append((end, end - began))

    def _fold_probes(self) -> None:
        """The probe step's codec costs into the running estimate: an average over probe steps with
        weight 1/2, so one probe on a loaded machine moves it half way."""
        for name, (seconds, elems) in self._probe_sum.items():
            if elems:
                now, old = seconds / elems, self._codec.get(name)
                self._codec[name] = now if old is None else 0.5 * old + 0.5 * now
        self._probe_sum = {}
        self._probed = set()

    def _layout_of_braid(self, comm: BraidCollectives) -> Layout:
        n, hosts = comm.world_size, comm.num_hosts
        if not comm.uniform_hosts:  # uneven hosts: compressed flat over all ranks, bytes shared out
            return Layout(n, hosts, max(1, n // hosts))
        local = n // hosts
        return Layout(n, hosts, local, hierarchical=hosts > 1 and local > 1,
                      exact_hierarchical=hosts > 1 and local > 1)

    def _layout_of_group(self, carrier: Any) -> Layout:
        hosts = carrier if isinstance(carrier, HostGroups) else None
        return self._layout_of(carrier.size, hosts,
                               lambda out, inp: self._gather_on_group(carrier, out, inp))

    def _layout_of(self, size: int, hosts: Optional[HostGroups], gather: Any) -> Layout:
        """The layout of ``size`` ranks: split by ``hosts`` (exact inside a host, compressed
        across), or flat with the hosts found from every rank's host identity (``gather``ed once)."""
        if hosts is not None:
            return Layout(size, hosts.inter.size, hosts.intra.size, hierarchical=True)
        if self._hosts is None:  # once: which ranks share a host, from every rank's host identity
            mine = torch.tensor([float(zlib.crc32(host_identity().encode()))], dtype=torch.float64)
            ids = gather(torch.empty(size, dtype=torch.float64), mine).tolist()
            counts = [ids.count(h) for h in dict.fromkeys(ids)]
            uniform = len(set(counts)) == 1
            self._hosts = (len(counts), counts[0]) if uniform else (size, 1)
        host_count, local = self._hosts
        return Layout(size, host_count, local)

    def _gather_on_group(self, group: GroupCarrier, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """All-gather of a small CPU float64 vector over a group carrier, in order with its other
        jobs; on a CUDA group (NCCL) through the device."""
        device = torch.device("cuda", torch.cuda.current_device()) if _needs_cuda(group) else inp.device
        o, i = out.to(device), inp.to(device)
        group_carrier.issue(lambda: group.all_gather(o, i), [o], device, group.inline).wait()
        out.copy_(o.cpu())
        return out

    def _local_vector(self, keys: list, layout: Layout) -> list:
        """This rank's measurements: bandwidth per level, latency, codec cost per candidate (the
        probe's, corrected by the real calls), then per bucket its elements, element size, window,
        the other traffic's bytes in that window (in the host, across hosts: :meth:`share_link`)
        and each candidate's error.

        The link is fitted from the exact calls alone (their time is the link's); the compressed
        calls' time beyond their predicted transfer is their real codec time, which corrects the
        probe's estimate. Each bucket counts with its fastest call of the steps since the last
        round (the others waited for a late rank or a busy core). Without exact calls in the
        window the last fit holds."""
        calls = [c for c in self._calls_since if c.finished() is not None]
        fastest: dict = {}
        for c, start in _services(calls):
            group = (c.key, c.numel, c.elem_size, c.choice, c.collective)
            fastest[group] = min(fastest.get(group, math.inf), c.done - start)
        exact = []
        for (_, numel, elem, choice, collective), t in fastest.items():
            by_level = level_bytes(choice, None, numel, elem, layout, collective)
            if choice == EXACT and sum(by_level) > 0:
                rounds = ROUNDS[collective][EXACT] * sum(1 for x in by_level if x > 0)
                exact.append((*by_level, rounds, t))
        if exact:
            self._link_fit = fit_link(exact)
        self._fit_host_cpu(layout)
        if self._link_fit is None:
            return self._vector(keys, calls, math.nan, {IN_HOST: math.nan, ACROSS_HOSTS: math.nan}, layout)
        latency, bw = self._link_fit
        bw = {**bw, **{level: float(rate) for level, rate in self.link.items()}}
        if exact:
            self._correct_codecs(fastest, layout, latency, bw)
        return self._vector(keys, calls, latency, bw, layout)

    def _fit_host_cpu(self, layout: Layout) -> None:
        """The host CPU per byte sent, per level, from the steps since the last round (least
        squares of CPU seconds against bytes per level, as the link's bandwidth); without such
        steps, or before the link's latency is known, the last fit holds.

        A step's sample runs from its first call to the end of its backward: the CPU the other
        threads used in it against the bytes of its calls' service that fell in it (a call's
        bytes spread evenly over its service), which leaves out what runs after the backward
        (the caller's optimizer, a benchmark's other models). Only steps whose calls were all
        exact all-reduces, finished, with no other traffic reported, count: a codec's kernels or
        bytes this Adaptive does not count would be taken for the bytes' cost. A call also costs
        CPU whatever its size (waking a thread, system calls, a callback), which equal steps
        cannot tell from its bytes': each message round may account for up to its fitted latency
        (its wall time without bytes) and CALL_CPU_S, and only the rest is taken for the bytes
        (small buckets would otherwise read as costly bytes, which compression seems to save)."""
        if self._link_fit is None:
            return
        per_round = min(self._link_fit[0], CALL_CPU_S)
        samples = []
        for calls, began, ended, seconds in self._cpu_steps:
            if not calls or any(c.choice != EXACT or c.collective != ALL_REDUCE or c.shared != (0.0, 0.0)
                                or c.finished() is None for c in calls):
                continue
            sent, rounds = [0.0, 0.0], 0.0
            for c, start in _services(calls):
                span = c.done - start
                inside = min(c.done, ended) - max(start, began)
                part = min(1.0, max(0.0, inside / span)) if span > 0 else float(began <= start < ended)
                by_level = level_bytes(EXACT, None, c.numel, c.elem_size, layout)
                sent = [n + part * x for n, x in zip(sent, by_level)]
                rounds += part * ROUNDS[ALL_REDUCE][EXACT] * sum(1 for x in by_level if x > 0)
            if sum(sent) > 0:
                samples.append((*sent, max(0.0, seconds - rounds * per_round)))
        if samples:
            rates = fit_levels(samples)  # bytes per CPU second
            self._cpu_fit = {level: 1 / rate for level, rate in rates.items() if not math.isnan(rate)}

    def _correct_codecs(self, fastest: dict, layout: Layout, latency: float, bw: dict) -> None:
        """Per compressed candidate run since the last round: its calls' time beyond the predicted
        transfer over the probe's codec estimate, held in [0.5, 20] and averaged with the previous
        correction (weight 1/2)."""
        levels = {lv: Level(rate if not math.isnan(rate) else math.inf, latency) for lv, rate in bw.items()}
        m = Measurements(layout, levels, self._codec, ())
        spent: dict = {}
        for (key, numel, elem, choice, collective), t in fastest.items():
            if choice == EXACT or choice not in self._codec:
                continue
            b = BucketMeasure(key, numel, elem, 0.0, collective=collective)
            acc = spent.setdefault(choice, [0.0, 0.0])
            acc[0] += max(0.0, t - transfer_s(choice, self._compressors[choice], b, m))
            acc[1] += codec_s(choice, b, m)
        for choice, (real, probed) in spent.items():
            if probed > 0:
                now = min(20.0, max(0.5, real / probed))
                old = self._correction.get(choice)
                self._correction[choice] = now if old is None else 0.5 * old + 0.5 * now

    def _vector(self, keys: list, calls: list, latency: float, bw: dict, layout: Layout) -> list:
        vec = [bw[IN_HOST], bw[ACROSS_HOSTS], latency]
        vec += [self._codec.get(n, math.nan) * self._correction.get(n, 1.0)
                for n in self.candidates if n != EXACT]
        for k in keys:
            mine = [c for c in calls if c.key == k and c.window is not None]
            least = min(mine, key=lambda c: c.window) if mine else None  # its window, its traffic
            window = least.window if least else math.nan
            flat, host = least.shared if least else (math.nan, math.nan)
            numel = mine[-1].numel if mine else math.nan
            elem = mine[-1].elem_size if mine else math.nan
            errors = self._errors.get(k, {})
            # The other traffic's bytes by level: the flat part split as a flat collective's.
            flat_in, flat_across = level_bytes(EXACT, None, flat, 1, layout, OTHER)
            vec += [numel, elem, window, flat_in + host, flat_across]
            vec += [errors.get(n, math.nan) for n in self.candidates if n != EXACT]
        vec += [self._cpu_fit.get(level, math.nan) for level in LEVELS]
        return vec + _cpu_layout()

    def _round(self, gather: Any, layout: Layout) -> None:
        """One decision round: every rank's measurement vector all-gathered (one small collective),
        combined the same way on every rank, and decided."""
        self._fold_probes()
        _read_marks(self._calls_since)
        keys = sorted({c.key for c in self._calls_since if c.window is not None}, key=repr)
        self._rounds += 1
        if not keys:
            return
        self._one_host = layout.hosts == 1
        local = torch.tensor(self._local_vector(keys, layout), dtype=torch.float64)
        everyone = torch.empty(layout.world * local.numel(), dtype=torch.float64)
        gather(everyone, local)
        rows = everyone.view(layout.world, -1).tolist()
        collectives = {c.key: c.collective for c in self._calls_since}
        m = _combine(rows, keys, layout, self.candidates, collectives)
        self._calls_since, self._cpu_steps = [], []
        if m is None:
            return
        current = {k: d.choice for k, d in self._decisions.items()}
        decided = decide(m, current, candidates=self.candidates, error_budget=self.error_budget,
                         hysteresis=self.hysteresis, compressors=self._compressors)
        for k, d in decided.items():
            self._move_residual(k, current.get(k, EXACT), d.choice)
        self._decisions.update(decided)

    def _move_residual(self, key: Hashable, old: str, new: str) -> None:
        """Error feedback carries across a switch: the bucket's residual goes to the new compressor
        (or, for exact, waits to be added to the bucket's next exact all-reduce or reduce-scatter)."""
        if old == new:
            return
        src, dst = self._compressors[old] or self, self._compressors[new] or self
        r = src.take_residual(key)
        if r is not None:
            dst.put_residual(key, r)


def _services(calls: Sequence[_Call]) -> list:
    """(call, when the link began serving it) for finished ``calls``, in issue order: the link
    serves the calls in issue order, so a call's own time starts when it was issued or when the
    one before it finished, whichever is later."""
    out = []
    prev_done = -math.inf
    for c in sorted(calls, key=lambda c: c.issued):
        out.append((c, max(c.issued, prev_done)))
        prev_done = max(prev_done, c.done)
    return out


def _read_marks(calls: Sequence[_Call]) -> None:
    """The device-timed calls' marks read into seconds (issued, done, window), from the first such
    call's issue: the service order and windows then compare device times with device times. A
    call whose result was not yet marked keeps done None (left out of the fit)."""
    marked = [c for c in calls if c.marks is not None and c.issued_mark is not None]
    if not marked:
        return
    origin = marked[0].issued_mark
    for c in marked:
        marks = c.marks
        for m in (c.issued_mark, c.done_mark, c.end_mark):
            if m is not None:
                marks.wait(m)
        c.issued = marks.seconds(origin, c.issued_mark)
        if c.done_mark is not None:
            c.done = marks.seconds(origin, c.done_mark)
        if c.end_mark is not None:
            c.window = marks.seconds(origin, c.end_mark) - c.issued
        c.issued_mark = c.done_mark = c.end_mark = None  # read once; the events go


def _gather_on(group: Group, device: torch.device, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """Blocking all-gather of a small CPU float64 vector over a braid Group, through ``device``
    (the one the group's collectives serve), issued from the caller's thread in order with the
    caller's other collectives on it."""
    o, i = out.to(device), inp.to(device)
    group.all_gather(o, i)
    out.copy_(o.cpu())
    return out


def _needs_cuda(group: GroupCarrier) -> bool:
    g = group.group
    return (isinstance(g, torch.distributed.ProcessGroup) and torch.cuda.is_available()
            and "nccl" in str(torch.distributed.get_backend(g)).lower()
            and "gloo" not in str(torch.distributed.get_backend(g)).lower())


def _known(values: list) -> list:
    """The values a rank measured (NaN: it had nothing to measure)."""
    return [v for v in values if not math.isnan(v)]


def _combine(rows: list, keys: list, layout: Layout, candidates: Sequence[str], collectives: Mapping
             ) -> Optional[Measurements]:
    """Every rank's vector into one set of measurements (``collectives``: each key's, the same on
    every rank, which make the same calls), the same on every rank: bandwidth the most
    any rank measured (a rank that waited for a later one counted the wait as transfer; the last
    to arrive timed the link alone), codec costs and errors the worst rank's, windows the least,
    the other traffic in them the most; the host CPU per byte the most, and its share taken from
    the backward's cores the worst rank's (:func:`contention`), where the vectors carry them
    (CPU_FIELDS after the buckets)."""
    names = [n for n in candidates if n != EXACT]
    per_bucket = 5  # numel, element size, window, other bytes in the host, across hosts
    cols = list(zip(*rows))
    bw_in, bw_ac = _known(list(cols[0])), _known(list(cols[1]))
    lat = _known(list(cols[2]))
    latency = min(lat) if lat else DEFAULT_LATENCY_S
    levels = {}
    if bw_in:
        levels[IN_HOST] = Level(max(bw_in), latency)
    if bw_ac:
        levels[ACROSS_HOSTS] = Level(max(bw_ac), latency)
    if not levels:
        return None
    for level in LEVELS:  # a level without samples: the other's figure (a bound, not a guess)
        levels.setdefault(level, next(iter(levels.values())))
    codec = {}
    for i, n in enumerate(names):
        got = _known(list(cols[3 + i]))
        codec[n] = max(got) if got else math.inf
    buckets = []
    base, width = 3 + len(names), per_bucket + len(names)
    for j, k in enumerate(keys):
        at = base + j * width
        numel, elem, window, other_in, other_across = (_known(list(cols[at + i])) for i in range(per_bucket))
        if not numel or not elem:
            continue
        errors = {}
        for i, n in enumerate(names):
            got = _known(list(cols[at + per_bucket + i]))
            errors[n] = max(got) if got else math.inf
        least = max(0.0, min(window)) if window else 0.0
        # The other traffic: the most any rank sent, at each level's bandwidth.
        busy = sum(max(got) / levels[level].bytes_per_s for level, got in ((IN_HOST, other_in),
                                                                            (ACROSS_HOSTS, other_across))
                   if got and max(got) > 0)
        buckets.append(BucketMeasure(k, int(max(numel)), int(max(elem)), least, errors, collectives[k], busy))
    if not buckets:
        return None
    tail = base + len(keys) * width
    if len(cols) < tail + CPU_FIELDS:
        return Measurements(layout, levels, codec, buckets)
    cpu = {}
    for level, got in zip(LEVELS, (_known(list(cols[tail])), _known(list(cols[tail + 1])))):
        if got:
            cpu[level] = max(got)
    if cpu:  # a level without samples: the other's figure, as the link's
        cpu = {level: cpu.get(level, next(iter(cpu.values()))) for level in LEVELS}
    share = contention(*(cols[tail + i] for i in range(2, CPU_FIELDS)))
    return Measurements(layout, levels, codec, buckets, cpu, share)
