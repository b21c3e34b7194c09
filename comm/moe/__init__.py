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

Dispatch across hosts (``hosts``, a :class:`~braid.comm.core.group_carrier.HostGroups`): a token
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

The package: routing.py (route, Routing, capacity), dispatch.py (dispatch and combine, flat,
padded and across hosts; where the ranks sit is core/placement.py's Placement), exchange.py
(the differentiable all-to-all of rows), codec.py (the compressed dispatch's row codec),
checks.py (argument checks), layer.py (the MoE layer, the expert MLP, the gradient reduction).
"""

from .checks import COMPRESSIONS, DROP_POLICIES
from .codec import RowQuantizer
from .dispatch import DispatchHandle, combine, dispatch
from .layer import ExpertMLP, MoE, expert_parameters, reduce_gradients
from .routing import Routing, capacity, route

__all__ = ["MoE", "ExpertMLP", "dispatch", "combine", "DispatchHandle", "route", "Routing", "capacity",
           "RowQuantizer", "expert_parameters", "reduce_gradients", "DROP_POLICIES", "COMPRESSIONS"]
