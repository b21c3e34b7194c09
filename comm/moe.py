"""Mixture-of-experts expert parallelism: routing, token dispatch and combine over any group, the MoE layer.

    from braid.comm import moe
    layer = moe.MoE(d_model, num_experts=16, top_k=2, group=c)       # rank r holds 16/N experts
    layer = moe.MoE.from_dense(router, experts, c, top_k=2)          # the same, from dense weights
    y, aux = layer(x)                                                 # x: (..., d_model)
    (task_loss(y) + aux).backward()

    inputs, handle = moe.dispatch(x, expert_ids, weights, c, num_experts=E)   # your own experts:
    outputs = grouped_gemm(inputs, handle.counts)                            # tokens of one local
    y = moe.combine(outputs, handle)                                         # expert contiguous

Vocabulary. ``N`` ranks in the expert-parallel group, ``E`` experts, rank r holds the ``E / N``
experts ``[r E / N, (r + 1) E / N)`` (its *local* experts); a *token* is a row of ``x``; an
*assignment* is one (token, expert) choice of the router (``top_k`` per token).

Routing (:func:`route`), in float32 or wider: softmax of the router's logits, top-k, weights
renormalised to sum to 1 (``normalize_topk``). Dropless by default; with ``capacity_factor`` c each
expert takes at most ``C = ceil(c * T * top_k / E)`` of this rank's ``T`` tokens, keeping those
with the highest routing weight (``drop_policy="probs"``) or the first ones in token order
(``"position"``); ties go to the earlier token. A dropped assignment contributes nothing; the
token's other weights are not renormalised. Losses: the load-balancing loss of Switch/Megatron,
``aux_loss_coeff * E * sum_e f_e P_e`` (``f_e`` the share of this rank's assignments routed to e
before drops, ``P_e`` the mean router probability of e over this rank's tokens), and the router
z-loss, ``z_loss_coeff * mean_t logsumexp(logits_t)^2``. Auxiliary-loss-free balancing
(DeepSeek-V3): a per-expert bias added to the probabilities for the top-k *selection* only (the
weights stay the unbiased probabilities), moved by ``bias_update_rate * sign(mean load - load)``
by :meth:`MoE.update_expert_bias`, one all-reduce of the loads per step.

Dispatch, flat (one group): counts first (an equal all-to-all of each rank's assignments per
expert), then the rows by the group's uneven all-to-all, one row per assignment, sorted by
expert; what arrives is reordered so that the rows of each local expert are contiguous (source
rank order within an expert). Combine is the reverse exchange, then the weighted sum on the
token's home rank. Both are differentiable: the backward of one is the other's exchange.

Dispatch across hosts (``hosts``, a :class:`~braid.comm.group_carrier.HostGroups`): a token
crosses to each remote host holding one of its experts once, to the rank with its own local index
there (``hosts.inter``), carrying its weights and its targets on that host; that rank fans it out
over the host's group (``hosts.intra``, shared memory on a Communicator) as in the flat dispatch.
Combine sums the token's experts of a host there, weighted, and one partial sum per host crosses
back. Compressed dispatch (``compression="int8"`` or ``"fp8"``): the dispatched activations travel
as one byte per element and a float32 scale per row (:class:`RowQuantizer`), so every expert sees
the same quantized token wherever it runs; on hosts they are quantized once and cross quantized,
then fan out exactly. The combine and both backward exchanges are exact.

Devices. Tensors a dispatch or the layer makes live on the tokens' device. The host reads small
metadata where the sizes of an exchange depend on the data: once per exchange hop of a dropless
or capacity dispatch (the counts each rank sends per expert, one device-to-host copy), and once at
the layer's first forward (where the ranks sit: one all-gather over the group, in host memory
where the group takes it, else on the tokens' device, as on an NCCL group; kept for later
forwards, as :func:`dispatch` keeps it per ``hosts``).

Padded to capacity (``MoE(..., capacity_factor=c, pad_to_capacity=True)``): every expert gets
exactly ``C`` rows from every rank, zero rows after the kept ones, so every exchange has equal
pieces known from shapes and, after the first forward, nothing is read on the host (no counts
exchange, no ``.tolist()``): a GPU's stream never waits for the host. Every rank must then hold
the same number of tokens: the first forward checks it (its all-gather carries every rank's
count) and raises ValueError on every rank; later forwards trust it, a check there would be a
collective or a host read per forward (a braid Communicator still refuses unequal pieces at the
exchange, with CollectiveMismatch; other backends may not notice).

Every dispatch and combine is a collective of the group (of ``hosts.inter`` and ``hosts.intra``
across hosts): every rank calls them in the same order, and every rank runs the backward through
the layer, tokens or not (a rank with no tokens sends and receives empty pieces).

Expert and data parallelism together: :func:`reduce_gradients` (docs/design/layers.md, "Expert parallelism").
"""
from __future__ import annotations

import hashlib
import math
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .group import Group, as_group, check_device
from .group_carrier import HostGroups, resolve_hosts
from .hosts import host_identity, host_numbers

DROP_POLICIES = ("probs", "position")
COMPRESSIONS = ("int8", "fp8")


# -- argument checks -------------------------------------------------------------------------------

def _positive_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


def _check_experts(num_experts: int, top_k: int, world_size: int, where: str) -> None:
    _positive_int(num_experts, "num_experts", where)
    _positive_int(top_k, "top_k", where)
    if top_k > num_experts:
        raise ValueError(f"{where}: top_k={top_k} is larger than num_experts={num_experts}")
    if num_experts % world_size:
        raise ValueError(f"{where}: num_experts={num_experts} does not divide by the group's {world_size} "
                         "ranks (each rank holds num_experts / world_size experts)")


def _check_capacity(capacity_factor: Any, drop_policy: Any, where: str) -> None:
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
                or not math.isfinite(capacity_factor) or capacity_factor <= 0:
            raise ValueError(f"{where}: capacity_factor must be None (dropless) or a positive finite number, "
                             f"got {capacity_factor!r}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"{where}: drop_policy must be one of {', '.join(map(repr, DROP_POLICIES))}, "
                         f"got {drop_policy!r}")


def _codec(compression: Any, where: str) -> Optional["RowQuantizer"]:
    if compression is None or isinstance(compression, RowQuantizer):
        return compression
    if compression not in COMPRESSIONS:
        raise ValueError(f"{where}: compression must be None, {', '.join(map(repr, COMPRESSIONS))} or a "
                         f"RowQuantizer, got {compression!r}")
    return RowQuantizer(compression)


