"""What one layout costs: memory per device and time per optimizer step.

Every formula here is written out in docs/usage/plan.md. Notation: L layers, h hidden, a heads,
d head width, f MLP width, V vocabulary, s sequence, B global batch (sequences), m micro-batches,
v pipeline chunks per rank, b = B / (dp m) sequences per micro-batch, s' = s / cp tokens per
device, t = tp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Dict, Optional, Sequence, Tuple

from .cluster import Cluster, span_of
from .model import TransformerShape

MiB = 1024**2

# Bytes on the wire per gradient value (block quantizers: the values plus a float32 scale per
# block, braid's Int8Quantizer(block=256) and Int4Quantizer(block=128)).
WIRE_BYTES = {"int8": 1 + 4 / 256, "int4": 0.5 + 4 / 128}
COMPRESSIONS = ("none", "int8", "int4")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Assumptions:
    """The constants of the cost model.

    Args:
        efficiency: fraction of peak FLOP/s the matrix work runs at.
        overlap: fraction of the backward (or forward) compute a data-parallel collective can
            hide behind; the rest of the collective is exposed: max(0, comm - overlap x compute).
        codec_seconds_per_byte: time to encode and decode one byte of uncompressed gradient
            (default 5e-12: 200 GB/s of input).
        bucket_bytes: data-parallel gradient bucket; two are in flight (communication buffers),
            and each bucket is one collective, paying the link latencies.
        half_efficiency_tokens: tokens per micro-batch on one device (s' b) at which matrix work
            runs at half of ``efficiency`` (small micro-batches make small matrix products);
            0 turns the effect off.
        optimizer_seconds_per_param: time of the optimizer step per parameter a device updates
            (sharded from ZeRO-1); default 0: the step is left out, as it is small beside the
            matrix work on accelerators. On CPUs it is not: measure it (``python -m braid.bench
            plan`` does).
        loss_logits: float32 tensors of the logits' size the loss holds as its backward starts, on
            the last stage: 1 for a fused or vocabulary-parallel cross-entropy that computes its
            gradient in place (Megatron-LM's, braid's ``tp.vocab_parallel_cross_entropy``; the
            default), 3 for ``torch.nn.functional.cross_entropy`` on the full logits (its
            log-softmax kept for the backward, that output's gradient and the logits' gradient;
            measured, docs/usage/plan.md).
    """

    efficiency: float = 0.4
    overlap: float = 0.8
    codec_seconds_per_byte: float = 5e-12
    bucket_bytes: int = 25 * MiB
    half_efficiency_tokens: float = 128
    optimizer_seconds_per_param: float = 0.0
    loss_logits: float = 1.0

    def __post_init__(self) -> None:
        for name, low_open in (("efficiency", True), ("overlap", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
            if not ((0 < value <= 1) if low_open else (0 <= value <= 1)):
                raise ValueError(f"{name} must be in {'(0, 1]' if low_open else '[0, 1]'}, got {value}")
        c = self.codec_seconds_per_byte
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < float("inf"):
            raise ValueError(f"codec_seconds_per_byte must be a finite number >= 0, got {c!r}")
        b = self.bucket_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {b!r}")
        for name in ("half_efficiency_tokens", "optimizer_seconds_per_param", "loss_logits"):
            k = getattr(self, name)
            if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 <= k < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {k!r}")

    def to_dict(self) -> Dict[str, Any]:
        """The fields, JSON-ready."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Candidate:
    """One layout: parallel degrees (dp x tp x pp x cp = devices; ep inside dp), the ZeRO stage over
    the data-parallel ranks, micro-batches per step, full activation recomputation, the
    compression of the data-parallel gradient exchange between hosts, and the pipeline chunks per
    rank (``interleave`` > 1: the interleaved 1F1B schedule)."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int = 1
    zero: int = 0
    micro_batches: int = 1
    recompute: bool = False
    compression: str = "none"
    interleave: int = 1

    def label(self) -> str:
        """A short one-line form, e.g. ``dp128 tp8 pp16v4 cp1 ep1 z1 m16 rc none`` (``v4``: four
        interleaved chunks per pipeline rank)."""
        v = f"v{self.interleave}" if self.interleave > 1 else ""
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp}{v} cp{self.cp} ep{self.ep} z{self.zero} "
            f"m{self.micro_batches} {'rc' if self.recompute else '--'} {self.compression}"
        )

    def to_dict(self) -> Dict[str, Any]:
        """The fields, JSON-ready."""
        return dataclasses.asdict(self)


@dataclass
class Memory:
    """Bytes per device on the fullest pipeline stage (``stage``), by part."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    residual: float
    stage: int = 0

    PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers", "residual")

    @property
    def total(self) -> float:
        """Sum of the parts."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.buffers
            + self.residual
        )

    def to_dict(self) -> Dict[str, Any]:
        """The parts, their total and the stage, JSON-ready."""
        d = {p: getattr(self, p) for p in self.PARTS}
        d["total"] = self.total
        d["stage"] = self.stage
        return d


@dataclass
class Comm:
    """One kind of communication over a step: seconds in all, seconds exposed (on the step's
    critical path), the link level it runs on and how it was counted."""

    total: float
    exposed: float
    link: str
    note: str = ""

    @property
    def hidden(self) -> float:
        """Seconds overlapped with compute."""
        return max(0.0, self.total - self.exposed)

    def to_dict(self) -> Dict[str, Any]:
        """The fields, JSON-ready."""
        return {
            "total_s": self.total,
            "exposed_s": self.exposed,
            "hidden_s": self.hidden,
            "link": self.link,
            "note": self.note,
        }


@dataclass
class StepTime:
    """Seconds of one optimizer step: compute (recomputation included, ``recompute`` of it),
    pipeline bubble, each communication's exposed part and the optimizer's own step
    (``Assumptions.optimizer_seconds_per_param``); ``step`` is their sum."""

    compute: float
    recompute: float
    bubble: float
    comms: Dict[str, Comm] = field(default_factory=dict)
    optimizer: float = 0.0

    @property
    def step(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.compute + self.bubble + sum(c.exposed for c in self.comms.values()) + self.optimizer

    def to_dict(self) -> Dict[str, Any]:
        """The parts and the step, JSON-ready."""
        return {
            "step_s": self.step,
            "compute_s": self.compute,
            "recompute_s": self.recompute,
            "bubble_s": self.bubble,
            "optimizer_s": self.optimizer,
            "comms": {k: c.to_dict() for k, c in self.comms.items()},
        }


# -- validity ------------------------------------------------------------------------------------
def kv_heads_per_rank(model: TransformerShape, tp: int) -> int:
    """Key/value heads one TP rank holds: kv_heads / tp, or 1 when tp is a multiple of kv_heads
    (each head then replicated tp / kv_heads times)."""
    return model.kv_heads // tp if model.kv_heads % tp == 0 else 1


def host_misalignment(devices_per_host: int, c: Candidate) -> Optional[str]:
    """Why some process group of ``c`` would straddle hosts unevenly, or None. Ranks are numbered tp
    fastest, then cp, ep, the rest of dp, pp: each running product (tp, tp cp, tp cp ep, tp cp dp)
    must divide devices_per_host or be a multiple of it, so that every group sits on its hosts as
    the group of rank 0 does."""
    for name, size in (
        ("tp", c.tp),
        ("tp*cp", c.tp * c.cp),
        ("tp*cp*ep", c.tp * c.cp * c.ep),
        ("tp*cp*dp", c.tp * c.cp * c.dp),
    ):
        if devices_per_host % size and size % devices_per_host:
            return (
                f"{name}={size} neither divides nor is a multiple of devices_per_host={devices_per_host} "
                "(its groups would straddle hosts)"
            )
    return None


def invalid_reason(
    model: TransformerShape,
    cluster: Cluster,
    c: Candidate,
    *,
    uneven_pp: bool = False,
    replicate_kv_heads: bool = True,
) -> Optional[str]:
    """Why ``c`` cannot run ``model`` on ``cluster`` (a sentence naming the argument), or None."""
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batches", "interleave"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return f"{name}={value!r} must be a positive int"
    if c.dp * c.tp * c.pp * c.cp != cluster.devices:
        return (
            f"dp*tp*pp*cp={c.dp}*{c.tp}*{c.pp}*{c.cp}={c.dp * c.tp * c.pp * c.cp} is not the device "
            f"count {cluster.devices}"
        )
    misaligned = host_misalignment(cluster.devices_per_host, c)
    if misaligned:
        return misaligned
    if model.heads % c.tp:
        return f"tp={c.tp} does not divide heads={model.heads}"
    if model.kv_heads % c.tp:
        if not replicate_kv_heads:
            return f"tp={c.tp} does not divide kv_heads={model.kv_heads} (kv-head replication is off)"
        if c.tp % model.kv_heads:
            return (
                f"tp={c.tp} does not divide kv_heads={model.kv_heads}, nor is it a multiple of it "
                "(kv heads are replicated only when tp is)"
            )
    if model.ffn % c.tp:
        return f"tp={c.tp} does not divide ffn={model.ffn}"
    if c.pp > model.layers:
        return f"pp={c.pp} is more than layers={model.layers}"
    if model.layers % c.pp and not uneven_pp:
        return f"pp={c.pp} does not divide layers={model.layers} (allow uneven stages to split it unevenly)"
    if c.cp > 1 and model.seq % (2 * c.cp):
        return (
            f"cp={c.cp}: seq={model.seq} is not divisible by 2*cp={2 * c.cp} (load-balanced causal "
            "chunks: rank r holds chunks r and 2cp-1-r)"
        )
    if model.batch % c.dp:
        return f"batch={model.batch} is not divisible by dp={c.dp}"
    if (model.batch // c.dp) % c.micro_batches:
        return (
            f"micro_batches={c.micro_batches} does not divide the batch per data-parallel rank "
            f"(batch/dp = {model.batch}/{c.dp} = {model.batch // c.dp})"
        )
    if c.interleave > 1:
        if c.pp == 1:
            return f"interleave={c.interleave} needs pipeline parallelism (pp=1)"
        if c.micro_batches % c.pp:
            return (
                f"interleave={c.interleave}: micro_batches={c.micro_batches} must be a multiple of "
                f"pp={c.pp} for the interleaved schedule"
            )
        if max(stage_layers(model.layers, c.pp)) % c.interleave:
            return (
                f"interleave={c.interleave} does not divide the blocks of the largest pipeline stage "
                f"({max(stage_layers(model.layers, c.pp))})"
            )
    if c.ep > 1 and not model.moe:
        return f"ep={c.ep} needs experts (the model is dense)"
    if model.moe and model.experts % c.ep:
        return f"ep={c.ep} does not divide experts={model.experts}"
    if c.dp % c.ep:
        return f"ep={c.ep} does not divide dp={c.dp} (expert parallelism runs inside data parallelism)"
    if c.zero not in ZERO_STAGES:
        return f"zero={c.zero!r} must be one of {ZERO_STAGES}"
    if c.compression not in COMPRESSIONS:
        return f"compression={c.compression!r} must be one of {COMPRESSIONS}"
    if not isinstance(c.recompute, bool):
        return f"recompute={c.recompute!r} must be a bool"
    return None


def check(model: TransformerShape, cluster: Cluster, c: Candidate, **kwargs: Any) -> None:
    """Raises ValueError with ``invalid_reason`` when ``c`` is not a valid layout."""
    reason = invalid_reason(model, cluster, c, **kwargs)
    if reason:
        raise ValueError(reason)


@lru_cache(maxsize=4096)
def stage_layers(layers: int, pp: int) -> Tuple[int, ...]:
    """Blocks on each pipeline stage: layers / pp each, or, when pp does not divide layers,
    ceil(layers / pp) each less one block taken in turn from the last, first, second-to-last,
    second, ... stage (the ends also hold the output head and the embedding)."""
    base = -(-layers // pp)
    counts = [base] * pp
    deficit = base * pp - layers
    order = []
    lo, hi = 0, pp - 1
    while lo <= hi:
        order.append(hi)
        if lo != hi:
            order.append(lo)
        lo, hi = lo + 1, hi - 1
    for i in range(deficit):
        counts[order[i % pp]] -= 1
    return tuple(counts)


# -- parameters per device -------------------------------------------------------------------------
def device_params(model: TransformerShape, c: Candidate) -> Dict[str, float]:
    """Parameters one device holds before any ZeRO sharding: ``layer_dense`` (per block: attention
    split over tp, k/v heads per ``kv_heads_per_rank``, norms and router whole, a dense MLP split
    over tp), ``layer_experts`` (per block: E / ep whole experts), ``embedding`` and ``head``
    (vocabulary split over tp) and ``final_norm``."""
    return dict(_device_params(model, c.tp, c.ep, c.pp))


@lru_cache(maxsize=1024)
def _device_params(model: TransformerShape, t: int, ep: int, pp: int) -> Dict[str, float]:
    # cached: callers must not change the dict
    s = model.param_scale
    h = model.hidden
    attention = 2 * h * model.q_dim / t + 2 * h * model.head_dim * kv_heads_per_rank(model, t)
    dense = attention + 2 * h
    if model.moe:
        dense += h * model.experts
        experts = (model.experts // ep) * model.mlp_params()
    else:
        dense += model.mlp_params() / t
        experts = 0
    head = model.vocab * h / t
    if model.tie_embeddings and pp == 1:
        head = 0  # the embedding's weights serve
    return {
        "layer_dense": dense * s,
        "layer_experts": experts * s,
        "embedding": model.vocab * h / t * s,
        "head": head * s,
        "final_norm": h * s,
    }


def _stage_params(
    model: TransformerShape, c: Candidate, i: int, n_layers: int, per: Dict[str, float]
) -> Tuple[float, float]:
    dense = n_layers * per["layer_dense"]
    if i == 0:
        dense += per["embedding"]
    if i == c.pp - 1:
        dense += per["head"] + per["final_norm"]
    return dense, n_layers * per["layer_experts"]


def optimizer_bytes_per_param(model: TransformerShape) -> int:
    """Optimizer state per parameter: Adam two float32 moments (8), SGD one momentum (4), plus a
    float32 master copy (4) for bf16 models."""
    moments = 8 if model.optimizer == "adam" else 4
    return moments + (4 if model.dtype == "bf16" else 0)


def experts_apart(model: TransformerShape, c: Candidate) -> bool:
    """Whether the experts differ between the ranks of a data-parallel group (EP, or TP with MoE):
    they then stay out of the data-parallel wrapper and ``moe.reduce_gradients`` all-reduces their
    gradients over their replicas, exactly, after the backward."""
    return model.moe and (c.ep > 1 or c.tp > 1)


def dp_sizes(c: Candidate) -> Tuple[int, int]:
    """(ranks holding the same dense weights: dp x cp, ranks holding the same experts:
    dp x cp x tp / ep)."""
    return c.dp * c.cp, c.dp * c.cp * c.tp // c.ep


def activation_bytes_per_layer(model: TransformerShape, c: Candidate) -> float:
    """Bytes one block keeps for its backward, per micro-batch, on one device (no recomputation).

    Elements (each ``dtype_bytes``), with s' = s / cp, b the micro-batch, t = tp (sequence
    parallelism splits what is not split by heads):
    norms' inputs 2 s'b h / t; attention input s'b h / t; Q and attention output 2 s'b (a d) / t;
    K and V 2 s'b d kv_per_rank; MLP input s'b h / t and its 3 (gated) or 2 (plain) s'b f / t
    intermediates; for MoE the MLP part is the router input s'b h / t plus top_k x (s'b h + 3 s'b f)
    / t for the dispatched rows, and float32 router logits (4 s'b E / t bytes). Dropout adds one-byte
    masks 2 s'b h / t; attention that stores scores (flash_attention=False, cp = 1) adds
    a s^2 b / t scores at dtype_bytes, and with dropout their mask (1 byte) and the dropped copy.
    For GPT (f = 4h, plain MLP, kv = a, dropout, stored scores, 2 bytes) this is Korthikanti et
    al.'s s b h (34 + 5 a s / h)."""
    a_bytes = model.dtype_bytes
    b = model.batch // (c.dp * c.micro_batches)
    s_loc = model.seq // c.cp
    t = c.tp
    sbh = s_loc * b * model.hidden
    elems = (2 * sbh + sbh + 2 * s_loc * b * model.q_dim) / t
    elems += 2 * s_loc * b * model.head_dim * kv_heads_per_rank(model, t)
    mlp_inner = model.mlp_matrices * s_loc * b * model.ffn
    extra = 0.0
    if model.moe:
        elems += (sbh + model.top_k * (sbh + mlp_inner)) / t
        extra += 4 * s_loc * b * model.experts / t
    else:
        elems += (sbh + mlp_inner) / t
    total = elems * a_bytes + extra
    if model.dropout:
        total += 2 * sbh / t
    if not model.flash_attention and c.cp == 1:
        scores = model.heads * model.seq * model.seq * b / t
        total += scores * (a_bytes + ((a_bytes + 1) if model.dropout else 0))
    return total


@lru_cache(maxsize=4096)
def _stages_to_check(stages: Tuple[int, ...]) -> Tuple[int, ...]:
    """The stages that can need the most memory: the first (most micro-batches in flight, the
    embedding), the second, the first middle one with the most blocks, and the last (head, logits)."""
    pp = len(stages)
    picks = {0, pp - 1}
    if pp > 2:
        middle = stages[1 : pp - 1]
        picks.add(1)
        picks.add(1 + middle.index(max(middle)))
    return tuple(sorted(picks))


def _interleave_factor(c: Candidate) -> float:
    """Extra micro-batches of activations the interleaved schedule keeps: 1 + (pp-1)/(pp v)."""
    return 1 + (c.pp - 1) / (c.pp * c.interleave) if c.interleave > 1 else 1.0


def memory(
    model: TransformerShape,
    cluster: Cluster,
    c: Candidate,
    assumptions: Optional[Assumptions] = None,
    stages: Optional[Sequence[int]] = None,
) -> Memory:
    """Bytes per device, by part, on the pipeline stage that needs the most (see the module docs):

    - parameters: stage parameters x dtype_bytes, / (dp cp) for ZeRO-3 (experts / (dp cp tp / ep));
    - gradients: the same counts x dtype_bytes, sharded from ZeRO-2;
    - optimizer: the same counts x ``optimizer_bytes_per_param``, sharded from ZeRO-1;
    - activations: stage i keeps min(pp - i, m) micro-batches in flight (1F1B; 1 without PP),
      times 1 + (pp-1)/(pp v) with v interleaved chunks;
      per micro-batch and block ``activation_bytes_per_layer``, or with recomputation only the
      block input s'b h / t x dtype_bytes plus one block's full activations (the one being
      recomputed); the last stage adds the loss's working set as its backward starts,
      ``loss_logits`` float32 tensors of the logits' size 4 s'b V / t (the snippet's pipeline
      schedules run with ``return_outputs=False``, so no micro-batch's logits are kept past its
      loss);
    - buffers: two gradient buckets in flight where they are not the gradients themselves (DDP's
      buckets are, with ``gradient_as_bucket_view``, and so is ZeRO-1's persistent flat gradient):
      from ZeRO-2 (the full gradients of the buckets being reduce-scattered) or with compression
      (the encoded and decoded copies); with ZeRO-3 also two gathered units (the largest block,
      the embedding or the head) at dtype_bytes. The loss's working set is gone before the
      backward has a bucket ready, so on the last stage only the buckets beyond it count. With PP
      and several micro-batches, one more copy of the stage's gradients (torch's pipeline stages
      compute a micro-batch's weight gradients whole before accumulating them);
    - residual: with compression, the float32 error-feedback residual of the stage's gradients.
    """
    assumptions = assumptions or Assumptions()
    stages = tuple(stages or stage_layers(model.layers, c.pp))
    per = _device_params(model, c.tp, c.ep, c.pp)
    n_dp, n_edp = dp_sizes(c)
    a = model.dtype_bytes
    opt = optimizer_bytes_per_param(model)
    m = c.micro_batches
    b = model.batch // (c.dp * m)
    s_loc = model.seq // c.cp
    act_layer = activation_bytes_per_layer(model, c)
    layer_input = s_loc * b * model.hidden / c.tp * a
    shard_p = (n_dp, n_edp) if c.zero >= 3 else (1, 1)
    shard_g = (n_dp, n_edp) if c.zero >= 2 else (1, 1)
    shard_o = (n_dp, n_edp) if c.zero >= 1 else (1, 1)
    factor = _interleave_factor(c)
    last = c.pp - 1
    in_flight_buckets = c.zero >= 2 or c.compression != "none"
    exchanged = n_dp > 1 or (model.moe and n_edp > 1)  # a dense model has no experts' replicas
    base_buffers = 2 * assumptions.bucket_bytes if exchanged and in_flight_buckets else 0
    logits = s_loc * b * model.vocab / c.tp
    best: Tuple[float, ...] = ()
    for i in _stages_to_check(stages):
        n_layers = stages[i]
        dense, experts = _stage_params(model, c, i, n_layers, per)
        params = a * (dense / shard_p[0] + experts / shard_p[1])
        grads = a * (dense / shard_g[0] + experts / shard_g[1])
        optim = opt * (dense / shard_o[0] + experts / shard_o[1])
        in_flight = min(c.pp - i, m) * factor
        if c.recompute:
            acts = in_flight * n_layers * layer_input + act_layer
        else:
            acts = in_flight * n_layers * act_layer
        buffers = base_buffers
        if i == last:
            loss = assumptions.loss_logits * 4 * logits  # gone before a bucket is ready: the larger counts
            acts += loss
            buffers = max(0.0, base_buffers - loss)
        if c.pp > 1 and m > 1:
            # torch's pipeline stage computes a micro-batch's weight gradients whole before adding
            # them to the accumulated ones: a second copy of the stage's gradients (measured: the
            # bench's pipeline stages hold every weight's fresh gradient at their peak)
            buffers += a * (dense / shard_p[0] + experts / shard_p[1])
        if c.zero >= 3:
            unit = per["layer_dense"] + per["layer_experts"]
            if i == 0:
                unit = max(unit, per["embedding"])
            if i == last:
                unit = max(unit, per["head"])
            buffers += 2 * a * unit
        residual = 4 * (dense + experts) if c.compression != "none" else 0
        total = params + grads + optim + acts + buffers + residual
        if not best or total > best[0]:
            best = (total, params, grads, optim, acts, buffers, residual, i)
    return Memory(*best[1:7], stage=best[7])


# -- communication primitives (alpha-beta) ----------------------------------------------------------
def _ring(nbytes: float, n: int, factor: float, link: Tuple[float, float], count: int = 1) -> float:
    """factor ((n-1)/n nbytes / bandwidth + count (n-1) latency): ``nbytes`` in ``count``
    collectives (factor 2: all-reduce, 1: reduce-scatter or all-gather)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link
    return factor * ((n - 1) / n * nbytes / bw + count * (n - 1) * lat)


def all_reduce(
    cluster: Cluster,
    nbytes: float,
    span: Tuple[int, int],
    wire: float = 1.0,
    codec: float = 0.0,
    count: int = 1,
) -> float:
    """Seconds to all-reduce ``nbytes`` (in ``count`` collectives, each paying the latencies) over a
    group of ``span`` = (members per host L, hosts H): a ring on one level; across hosts
    hierarchically: reduce-scatter in the host, all-reduce of nbytes / L between hosts, all-gather
    in the host. ``wire`` scales the bytes that cross hosts (compression) and ``codec`` seconds per
    byte is paid on them (uncompressed)."""
    local, hosts = span
    intra, inter = cluster.link(False), cluster.link(True)
    if hosts == 1:
        return _ring(nbytes, local, 2, intra, count)
    crossing = nbytes / local
    t = _ring(crossing * wire, hosts, 2, inter, count) + codec * crossing
    if local > 1:
        t += 2 * _ring(nbytes, local, 1, intra, count)
    return t


def reduce_scatter(
    cluster: Cluster,
    nbytes: float,
    span: Tuple[int, int],
    wire: float = 1.0,
    codec: float = 0.0,
    count: int = 1,
) -> float:
    """Seconds to reduce-scatter (or all-gather) ``nbytes`` (the whole, unsharded size, in ``count``
    collectives): in the host (L-1)/L nbytes, then between hosts (H-1)/H of nbytes / L (times
    ``wire``, plus ``codec`` per byte crossing)."""
    local, hosts = span
    intra, inter = cluster.link(False), cluster.link(True)
    t = _ring(nbytes, local, 1, intra, count)
    if hosts > 1:
        crossing = nbytes / local
        t += _ring(crossing * wire, hosts, 1, inter, count) + codec * crossing
    return t


all_gather = reduce_scatter


def all_to_all(cluster: Cluster, nbytes: float, span: Tuple[int, int]) -> float:
    """Seconds for an all-to-all in which each device sends ``nbytes`` split evenly over the n = L H
    members: (L-1)/n of it in the host, (n-L)/n between hosts, one message per peer."""
    local, hosts = span
    n = local * hosts
    if n <= 1 or nbytes <= 0:
        return 0.0
    (bw_i, lat_i), (bw_e, lat_e) = cluster.link(False), cluster.link(True)
    return (
        (local - 1) / n * nbytes / bw_i
        + (n - local) / n * nbytes / bw_e
        + (local - 1) * lat_i
        + (n - local) * lat_e
    )


def send(cluster: Cluster, nbytes: float, inter: bool) -> float:
    """Seconds for one point-to-point transfer: nbytes / bandwidth + latency."""
    bw, lat = cluster.link(inter)
    return nbytes / bw + lat


def _level(span: Tuple[int, int]) -> str:
    local, hosts = span
    if local * hosts <= 1:
        return "none"
    return "inter" if hosts > 1 else "intra"


@lru_cache(maxsize=16384)
def spans(tp: int, cp: int, dp: int, ep: int, pp: int, devices_per_host: int) -> Dict[str, Tuple[int, int]]:
    """(members on the fullest host, hosts) of each group, ranks numbered as the mesh
    (pp, dp, cp, tp) with tp fastest and ep the inner factor of dp: ``tp``, ``cp``, ``ep``, ``pp``,
    ``dense`` (gradient replicas, dp x cp) and ``expert`` (expert replicas, dp/ep x cp x tp)."""
    dph = devices_per_host
    return {
        "tp": span_of([(tp, 1)], dph),
        "cp": span_of([(cp, tp)], dph),
        "ep": span_of([(ep, tp * cp)], dph),
        "pp": span_of([(pp, dp * cp * tp)], dph),
        "dense": span_of([(cp, tp), (dp, tp * cp)], dph),
        "expert": span_of([(tp, 1), (cp, tp), (dp // ep, tp * cp * ep)], dph),
    }


def achieved_flops(
    model: TransformerShape, cluster: Cluster, c: Candidate, assumptions: Assumptions
) -> float:
    """FLOP/s one device sustains on this layout's matrix work: peak x efficiency x T / (T + T_half),
    T = s' b tokens per micro-batch on the device, T_half = ``half_efficiency_tokens``."""
    tokens = model.seq // c.cp * (model.batch // (c.dp * c.micro_batches))
    knee = tokens / (tokens + assumptions.half_efficiency_tokens)
    return cluster.peak_for(model.dtype) * assumptions.efficiency * knee


def _mib(x: float) -> str:
    return f"{x / MiB:.1f} MiB"


# -- step time ------------------------------------------------------------------------------------
def step_time(
    model: TransformerShape,
    cluster: Cluster,
    c: Candidate,
    assumptions: Optional[Assumptions] = None,
    stages: Optional[Sequence[int]] = None,
    detail: bool = True,
) -> StepTime:
    """Seconds of one optimizer step (formulas in docs/usage/plan.md).

    The slowest pipeline stage sets the pace: per micro-batch it computes forward t_f, backward
    2 t_f and, with recomputation, one more forward of its blocks; its exposed TP, CP and EP
    communication and the per-micro-batch ZeRO-2/3 collectives add to that micro-batch time t_mb.
    Step = m t_mb + bubble + pipeline sends + the data-parallel exchanges done once per step
    (exposed parts) + the optimizer; the bubble is (pp - 1) t_mb / v for alike stages, less where
    the other stages have less work than the slowest. Matrix work runs at peak x efficiency x
    T / (T + T_half), T the tokens of one micro-batch on one device (s' b). ``detail=False``
    leaves the notes out (faster)."""
    cfg = assumptions or Assumptions()
    stages = tuple(stages or stage_layers(model.layers, c.pp))
    a = model.dtype_bytes
    m = c.micro_batches
    b = model.batch // (c.dp * m)
    s_loc = model.seq // c.cp
    rate = achieved_flops(model, cluster, c, cfg)
    split = c.tp * c.cp
    layer_f = model.layer_forward_flops()
    head_f = model.head_forward_flops()
    last = c.pp - 1
    # the slowest stage: the last when it has as many blocks as any (it also runs the head)
    most = max(stages)
    j = last if stages[last] == most else stages.index(most)
    n_layers = stages[j]
    t_f = (n_layers * layer_f + (head_f if j == last else 0)) * b / split / rate
    t_b = 2 * t_f
    t_rc = n_layers * layer_f * b / split / rate if c.recompute else 0.0
    passes = 6 if c.recompute else 4  # collectives per block: 2 forward, 2 backward, 2 recomputed
    sp = spans(c.tp, c.cp, c.dp, c.ep, c.pp, cluster.devices_per_host)
    comms: Dict[str, Comm] = {}
    per_mb = 0.0

    # tensor parallelism: each block all-reduces (reduce-scatter + all-gather with sequence
    # parallelism) its s'b h activations twice per pass; nothing hides it.
    if c.tp > 1:
        nbytes = a * s_loc * b * model.hidden
        t = n_layers * passes * all_reduce(cluster, nbytes, sp["tp"])
        per_mb += t
        comms["tp"] = Comm(
            m * t,
            m * t,
            _level(sp["tp"]),
            f"{passes} all-reduces of {_mib(nbytes)} per block and micro-batch, exposed" if detail else "",
        )

    # context parallelism: K/V go around the ring (cp - 1 hops) in the forward, K/V and their
    # gradients in the backward; each hop hides behind the attention of one block of keys.
    if c.cp > 1:
        kv = a * 2 * s_loc * b * model.head_dim * kv_heads_per_rank(model, c.tp)
        hop = send(cluster, kv, sp["cp"][1] > 1)
        attn_f = 4 * model.seq * model.seq * model.q_dim * b / split / rate
        fwd, bwd = (c.cp - 1) * hop, 2 * (c.cp - 1) * hop
        exposed = max(0.0, fwd - attn_f) + max(0.0, bwd - 2 * attn_f)
        total = fwd + bwd
        if c.recompute:
            exposed += max(0.0, fwd - attn_f)
            total += fwd
        per_mb += n_layers * exposed
        comms["cp"] = Comm(
            m * n_layers * total,
            m * n_layers * exposed,
            _level(sp["cp"]),
            f"K/V ring: {c.cp - 1} hop{'s' if c.cp > 2 else ''} of {_mib(kv)} per block and pass, "
            "behind attention"
            if detail
            else "",
        )

    # expert parallelism: dispatch and combine all-to-alls, twice per pass, of the tokens this
    # device routes (s'b / t) x top_k rows of h.
    if c.ep > 1:
        rows = a * s_loc * b / c.tp * model.top_k * model.hidden
        t = n_layers * passes * all_to_all(cluster, rows, sp["ep"])
        per_mb += t
        comms["ep"] = Comm(
            m * t,
            m * t,
            _level(sp["ep"]),
            f"{passes} all-to-alls of {_mib(rows)} per MoE block and micro-batch, exposed" if detail else "",
        )

    # data parallelism over the dense replicas (dp x cp) and the expert replicas (dp cp tp / ep)
    n_dp, n_edp = dp_sizes(c)
    if n_dp > 1 or n_edp > 1:
        per = _device_params(model, c.tp, c.ep, c.pp)
        dense_p, expert_p = max(
            (_stage_params(model, c, i, stages[i], per) for i in _stages_to_check(stages)),
            key=lambda p: p[0] + p[1],
        )
        compressed = c.compression != "none"
        wire = WIRE_BYTES[c.compression] / a if compressed else 1.0
        codec = cfg.codec_seconds_per_byte if compressed else 0.0
        g_dense, g_expert = a * dense_p, a * expert_p
        if c.zero >= 3:  # one gather and one reduce-scatter per unit (block, embedding, head)
            units = n_layers + int(j == 0) + int(j == last)
            k_dense = k_expert = units
        else:  # one collective per gradient bucket
            k_dense = max(1, -(-int(g_dense) // cfg.bucket_bytes))
            k_expert = max(1, -(-int(g_expert) // cfg.bucket_bytes))
        reduce_op = all_reduce if c.zero == 0 else reduce_scatter
        # experts apart: one exact flat all-reduce over their replicas after the backward, nothing
        # to hide behind (none where an expert has no replica)
        apart = experts_apart(model, c)
        red = reduce_op(cluster, g_dense, sp["dense"], wire, codec, k_dense)
        red_apart = 0.0
        if apart:
            red_apart = all_reduce(cluster, g_expert, sp["expert"])
        else:
            red += reduce_op(cluster, g_expert, sp["expert"], wire, codec, k_expert)
        gather = 0.0
        if c.zero >= 1:
            gather = all_gather(cluster, g_dense, sp["dense"], count=k_dense)
            if not apart:
                gather += all_gather(cluster, g_expert, sp["expert"], count=k_expert)
        ov = cfg.overlap
        level = _level(sp["dense"]) if n_dp > 1 else _level(sp["expert"])
        what = ("all-reduce" if c.zero == 0 else "reduce-scatter") + (
            f" ({c.compression})" if compressed else ""
        )
        backward = t_b + t_rc
        red_exposed = max(0.0, red - ov * backward)
        if red_apart:  # once per step, after the last micro-batch's backward
            comms["expert_dp"] = Comm(
                red_apart,
                red_apart,
                _level(sp["expert"]),
                "experts' gradient all-reduce over their replicas after the backward, exposed"
                if detail
                else "",
            )
        if c.zero <= 1:
            comms["dp"] = Comm(
                red,
                red_exposed,
                level,
                f"gradient {what} in {k_dense + (k_expert if expert_p else 0)} buckets after "
                "the last micro-batch, behind its backward"
                if detail
                else "",
            )
        else:
            per_mb += red_exposed
            comms["dp"] = Comm(
                m * red,
                m * red_exposed,
                level,
                f"gradient {what} every micro-batch, behind its backward" if detail else "",
            )
        if c.zero in (1, 2):
            exposed = max(0.0, gather - ov * t_f)
            comms["zero_gather"] = Comm(
                gather,
                exposed,
                level,
                "parameter all-gather after the optimizer step, behind the next forward" if detail else "",
            )
        elif c.zero == 3:
            # forward: the gathers behind the forward; backward: gathers and reduce-scatters share it
            exposed = max(0.0, gather - ov * t_f) + max(0.0, gather + red - ov * backward) - red_exposed
            per_mb += exposed
            comms["zero_gather"] = Comm(
                2 * m * gather,
                m * exposed,
                level,
                f"parameter all-gathers, {units} per forward and per backward, behind them" if detail else "",
            )

    t_mb = t_f + t_b + t_rc + per_mb
    # Filling and draining the pipeline passes each micro-batch through every other stage once:
    # (sum of the stages' micro-batch times - the slowest's) / v, the others' times scaled from
    # the slowest's by their work (blocks, and the head on the last); (pp - 1) t_mb / v when alike.
    work = [n * layer_f + (head_f if i == last else 0) for i, n in enumerate(stages)]
    bubble = (sum(work) - work[j]) / work[j] * t_mb / c.interleave if c.pp > 1 else 0.0
    if c.pp > 1:
        nbytes = a * s_loc * b * model.hidden / c.tp
        one = send(cluster, nbytes, sp["pp"][1] > 1)
        hops = 2 * (c.interleave * m + c.pp - 2)
        comms["pp"] = Comm(
            hops * one,
            hops * one,
            _level(sp["pp"]),
            f"{hops} sends of {_mib(nbytes)} on the critical path" if detail else "",
        )
    t_opt = 0.0
    if cfg.optimizer_seconds_per_param:
        per = _device_params(model, c.tp, c.ep, c.pp)
        n_dp, n_edp = dp_sizes(c)
        shard = (n_dp, n_edp) if c.zero >= 1 else (1, 1)
        t_opt = cfg.optimizer_seconds_per_param * max(
            d / shard[0] + e / shard[1]
            for d, e in (_stage_params(model, c, i, stages[i], per) for i in _stages_to_check(stages))
        )
    return StepTime(m * (t_f + t_b + t_rc), m * t_rc, bubble, comms, t_opt)


def mfu(model: TransformerShape, cluster: Cluster, step: float) -> float:
    """Model FLOPs utilisation: model FLOPs of a step (no recomputation) / (step x devices x peak)."""
    return model.model_flops() / (step * cluster.devices * cluster.peak_for(model.dtype))
