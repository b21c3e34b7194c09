"""Token dispatch and combine: flat, padded to capacity, and across hosts (the package docstring
describes each), with :class:`DispatchHandle` carrying what combine needs."""
from __future__ import annotations

import weakref
from typing import Any, Optional, Union

import torch

from ..core.group import as_group, check_device
from ..core.group_carrier import HostGroups
from ..core.placement import Placement
from .checks import positive_int
from .codec import RowQuantizer, codec_of
from .exchange import RowExchange, exchange_counts, expert_major, inverse
from .routing import count_per

# The placement of each HostGroups dispatch() has used, with its group: gathered once, not per call.
LAYOUTS: "weakref.WeakKeyDictionary[HostGroups, tuple]" = weakref.WeakKeyDictionary()


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
        return across_stats(self._across)


def across_stats(across: Optional[dict]) -> Optional[dict]:
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
    counts = count_per(key, num_experts + 1)[:num_experts]
    arriving = exchange_counts(group, counts)   # [source rank, local expert], flattened
    read = torch.cat([arriving, counts.view(n, local).sum(1)]).tolist()
    table = [read[s * local:(s + 1) * local] for s in range(n)]
    send = read[n * local:]
    recv = [sum(row) for row in table]
    assignment = order[:sum(send)]            # by expert, in token order within an expert
    token = torch.div(assignment, k, rounding_mode="floor")
    (rows,) = RowExchange.apply(group, send, recv, codec, x.index_select(0, token))
    perm = expert_major(arriving.view(n, local), sum(recv))
    inputs = rows if perm is None else rows.index_select(0, perm)
    state = {"group": group, "send": send, "recv": recv, "token": token, "perm": perm,
             "weights": weights.reshape(-1).index_select(0, assignment), "tokens": x.shape[0]}
    per_expert = [sum(row[e] for row in table) for e in range(local)]
    return inputs, arriving.view(n, local).sum(0), per_expert, state


def _flat_combine(outputs: torch.Tensor, state: dict) -> torch.Tensor:
    """The reverse of :func:`_flat_dispatch`: each row home, weighted, summed per token (in the
    wider of the rows' and weights' dtypes)."""
    perm = state["perm"]
    rows = outputs if perm is None else outputs.index_select(0, inverse(perm))
    (back,) = RowExchange.apply(state["group"], state["recv"], state["send"], None, rows)
    w = state["weights"]
    acc = torch.promote_types(back.dtype, w.dtype)
    y = back.new_zeros((state["tokens"], back.shape[1]), dtype=acc)
    return y.index_add_(0, state["token"], back.to(acc) * w.to(acc).unsqueeze(1))


def padded_dispatch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: Any, num_experts: int,
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
    (got,) = RowExchange.apply(group, None, None, codec, rows)   # equal pieces: local * cap rows each
    # From each source rank its rows of local expert 0, 1, ...: expert-major, source order within.
    inputs = got.view(n, local, cap, -1).transpose(0, 1).reshape(local * n * cap, -1)
    w = torch.where(kept, weights.reshape(-1), torch.zeros((), dtype=weights.dtype, device=weights.device))
    state = {"group": group, "slot": slot, "token": token, "weights": w, "tokens": t,
             "n": n, "local": local, "cap": cap}
    counts = torch.full((local,), n * cap, dtype=torch.int64, device=ids.device)
    return inputs, counts, state


def _padded_combine(outputs: torch.Tensor, state: dict) -> torch.Tensor:
    """The reverse of :func:`padded_dispatch`: every slot home, each assignment's output weighted
    and summed per token (dropped ones and padding weigh 0)."""
    n, local, cap = state["n"], state["local"], state["cap"]
    rows = outputs.view(local, n, cap, -1).transpose(0, 1).reshape(n * local * cap, -1)
    (back,) = RowExchange.apply(state["group"], None, None, None, rows)
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


def dispatch_tokens(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: Any, num_experts: int,
              codec: Optional[RowQuantizer], layout: Optional[Placement]) -> tuple:
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
    arriving = exchange_counts(layout.inter, send_counts)
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
    x1, w1, t1 = RowExchange.apply(layout.inter, send, recv, codec, x.index_select(0, row_token),
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


def combine_outputs(outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    y = None
    for kind, state in reversed(handle._hops):
        if kind == "flat":
            y = _flat_combine(outputs, state)
        elif kind == "padded":
            y = _padded_combine(outputs, state)
        else:  # one partial sum per (token, host) crosses back, in the activations' dtype
            (back,) = RowExchange.apply(state["group"], state["recv"], state["send"], None,
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
    positive_int(num_experts, "num_experts", where)
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
    codec = codec_of(compression, "dispatch")
    layout = None
    if hosts is not None:
        if not isinstance(hosts, HostGroups):
            raise TypeError(f"dispatch: hosts must be a HostGroups or None, got {type(hosts).__name__}")
        known = LAYOUTS.get(hosts)
        layout = known[1] if known is not None and known[0] is g else Placement(g, x.device, hosts)
        LAYOUTS[hosts] = (g, layout)
    k = expert_ids.shape[-1]
    return dispatch_tokens(x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, k).long(),
                           weights.reshape(-1, k), g, num_experts, codec, layout)


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
    return combine_outputs(outputs, handle)