# -- compressed dispatch ---------------------------------------------------------------------------

class RowQuantizer:
    """Per-row (per-token) scaled quantization of the activations a dispatch sends.

    A row of ``d`` values travels as ``d`` one-byte codes and one float32 scale, its largest
    magnitude over the format's largest value: ``"int8"`` rounds ``x / scale`` to the nearest
    integer in [-127, 127] (error at most ``scale / 2`` per element, ``absmax / 254``); ``"fp8"``
    rounds it to float8 e4m3 (as DeepEP sends), 3 mantissa bits (a relative error of at most 2^-4 per
    element above ``scale * 2^-6``, at most ``scale * 2^-10`` below). Arithmetic runs in float32,
    or float64 for float64 rows; decoding returns the rows' dtype."""

    def __init__(self, fmt: str = "int8"):
        if fmt == "int8":
            self.storage, self.qmax = torch.int8, 127.0
        elif fmt == "fp8":
            if not hasattr(torch, "float8_e4m3fn"):
                raise ValueError("compression='fp8' needs a torch with float8 dtypes (torch.float8_e4m3fn)")
            self.storage, self.qmax = torch.float8_e4m3fn, 448.0
        else:
            raise ValueError(f"fmt must be 'int8' or 'fp8', got {fmt!r}")
        self.fmt = fmt

    def row_bytes(self, d: int) -> int:
        """Bytes of one encoded row of ``d`` values."""
        return d + 4

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(R, d) floating rows -> (R, d + 4) uint8: the codes, then the scale's bytes."""
        work = torch.promote_types(x.dtype, torch.float32)
        xw = x.to(work)
        if x.shape[0]:
            scale = (xw.abs().amax(1) / self.qmax).to(torch.float32)
        else:
            scale = xw.new_zeros(0, dtype=torch.float32)
        s = scale.to(work)
        q = xw / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1)
        if self.storage is torch.int8:
            q = q.round_().clamp_(-self.qmax, self.qmax).to(torch.int8)
        else:
            q = q.clamp_(-self.qmax, self.qmax).to(self.storage)
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8).view(-1, 4)], 1)

    def decode(self, payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(R, d + 4) uint8 from :meth:`encode` -> (R, d) rows of ``dtype``."""
        d = payload.shape[1] - 4
        work = torch.promote_types(dtype, torch.float32)
        codes = payload[:, :d].contiguous().view(self.storage).to(work)
        scale = payload[:, d:].clone(memory_format=torch.contiguous_format).view(torch.float32).to(work)
        return (codes * scale).to(dtype)

    def __repr__(self) -> str:
        return f"RowQuantizer({self.fmt!r})"


# -- the exchange of rows --------------------------------------------------------------------------

def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """(R, w) -> (R, w * itemsize) uint8, the same memory where ``t`` is contiguous."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], -1)


def _exchange(group: Any, parts: Sequence[torch.Tensor], send: Optional[list], recv: Optional[list],
              codec: Optional[RowQuantizer]) -> list:
    """Rows of ``parts`` (2-D, equal row counts) to the ranks, ``send[j]`` rows to rank j, and
    ``recv[j]`` rows from rank j, in rank order. Several parts (a token's row, its weights and
    targets) travel as one byte matrix, one exchange; ``codec`` encodes the first part."""
    if group.world_size == 1:  # nothing moves; a codec still rounds, as on any other group
        out = list(parts)
        if codec is not None:
            out[0] = codec.decode(codec.encode(parts[0]), parts[0].dtype)
        return out
    # ``send`` None: equal pieces (the padded dispatch's; every rank passes None, so every rank
    # calls the same collective), by the equal all-to-all: no split sizes, which braid's
    # Communicator takes on CUDA tensors only through host memory with the host waiting.
    equal = send is None
    total = parts[0].shape[0] if equal else sum(recv)
    splits = {} if equal else {"output_split_sizes": recv, "input_split_sizes": send}
    if codec is None and len(parts) == 1:
        p = parts[0].contiguous()
        out = p.new_empty((total, *p.shape[1:]))
        group.all_to_all(out, p, **splits)
        return [out]
    first = codec.encode(parts[0]) if codec is not None else _as_bytes(parts[0])
    columns = [first, *(_as_bytes(p) for p in parts[1:])]
    payload = torch.cat(columns, 1)
    got = payload.new_empty((total, payload.shape[1]))
    group.all_to_all(got, payload, **splits)
    out, at = [], 0
    for i, (part, col) in enumerate(zip(parts, columns)):
        piece = got[:, at:at + col.shape[1]]
        at += col.shape[1]
        if i == 0 and codec is not None:
            out.append(codec.decode(piece, part.dtype))
        else:
            # A copy (not contiguous(), which keeps an empty slice's offset): aligned for the view.
            fresh = piece.clone(memory_format=torch.contiguous_format)
            out.append(fresh.view(part.dtype).view(total, *part.shape[1:]))
    return out


class _Exchange(torch.autograd.Function):
    """:func:`_exchange` as an autograd function: the backward sends the gradients of the parts
    that need one back along the same pairs (the reverse splits), exact, whatever the forward's
    codec (a straight-through estimate of the rounding). Which parts need a gradient must be the
    same on every rank (it is, where every rank runs the same model): it sets what travels."""

    @staticmethod
    def forward(ctx, group, send, recv, codec, *parts):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        ctx.floating = [p.is_floating_point() for p in parts]
        outs = _exchange(group, parts, send, recv, codec)
        ctx.mark_non_differentiable(*[o for o, f in zip(outs, ctx.floating) if not f])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        wanted = [f and need for f, need in zip(ctx.floating, ctx.needs_input_grad[4:])]
        back = iter(_exchange(ctx.group, [g.contiguous() for g, w in zip(grads, wanted) if w], ctx.recv,
                              ctx.send, None))
        return (None, None, None, None, *[next(back) if w else None for w in wanted])


def _exchange_counts(group: Any, counts: torch.Tensor) -> torch.Tensor:
    """Equal all-to-all of int64 ``counts`` (world_size pieces): piece j to rank j."""
    if group.world_size == 1:
        return counts.clone()
    out = torch.empty_like(counts)
    group.all_to_all(out, counts)
    return out


def _expert_major(counts: torch.Tensor, total: int) -> Optional[torch.Tensor]:
    """Rows arrive source-major: from rank s, the rows of local expert e, ``counts[s, e]`` of them,
    ``total`` in all (known on the host). Returns the indices, on the counts' device, that put
    them expert-major (the rows of one expert contiguous, source ranks in order within it); None
    when they already are (one source or one expert)."""
    n, local = counts.shape
    if n == 1 or local == 1:
        return None
    source_start = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(n, local)
    lengths = counts.t().reshape(-1)           # block (e, s), expert-major
    starts = source_start.t().reshape(-1)      # where block (e, s) sits in the arrival order
    dest_start = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(
        starts - dest_start, lengths, output_size=total)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


# -- where the ranks sit ----------------------------------------------------------------------------

def _metadata_device(group: Any, device: torch.device) -> torch.device:
    """Where ``group``'s exchanges of host metadata run: in host memory where the group takes CPU
    tensors (a Communicator, gloo: no copy to the device and back), else on ``device``, the
    tokens' (an NCCL group takes CUDA tensors only). A duck-typed group is taken to hold CPU."""
    host = torch.device("cpu")
    if isinstance(group, Group) and group.device_problem(host) is not None:
        return torch.device(device)
    return host


class _RankLayout:
    """Where the ranks of a group sit: each rank's host (numbered from 0, as braid's communicator
    tells hosts apart) or, split by host (``hosts``), its host and its index there (``hosts.inter``'s
    rank and ``hosts.intra``'s, checked to cover every pair once), and every rank's token count
    when gathered (``tokens``: the padded layer's check). One all-gather over the group on the
    metadata device (:func:`_metadata_device`), read on the host once; tensors of it are kept per
    device (:meth:`on`)."""

    def __init__(self, group: Any, device: torch.device, hosts: Optional[HostGroups] = None, tokens: int = 0):
        n = group.world_size
        self.inter = self.intra = None
        if hosts is not None:
            self.intra = as_group(hosts.intra.group, "hosts")
            self.inter = as_group(hosts.inter.group, "hosts")
            h, local = self.inter.world_size, self.intra.world_size
            if h * local != n:
                raise ValueError(f"hosts: {h} hosts x {local} ranks do not make the group's {n} ranks")
            mine = [self.inter.rank, self.intra.rank, tokens]
        else:  # a hash of the host identity: equal on ranks that share a host
            digest = hashlib.sha256(host_identity().encode()).digest()[:8]
            mine = [int.from_bytes(digest, "little", signed=True), 0, tokens]
        rows = [mine]
        if n > 1:
            where = _metadata_device(group, device)
            table = torch.empty(3 * n, dtype=torch.int64, device=where)
            group.all_gather(table, torch.tensor(mine, dtype=torch.int64, device=where))
            flat = table.tolist()  # the layout's one read on the host
            rows = [flat[3 * r:3 * r + 3] for r in range(n)]
        self.tokens = [row[2] for row in rows]
        if hosts is None:
            self.hosts, self.locals = host_numbers([str(row[0]) for row in rows]), None
        else:
            self.hosts, self.locals = [row[0] for row in rows], [row[1] for row in rows]
            if sorted(zip(self.hosts, self.locals)) != [(a, b) for a in range(h) for b in range(local)]:
                raise ValueError(f"hosts: the HostGroups are not this group's split by host (every rank must "
                                 f"be rank i of its host's intra group and rank h of its inter group; got "
                                 f"(host, local) {list(zip(self.hosts, self.locals))})")
        self.num_hosts = max(self.hosts) + 1
        self._on: dict = {}

    def on(self, device: torch.device) -> tuple:
        """(host of each rank, local index of each rank or None without ``hosts``) as int64
        tensors on ``device``, made at the first call for that device."""
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = tuple(
                None if v is None else torch.tensor(v, dtype=torch.int64, device=device)
                for v in (self.hosts, self.locals))
        return found


# The layout of each HostGroups dispatch() has used, with its group: gathered once, not per call.
_LAYOUTS: "weakref.WeakKeyDictionary[HostGroups, tuple]" = weakref.WeakKeyDictionary()


# -- dispatch and combine --------------------------------------------------------------------------

class DispatchHandle:
    """What :func:`combine` needs to bring the experts' outputs home, and what the dispatch moved.

    ``counts`` (a list) and ``tokens_per_expert`` (an int64 tensor on the tokens' device): rows
    of each local expert in the expert inputs, in local expert order. :meth:`stats` tells what
    crossed between hosts."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, tokens_per_expert: torch.Tensor, counts: list):
        self.shape, self.dtype = shape, dtype
        self.tokens_per_expert = tokens_per_expert
        self.counts = counts
        self._hops: list = []   # (kind, state) of each exchange hop, the home side first
        self._across: Optional[dict] = None
        self._grad_row_bytes = 0   # bytes of the gradient of one dispatched row (the backward's)
        self._partial_dtype: Optional[torch.dtype] = None   # across hosts: the partial sums' dtype

    def stats(self) -> Optional[dict]:
        """This rank's share of what crossed between hosts, where the host of every rank is known
        (dispatch with ``hosts``, or the MoE layer); None where it is not. ``rows``: dispatched
        rows sent to other hosts (``rows_received``: from them); ``rows_lower_bound``: (token,
        remote host) pairs, the least any dispatch sends; ``bytes``: bytes sent to other hosts by
        the dispatch, the combine (once it ran) and the backward of both (the gradients of the
        same rows, exact, counted as if the tokens need theirs). Reading ``rows_lower_bound``
        after a flat dispatch copies it from the tokens' device (the dispatch leaves it there)."""
        return _across_stats(self._across)


def _across_stats(across: Optional[dict]) -> Optional[dict]:
    """A copy of a dispatch's record of what crossed between hosts, every number an int."""
    if across is None:
        return None
    return dict(across, rows_lower_bound=int(across["rows_lower_bound"]), bytes=dict(across["bytes"]))


def _flat_dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: Any, num_experts: int,
                   codec: Optional[RowQuantizer]) -> tuple:
    """Dispatch over one group: (expert inputs, rows per local expert as a tensor and as a list,
    the combine's state). The host reads the counts once: what arrives from each rank per local
    expert and what this rank sends to each, in one device-to-host copy."""
    n = group.world_size
    local = num_experts // n
    k = ids.shape[1]
    flat = ids.reshape(-1)
    # Assignments to no expert (-1) sort after every expert: the others come first, by expert, in
    # token order within one (a stable sort), without a host read to count them.
    key = torch.where(flat >= 0, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = _count(key, num_experts + 1)[:num_experts]
    arriving = _exchange_counts(group, counts)   # [source rank, local expert], flattened
    read = torch.cat([arriving, counts.view(n, local).sum(1)]).tolist()
    table = [read[s * local:(s + 1) * local] for s in range(n)]
    send = read[n * local:]
    recv = [sum(row) for row in table]
    assignment = order[:sum(send)]            # by expert, in token order within an expert
    token = torch.div(assignment, k, rounding_mode="floor")
    (rows,) = _Exchange.apply(group, send, recv, codec, x.index_select(0, token))
    perm = _expert_major(arriving.view(n, local), sum(recv))
    inputs = rows if perm is None else rows.index_select(0, perm)
    state = {"group": group, "send": send, "recv": recv, "token": token, "perm": perm,
             "weights": weights.reshape(-1).index_select(0, assignment), "tokens": x.shape[0]}
    per_expert = [sum(row[e] for row in table) for e in range(local)]
    return inputs, arriving.view(n, local).sum(0), per_expert, state


def _flat_combine(outputs: torch.Tensor, state: dict) -> torch.Tensor:
    """The reverse of :func:`_flat_dispatch`: each row home, weighted, summed per token (in the
    wider of the rows' and weights' dtypes)."""
    perm = state["perm"]
    rows = outputs if perm is None else outputs.index_select(0, _inverse(perm))
    (back,) = _Exchange.apply(state["group"], state["recv"], state["send"], None, rows)
    w = state["weights"]
    acc = torch.promote_types(back.dtype, w.dtype)
    y = back.new_zeros((state["tokens"], back.shape[1]), dtype=acc)
    return y.index_add_(0, state["token"], back.to(acc) * w.to(acc).unsqueeze(1))


def _padded_dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: Any, num_experts: int,
                     codec: Optional[RowQuantizer], cap: int) -> tuple:
    """Dispatch padded to capacity (``pad_to_capacity``): every expert gets ``cap`` rows from every
    rank, the assignments it keeps (``ids`` already -1 past capacity) in token order and zero rows
    after them, so that every exchange has equal pieces known from shapes: no counts to exchange
    and no device-to-host copy (a GPU's stream never waits for the host). The experts compute the
    padding rows too; their outputs come back with weight 0."""
    n = group.world_size
    local = num_experts // n
    t, k = ids.shape
    flat = ids.reshape(-1)
    valid = flat >= 0
    expert = flat.clamp(min=0)
    # Its place among its expert's assignments, in token order (one-hot rows by scatter: one_hot
    # would check its input's range on the host).
    onehot = torch.zeros((t * k, num_experts), dtype=torch.int64, device=ids.device).scatter_(
        1, expert.unsqueeze(1), valid.unsqueeze(1).to(torch.int64))
    position = (onehot.cumsum(0) - 1).gather(1, expert.unsqueeze(1)).squeeze(1)
    kept = valid & (position < cap)
    spare = num_experts * cap  # the slot of everything not kept, cut off below
    slot = torch.where(kept, expert * cap + position, spare)
    token = torch.arange(t * k, device=ids.device) // k
    rows = x.new_zeros((spare + 1, x.shape[1])).index_put((slot,), x.index_select(0, token))[:spare]
    (got,) = _Exchange.apply(group, None, None, codec, rows)   # equal pieces: local * cap rows each
    # From each source rank its rows of local expert 0, 1, ...: expert-major, source order within.
    inputs = got.view(n, local, cap, -1).transpose(0, 1).reshape(local * n * cap, -1)
    w = torch.where(kept, weights.reshape(-1), torch.zeros((), dtype=weights.dtype, device=weights.device))
    state = {"group": group, "slot": slot, "token": token, "weights": w, "tokens": t,
             "n": n, "local": local, "cap": cap}
    counts = torch.full((local,), n * cap, dtype=torch.int64, device=ids.device)
    return inputs, counts, state


