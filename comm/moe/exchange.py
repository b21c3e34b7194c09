"""The exchange of rows: the differentiable uneven all-to-all of dispatch and combine over any group,
and the counts exchange and orderings around it, on the tokens' device."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from .codec import RowQuantizer


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


class RowExchange(torch.autograd.Function):
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


def exchange_counts(group: Any, counts: torch.Tensor) -> torch.Tensor:
    """Equal all-to-all of int64 ``counts`` (world_size pieces): piece j to rank j."""
    if group.world_size == 1:
        return counts.clone()
    out = torch.empty_like(counts)
    group.all_to_all(out, counts)
    return out


def expert_major(counts: torch.Tensor, total: int) -> Optional[torch.Tensor]:
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


def inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