def _padded_combine(outputs: torch.Tensor, state: dict) -> torch.Tensor:
    """The reverse of :func:`_padded_dispatch`: every slot home, each assignment's output weighted
    and summed per token (dropped ones and padding weigh 0)."""
    n, local, cap = state["n"], state["local"], state["cap"]
    rows = outputs.view(local, n, cap, -1).transpose(0, 1).reshape(n * local * cap, -1)
    (back,) = _Exchange.apply(state["group"], None, None, None, rows)
    back = torch.cat([back, back.new_zeros((1, back.shape[1]))])   # the spare slot: zeros
    w = state["weights"]
    acc = torch.promote_types(back.dtype, w.dtype)
    mine = back.index_select(0, state["slot"]).to(acc) * w.to(acc).unsqueeze(1)
    y = back.new_zeros((state["tokens"], back.shape[1]), dtype=acc)
    return y.index_add_(0, state["token"], mine)


def _hosts_needed(ids: torch.Tensor, host_of: torch.Tensor, local: int, hosts: int) -> tuple:
    """For the assignments ``ids`` (T, k) (-1: none) on ranks of hosts ``host_of``, ``local``
    experts per rank: (need, host), need[t, h] whether token t has an expert on host h, host the
    host of each assignment (-1 for none)."""
    valid = ids >= 0
    host = torch.where(valid, host_of[torch.where(valid, ids, 0) // local], -1)
    need = (host.unsqueeze(2) == torch.arange(hosts, device=ids.device)).any(1)
    return need, host


def _dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: Any, num_experts: int,
              codec: Optional[RowQuantizer], layout: Optional[_RankLayout]) -> tuple:
    """:func:`dispatch` after its checks, on 2-D ``x``, ``ids``, ``weights``. ``layout``: split by
    host, a dispatch across hosts; without, where the ranks sit, for the statistics of a flat
    dispatch (None: no statistics)."""
    n = group.world_size
    local = num_experts // n
    k = ids.shape[1]
    if layout is None or layout.inter is None:
        inputs, counts, per_expert, state = _flat_dispatch(x, ids, weights, group, num_experts, codec)
        handle = DispatchHandle(x.shape, x.dtype, counts, per_expert)
        handle._hops = [("flat", state)]
        if layout is not None:
            mine = layout.hosts[group.rank]
            remote = [h != mine for h in layout.hosts]
            sent = sum(c for c, r in zip(state["send"], remote) if r)
            got = sum(c for c, r in zip(state["recv"], remote) if r)
            row = codec.row_bytes(x.shape[1]) if codec else x.shape[1] * x.element_size()
            # (token, remote host) pairs: what a dispatch sending each token once per remote
            # host sends. Left on the device, read when stats() asks.
            need, _ = _hosts_needed(ids, layout.on(x.device)[0], local, layout.num_hosts)
            handle._across = {"rows": sent, "rows_received": got,
                              "rows_lower_bound": need.sum() - need[:, mine].sum(),
                              "bytes": {"dispatch": sent * row, "combine": 0, "backward": 0}}
            handle._grad_row_bytes = x.shape[1] * x.element_size()
        return inputs, handle
    # Across hosts. Hop 1 (hosts.inter): token t crosses to host h once if one of its experts
    # lives there, with its k weights and its k targets on h (-1 for experts elsewhere), each
    # target the expert's number among the host's experts (local index * local + its index).
    hosts = layout.inter.world_size
    host_of, local_of = layout.on(x.device)
    need, host = _hosts_needed(ids, host_of, local, hosts)             # [token, host]
    expert = torch.where(ids >= 0, ids, 0)
    target = local_of[expert // local] * local + expert % local
    send_counts = need.sum(0)
    arriving = _exchange_counts(layout.inter, send_counts)
    host_counts = torch.cat([send_counts, arriving]).tolist()          # the hop's one read on the host
    send, recv = host_counts[:hosts], host_counts[hosts:]
    # The (host, token) pairs, by host, token order within: the set entries of need.t() in order,
    # first after a stable sort, sum(send) of them. (Without tokens there are none; any divisor.)
    t = x.shape[0]
    pairs = torch.argsort((~need.t()).reshape(-1).to(torch.uint8), stable=True)[:sum(send)]
    row_host = torch.div(pairs, max(t, 1), rounding_mode="floor")
    row_token = pairs - row_host * t
    targets = torch.where(host.index_select(0, row_token) == row_host.unsqueeze(1),
                          target.index_select(0, row_token), -1).to(torch.int32)
    x1, w1, t1 = _Exchange.apply(layout.inter, send, recv, codec, x.index_select(0, row_token),
                                 weights.index_select(0, row_token), targets)
    # Hop 2 (hosts.intra): the rows that arrived fan out to this host's experts, exact.
    inputs, counts, per_expert, state = _flat_dispatch(x1, t1.long(), w1, layout.intra,
                                                       layout.intra.world_size * local, None)
    handle = DispatchHandle(x.shape, x.dtype, counts, per_expert)
    handle._hops = [("hosts", {"group": layout.inter, "send": send, "recv": recv, "token": row_token,
                                 "tokens": x.shape[0]}), ("flat", state)]
    me = layout.inter.rank
    sent, got = sum(send) - send[me], sum(recv) - recv[me]
    # A row carries its k weights and k int32 targets; its gradient, the weights' gradients.
    row = codec.row_bytes(x.shape[1]) if codec else x.shape[1] * x.element_size()
    row += k * (weights.element_size() + 4)
    # Each (token, remote host) pair crosses once: the rows sent are the lower bound.
    handle._across = {"rows": sent, "rows_received": got, "rows_lower_bound": sent,
                      "bytes": {"dispatch": sent * row, "combine": 0, "backward": 0}}
    handle._grad_row_bytes = x.shape[1] * x.element_size() + k * weights.element_size()
    handle._partial_dtype = x.dtype
    return inputs, handle


def _combine(outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    y = None
    for kind, state in reversed(handle._hops):
        if kind == "flat":
            y = _flat_combine(outputs, state)
        elif kind == "padded":
            y = _padded_combine(outputs, state)
        else:  # one partial sum per (token, host) crosses back, in the activations' dtype
            (back,) = _Exchange.apply(state["group"], state["recv"], state["send"], None,
                                      y.to(handle._partial_dtype))
            y = back.new_zeros((state["tokens"], back.shape[1])).index_add_(0, state["token"], back)
    across = handle._across
    if across is not None:  # the combine sends back what arrived; its backward, gradients of that
        out_row = outputs.shape[1] * (handle._partial_dtype or outputs.dtype).itemsize
        across["bytes"]["combine"] = across["rows_received"] * out_row
        across["bytes"]["backward"] = (across["rows"] * out_row
                                       + across["rows_received"] * handle._grad_row_bytes)
    return y.to(handle.dtype).reshape(*handle.shape[:-1], y.shape[1])


def _check_dispatch(x: Any, expert_ids: Any, weights: Any, num_experts: Any, n: int) -> None:
    where = "dispatch"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"{where}: x must be a floating tensor of shape (..., d), got "
                        f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.is_floating_point() or expert_ids.is_complex() \
            or expert_ids.dtype == torch.bool:
        raise TypeError(f"{where}: expert_ids must be an integer tensor of shape (..., top_k)")
    if expert_ids.shape[:-1] != x.shape[:-1] or expert_ids.dim() != x.dim():
        raise ValueError(f"{where}: expert_ids must have shape (..., top_k) with x's leading dimensions "
                         f"{tuple(x.shape[:-1])}, got {tuple(expert_ids.shape)}")
    if not isinstance(weights, torch.Tensor) or weights.shape != expert_ids.shape \
            or not weights.is_floating_point():
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"{where}: weights must be a floating tensor of expert_ids' shape "
                         f"{tuple(expert_ids.shape)}, got {got}")
    for name, t in (("expert_ids", expert_ids), ("weights", weights)):
        if t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device} and x on {x.device}: x, expert_ids and "
                             "weights must share a device")
    _positive_int(num_experts, "num_experts", where)
    if num_experts % n:
        raise ValueError(f"{where}: num_experts={num_experts} does not divide by the group's {n} ranks")
    if expert_ids.numel():
        low, high = torch.stack([expert_ids.min(), expert_ids.max()]).tolist()  # one read on the host
        if high >= num_experts or low < -1:
            raise ValueError(f"{where}: expert_ids must lie in [0, num_experts={num_experts}) (or -1: no "
                             f"expert), got values in [{low}, {high}]")


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, group: Any = None, *,
             num_experts: int, compression: Union[None, str, RowQuantizer] = None,
             hosts: Optional[HostGroups] = None) -> tuple:
    """Sends each token to the ranks holding its experts; returns ``(expert_inputs, handle)``.

    ``x`` (..., d) the tokens; ``expert_ids`` (..., k) the experts of each token (-1: none, as a
    dropped assignment); ``weights`` (..., k) their weights, applied by :func:`combine`.
    ``expert_inputs`` holds one row per assignment to one of this rank's experts, those of each
    local expert contiguous, in local expert order (``handle.counts`` rows each), source rank
    order then token order within an expert. ``group``: a Communicator, a ProcessGroup or None
    (the default group); ``hosts``: the group split by host (across hosts: each token crosses to
    a host once); ``compression``: "int8" or "fp8" activations on the dispatch. Differentiable in
    ``x`` and ``weights``; a collective (module docstring). ``x``, ``expert_ids`` and ``weights``
    share a device, one the group takes; the host reads the range of ``expert_ids`` (a check)
    and the counts (module docstring, "Devices")."""
    g = as_group(group, "group", "dispatch")
    _check_dispatch(x, expert_ids, weights, num_experts, g.world_size)
    check_device(g, x.device, "dispatch: the tokens (x)")
    codec = _codec(compression, "dispatch")
    layout = None
    if hosts is not None:
        if not isinstance(hosts, HostGroups):
            raise TypeError(f"dispatch: hosts must be a HostGroups or None, got {type(hosts).__name__}")
        known = _LAYOUTS.get(hosts)
        layout = known[1] if known is not None and known[0] is g else _RankLayout(g, x.device, hosts)
        _LAYOUTS[hosts] = (g, layout)
    k = expert_ids.shape[-1]
    return _dispatch(x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, k).long(), weights.reshape(-1, k),
                     g, num_experts, codec, layout)


def combine(outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Brings the experts' ``outputs`` (one row per row of the expert inputs, in their order) home
    and returns, per token, the sum of its experts' outputs times their weights, shaped as the
    dispatched ``x`` (last dimension the outputs'), in its dtype. Differentiable; a collective."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"combine: handle must be the DispatchHandle of a dispatch, got "
                        f"{type(handle).__name__}")
    rows = sum(handle.counts)
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2 or outputs.shape[0] != rows:
        got = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ValueError(f"combine: outputs must be a 2-D tensor with one row per expert input ({rows}), "
                         f"got {got}")
    return _combine(outputs, handle)


# -- routing ---------------------------------------------------------------------------------------

class Routing:
    """The router's decision for a batch of tokens (:func:`route`).

    ``expert_ids`` (T, k) int64, -1 where the assignment was dropped; ``weights`` (T, k) the
    combine weights (differentiable; a dropped assignment's weight is kept but unused);
    ``tokens_per_expert`` (E,) assignments per expert before drops; ``dropped`` their number
    dropped; ``aux_loss`` and ``z_loss`` scalar tensors (zero when their coefficient is)."""

    def __init__(self, expert_ids, weights, tokens_per_expert, dropped, aux_loss, z_loss):
        self.expert_ids, self.weights = expert_ids, weights
        self.tokens_per_expert, self.dropped_count = tokens_per_expert, dropped
        self.aux_loss, self.z_loss = aux_loss, z_loss

    @property
    def dropped(self) -> int:
        """The number of assignments dropped (reading it copies ``dropped_count``, a tensor on the
        logits' device, to the host)."""
        return int(self.dropped_count)


def _count(index: torch.Tensor, n: int) -> torch.Tensor:
    """How many times each of 0..n-1 occurs in ``index`` (torch.bincount, without the device-to-host
    copy of its maximum on a GPU)."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).scatter_add_(
        0, index, torch.ones_like(index, dtype=torch.int64))


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Assignments each expert keeps of ``tokens`` tokens: ``ceil(capacity_factor * tokens * top_k /
    num_experts)``."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def _keep(expert: torch.Tensor, weight: torch.Tensor, num_experts: int, cap: int,
          drop_policy: str) -> torch.Tensor:
    """Which of the assignments (``expert``, ``weight``: flat, token-major) fit their expert's
    capacity ``cap``: per expert the highest weights ("probs") or the first tokens ("position"),
    the earlier token first among equals."""
    order = torch.arange(expert.numel(), device=expert.device)
    if drop_policy == "probs":
        order = torch.argsort(-weight, stable=True)
    order = order[torch.argsort(expert[order], stable=True)]    # by expert, priority within
    counts = _count(expert, num_experts)
    first = torch.cumsum(counts, 0) - counts
    position = torch.arange(expert.numel(), device=expert.device) - first[expert[order]]
    keep = torch.empty_like(expert, dtype=torch.bool)
    keep[order] = position < cap
    return keep


def route(logits: torch.Tensor, top_k: int, *, normalize_topk: bool = True,
          capacity_factor: Optional[float] = None, drop_policy: str = "probs",
          expert_bias: Optional[torch.Tensor] = None, aux_loss_coeff: float = 0.0,
          z_loss_coeff: float = 0.0) -> Routing:
    """Routes tokens from the router's ``logits`` (T, E), computed in their dtype (the MoE layer
    passes float32, or float64 for float64 models): softmax, top-k of the probabilities plus
    ``expert_bias`` (selection only), weights the selected probabilities, renormalised to sum to 1
    when ``normalize_topk``; capacity, drops and losses as the module docstring says."""
    where = "route"
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"{where}: logits must be a floating tensor of shape (tokens, num_experts), "
                        f"got {got}")
    if logits.dim() != 2:
        raise ValueError(f"{where}: logits must have shape (tokens, num_experts), got shape "
                         f"{tuple(logits.shape)}")
    t, e = logits.shape
    _positive_int(top_k, "top_k", where)
    if top_k > e:
        raise ValueError(f"{where}: top_k={top_k} is larger than the {e} experts")
    _check_capacity(capacity_factor, drop_policy, where)
    probs = torch.softmax(logits, dim=-1)
    scores = probs.detach() if expert_bias is None else probs.detach() + expert_bias.to(probs.dtype)
    ids = torch.topk(scores, top_k, dim=-1).indices
    weights = probs.gather(1, ids)
    if normalize_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    tokens_per_expert = _count(ids.reshape(-1), e)
    dropped = torch.zeros((), dtype=torch.int64, device=logits.device)
    if capacity_factor is not None and t:
        keep = _keep(ids.reshape(-1), weights.detach().reshape(-1), e,
                     capacity(t, top_k, e, capacity_factor), drop_policy).view(t, top_k)
        dropped = (~keep).sum()
        ids = torch.where(keep, ids, -1)
    zero = logits.new_zeros(())
    aux = zero
    if aux_loss_coeff and t:
        f = tokens_per_expert.to(probs.dtype) / (t * top_k)
        aux = aux_loss_coeff * e * (f * probs.mean(0)).sum()
    z = zero
    if z_loss_coeff and t:
        z = z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
    return Routing(ids, weights, tokens_per_expert, dropped, aux, z)


# -- the layer -------------------------------------------------------------------------------------

class ExpertMLP(nn.Module):
    """The default expert: ``Linear(d_model, hidden) -> GELU -> Linear(hidden, d_model)``."""

    def __init__(self, d_model: int, hidden: int, device: Any = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.up = nn.Linear(d_model, hidden, device=device, dtype=dtype)
        self.down = nn.Linear(hidden, d_model, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _split_hosts(hierarchical: Any, group: Any) -> Optional[HostGroups]:
    """The group split by host for ``hierarchical`` (None without it)."""
    return resolve_hosts(hierarchical, group, "MoE: ")


class MoE(nn.Module):
    """A mixture-of-experts layer with its experts split over a group (expert parallelism).

    Args:
        d_model: the tokens' width (``x``'s last dimension).
        num_experts: E, a multiple of the group's size N; rank r holds experts
            ``[r E / N, (r + 1) E / N)`` as ``self.experts`` (an ``nn.ModuleList``, in order).
        expert: a callable returning one expert module (called E / N times here), mapping
            (n, d_model) to (n, d_model); default :class:`ExpertMLP` with ``hidden`` (default
            4 d_model).
        top_k: experts per token.
        group: a braid Communicator, a torch ProcessGroup or None (the default group), resolved
            now: the layer builds only its rank's experts.
        router: an ``nn.Linear(d_model, E, bias=False)`` to use instead of a new one. The router
            is replicated: build it from the same seed on every rank (or broadcast it).
        normalize_topk, capacity_factor, drop_policy, aux_loss_coeff, z_loss_coeff: routing
            (:func:`route`, module docstring).
        bias_update_rate: > 0 turns on auxiliary-loss-free balancing; training forwards count
            each expert's load, :meth:`update_expert_bias` moves the bias.
        hierarchical: False, True (split the group by host now, collectively: a Communicator by
            ``split_by_host()``, a ProcessGroup by ``group_carrier.host_groups``) or a
            ``HostGroups``: each token crosses to a host once.
        dispatch_compression: None, "int8" or "fp8" (:class:`RowQuantizer`).

    ``forward(x)`` returns ``(y, aux)``: ``y`` shaped as ``x``, ``aux`` the sum of the enabled
    routing losses on this rank's tokens (add it to the loss). :meth:`stats` describes the last
    forward. Every rank of the group runs every forward and backward of the layer.
    """

    def __init__(self, d_model: int, num_experts: int, expert: Optional[Callable[[], nn.Module]] = None, *,
                 top_k: int = 2, group: Any = None, hidden: Optional[int] = None,
                 router: Optional[nn.Linear] = None, normalize_topk: bool = True,
                 capacity_factor: Optional[float] = None, drop_policy: str = "probs",
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, bias_update_rate: float = 0.0,
                 hierarchical: Union[bool, HostGroups] = False,
                 dispatch_compression: Union[None, str, RowQuantizer] = None,
                 pad_to_capacity: bool = False,
                 device: Any = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        where = "MoE"
        _positive_int(d_model, "d_model", where)
        g = as_group(group, "group", where)
        n, rank = g.world_size, g.rank
        _check_experts(num_experts, top_k, n, where)
        _check_capacity(capacity_factor, drop_policy, where)
        if not isinstance(pad_to_capacity, bool):
            raise TypeError(f"{where}: pad_to_capacity must be a bool, got {type(pad_to_capacity).__name__}")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError(f"{where}: pad_to_capacity=True needs a capacity_factor (the rows each expert "
                             f"gets from each rank)")
        if pad_to_capacity and hierarchical is not False:
            raise ValueError(f"{where}: pad_to_capacity=True is a flat dispatch; it does not combine with "
                             f"hierarchical={hierarchical!r}")
        for name, value in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff),
                            ("bias_update_rate", bias_update_rate)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{where}: {name} must be a number >= 0, got {value!r}")
        if not isinstance(normalize_topk, bool):
            raise TypeError(f"{where}: normalize_topk must be a bool, got {type(normalize_topk).__name__}")
        if router is None:
            router = nn.Linear(d_model, num_experts, bias=False, device=device, dtype=dtype)
        if not isinstance(router, nn.Linear) or router.bias is not None \
                or (router.in_features, router.out_features) != (d_model, num_experts):
            raise ValueError(f"{where}: router must be an nn.Linear({d_model}, {num_experts}, bias=False), "
                             f"got {router!r}")
        if expert is None:
            width = hidden if hidden is not None else 4 * d_model
            _positive_int(width, "hidden", where)

            def expert():
                return ExpertMLP(d_model, width, device=device, dtype=dtype)
        elif not callable(expert):
            raise TypeError(f"{where}: expert must be a callable returning an nn.Module, got "
                            f"{type(expert).__name__}")
        local = num_experts // n
        made = [expert() for _ in range(local)]
        for i, m in enumerate(made):
            if not isinstance(m, nn.Module):
                raise TypeError(f"{where}: expert() must return an nn.Module, returned {type(m).__name__} "
                                f"(for expert {rank * local + i})")
        self.group = g
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.first_expert = rank * local
        self.router = router
        self.experts = nn.ModuleList(made)
        self.normalize_topk = normalize_topk
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.bias_update_rate = float(bias_update_rate)
        self.codec = _codec(dispatch_compression, where)
        self.pad_to_capacity = pad_to_capacity
        self.hosts = _split_hosts(hierarchical, g)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if bias_update_rate else None)
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64, device=device)
                             if bias_update_rate else None, persistent=False)
        self._layout: Optional[_RankLayout] = None
        self._stats: Optional[dict] = None

    @classmethod
    def from_dense(cls, router: nn.Linear, experts: Sequence[nn.Module], group: Any = None, *, top_k: int = 2,
                   **kwargs: Any) -> "MoE":
        """The layer holding this rank's share of ``experts`` (all E of them, in order; the modules
        themselves are kept, not copied) with ``router`` (``nn.Linear(d, E, bias=False)``).
        Keywords as :class:`MoE`'s."""
        if not isinstance(router, nn.Linear):
            raise TypeError(f"MoE.from_dense: router must be an nn.Linear, got {type(router).__name__}")
        experts = list(experts)
        if len(experts) != router.out_features:
            raise ValueError(f"MoE.from_dense: experts holds {len(experts)} modules, the router routes to "
                             f"{router.out_features}")
        g = as_group(group, "group", "MoE.from_dense")
        _check_experts(len(experts), top_k, g.world_size, "MoE.from_dense")
        local = len(experts) // g.world_size
        mine = iter(experts[g.rank * local:(g.rank + 1) * local])
        return cls(router.in_features, len(experts), lambda: next(mine), top_k=top_k, group=g, router=router,
                   **kwargs)

    @property
    def local_experts(self) -> range:
        """The global numbers of this rank's experts."""
        return range(self.first_expert, self.first_expert + len(self.experts))

    def forward(self, x: torch.Tensor) -> tuple:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1 \
                or x.shape[-1] != self.d_model:
            raise ValueError(f"MoE: x must be a floating tensor of shape (..., d_model={self.d_model}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        check_device(self.group, x.device, "MoE: the tokens (x)")
        tokens = x.reshape(-1, self.d_model)
        if self._layout is None:  # collective, once: every rank runs its first forward together
            layout = _RankLayout(self.group, x.device, self.hosts, tokens.shape[0])
            if self.pad_to_capacity and len(set(layout.tokens)) > 1:
                raise ValueError(f"MoE: pad_to_capacity=True needs the same number of tokens on every rank "
                                 f"(x holds {tokens.shape[0]} here; by rank: {layout.tokens}); checked at "
                                 "the first forward")
            self._layout = layout
        rdtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(tokens.to(rdtype), self.router.weight.to(rdtype))
        r = route(logits, self.top_k, normalize_topk=self.normalize_topk,
                  capacity_factor=self.capacity_factor, drop_policy=self.drop_policy,
                  expert_bias=self.expert_bias, aux_loss_coeff=self.aux_loss_coeff,
                  z_loss_coeff=self.z_loss_coeff)
        if self.expert_load is not None and self.training:
            self.expert_load += r.tokens_per_expert.to(self.expert_load.device)
        if self.pad_to_capacity:
            cap = capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            inputs, counts, state = _padded_dispatch(tokens, r.expert_ids, r.weights, self.group,
                                                     self.num_experts, self.codec, cap)
            handle = DispatchHandle(tokens.shape, tokens.dtype, counts,
                                    [self.group.world_size * cap] * len(self.experts))
            handle._hops = [("padded", state)]
        else:
            inputs, handle = _dispatch(tokens, r.expert_ids, r.weights, self.group, self.num_experts,
                                       self.codec, self._layout)
        outputs = torch.cat([e(chunk) for e, chunk in zip(self.experts, inputs.split(handle.counts))])
        y = _combine(outputs, handle)
        # Kept as tensors (stats() reads them): a forward copies nothing from the device to the host.
        self._stats = {"tokens": tokens.shape[0], "tokens_per_expert": r.tokens_per_expert.detach(),
                       "dropped": r.dropped_count, "expert_tokens": handle.counts,
                       "aux_loss": r.aux_loss.detach(), "z_loss": r.z_loss.detach(),
                       "across_hosts": handle._across}
        return y.reshape(x.shape), r.aux_loss + r.z_loss

    def stats(self) -> Optional[dict]:
        """The last forward on this rank: ``tokens``; ``tokens_per_expert`` (E assignments routed
        per expert, before drops); ``dropped`` (assignments over capacity); ``expert_tokens``
        (rows each local expert computed, from every rank); ``aux_loss`` and ``z_loss``;
        ``across_hosts`` (:meth:`DispatchHandle.stats`: rows and bytes this rank sent to other
        hosts, with the lower bound). None before the first forward."""
        if self._stats is None:
            return None
        s = dict(self._stats)
        s.update(tokens_per_expert=s["tokens_per_expert"].tolist(), dropped=int(s["dropped"]),
                 aux_loss=float(s["aux_loss"]), z_loss=float(s["z_loss"]),
                 across_hosts=_across_stats(s["across_hosts"]))
        return s

    @torch.no_grad()
    def update_expert_bias(self, group: Any = None) -> Optional[torch.Tensor]:
        """Auxiliary-loss-free balancing (DeepSeek-V3): sums the loads counted since the last
        update over ``group`` (default the layer's; pass the whole job's group where the router is
        replicated beyond the expert-parallel group, as with data parallelism) in one all-reduce,
        and moves each expert's bias by ``bias_update_rate * sign(mean load - load)``. Call it once
        per optimizer step, on every rank. Returns the summed loads (None when the bias is off)."""
        if self.expert_bias is None:
            return None
        g = self.group if group is None else as_group(group, "group", "MoE.update_expert_bias")
        load = self.expert_load.clone()
        g.all_reduce(load)
        f = load.to(torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(f.mean() - f)
        self.expert_load.zero_()
        return load

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, local experts "
                f"{self.first_expert}..{self.first_expert + len(self.experts) - 1}, group={self.group!r}"
                + (f", capacity_factor={self.capacity_factor}" if self.capacity_factor else "")
                + (", hierarchical" if self.hosts is not None else "")
                + (f", dispatch_compression={self.codec.fmt!r}" if self.codec else ""))


# -- expert and data parallelism together ----------------------------------------------------------

def expert_parameters(module: nn.Module) -> list:
    """The parameters of every MoE layer's experts in ``module`` (held by some ranks only)."""
    seen: set = set()
    out = []
    for m in module.modules():
        if isinstance(m, MoE):
            for p in m.experts.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def _all_reduce_grads(params: Iterable[nn.Parameter], group: Any, divisor: int) -> None:
    """Sums the gradients over ``group`` (one flat all-reduce per dtype), divided by ``divisor``."""
    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        group.all_reduce(flat)
        flat.div_(divisor)
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()


def reduce_gradients(module: nn.Module, group: Any, expert_group: Any, *, dense: bool = True) -> None:
    """Expert parallelism inside data parallelism: averages every gradient of ``module`` over the
    whole job, its ``group`` (all ranks, W of them, each with its own tokens).

    Gradients of the experts (:func:`expert_parameters`) are summed over ``expert_group``, the
    ranks holding the same experts (one per expert-parallel group), the others over ``group``;
    both are divided by W: an expert's gradient already sums the tokens of its whole
    expert-parallel group (the dispatch brought them), so this is the gradient of the mean loss
    over all ranks, as data parallelism over W dense replicas gives. For W = EP x DP ranks with
    expert-parallel groups of consecutive ranks, ``expert_group`` of rank r holds ranks
    ``r % EP, r % EP + EP, ...``. ``dense=False`` leaves the other gradients alone (DDP over
    ``group`` reduces them, the experts' parameters ignored by it). Call it after the backward,
    before the optimizer step, on every rank."""
    g = as_group(group, "group", "reduce_gradients")
    eg = as_group(expert_group, "expert_group", "reduce_gradients")
    experts = expert_parameters(module)
    mine = {id(p) for p in experts}
    if dense:
        _all_reduce_grads([p for p in module.parameters() if id(p) not in mine], g, g.world_size)
    _all_reduce_grads(experts, eg, g.world_size)
