"""Tensor-parallel regions: the collectives at the edges of a sharded computation, as autograd functions.

Each region is a pair of collectives, one in the forward and its adjoint in the backward:

    copy_to_region            identity             | all-reduce the gradient
    reduce_from_region        all-reduce           | identity
    scatter_to_region         keep my slice (last) | all-gather the gradient (last dim)
    gather_from_region        all-gather (last)    | keep my slice of the gradient
    scatter_to_sequence_region    keep my slice (seq)  | all-gather (seq)
    gather_from_sequence_region   all-gather (seq)     | reduce-scatter (seq), or keep my slice
    reduce_scatter_to_sequence_region  reduce-scatter (seq) | all-gather (seq)

Every rank of the group must call the same regions in the same order (they are collectives). The
group is a braid Communicator, a torch.distributed ProcessGroup or None (the default group).
Gradients are never reduced in place in the tensor autograd hands in: that tensor can
be shared with another branch of the graph (the two inputs of an add receive the same gradient).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from ..core.group import as_group, renamed_args


def _dim(x: torch.Tensor, dim: int, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what}: dim must be an int, got {dim!r}")
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"{what}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _divisible(x: torch.Tensor, dim: int, world_size: int, what: str) -> int:
    size = x.size(dim)
    if size % world_size:
        raise ValueError(f"{what}: dimension {dim} of size {size} (shape {tuple(x.shape)}) does not "
                         f"divide evenly by the world size {world_size}")
    return size // world_size


class Pending:
    """The result of an async collective: ``wait()`` returns the output tensor once it is done."""

    __slots__ = ("_work", "_finish")

    def __init__(self, work: Any, finish: Callable[[], torch.Tensor]):
        self._work = work
        self._finish = finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


def split(x: torch.Tensor, dim: int, group: Any, what: str = "split") -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (``x.size(dim)`` must divide by the world size),
    as a new contiguous tensor."""
    dim = _dim(x, dim, what)
    n = _divisible(x, dim, group.world_size, what)
    return x.narrow(dim, group.rank * n, n).clone(memory_format=torch.contiguous_format)


def all_gather(x: torch.Tensor, dim: int, group: Any, *, async_op: bool = False,
               what: str = "all_gather") -> Any:
    """Concatenates every rank's ``x`` along ``dim``; returns the tensor, or a :class:`Pending`
    with ``async_op=True``."""
    dim = _dim(x, dim, what)
    world = group.world_size
    x = x.contiguous()
    # Ranks' pieces land one after the other in a (world, *shape) buffer; moving that leading
    # axis next to `dim` and merging the two gives the concatenation (a view when dim == 0).
    buf = x.new_empty((world,) + tuple(x.shape))
    work = None
    if world > 1:
        work = group.all_gather(buf, x, async_op=async_op)
    else:
        buf[0].copy_(x)

    def finish() -> torch.Tensor:
        return buf.movedim(0, dim).flatten(dim, dim + 1)

    return Pending(work, finish) if async_op else finish()


def reduce_scatter(x: torch.Tensor, dim: int, group: Any, *, async_op: bool = False,
                   what: str = "reduce_scatter") -> Any:
    """Sums ``x`` over ranks and keeps this rank's slice along ``dim``; returns the tensor, or a
    :class:`Pending` with ``async_op=True``."""
    dim = _dim(x, dim, what)
    world = group.world_size
    n = _divisible(x, dim, world, what)
    if world == 1:
        out = x.clone(memory_format=torch.contiguous_format)
        return Pending(None, lambda: out) if async_op else out
    # Rank r's slice must be the r-th contiguous block of the input: bring the rank axis first.
    parts = x.unflatten(dim, (world, n)).movedim(dim, 0).contiguous()
    out = x.new_empty(parts.shape[1:])
    work = group.reduce_scatter(out, parts, "sum", async_op=async_op)
    return Pending(work, lambda: out) if async_op else out


def all_reduce(x: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
    """Sums ``x`` over ranks in place; returns ``x``, or a :class:`Pending` with ``async_op=True``."""
    work = group.all_reduce(x, "sum", async_op=async_op) if group.world_size > 1 else None
    return Pending(work, lambda: x) if async_op else x


def _sum(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    # On a copy: `x` may be an input of the graph, or a gradient shared with another branch.
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)


def _identity(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    return x.view_as(x)


class _Region(Function):
    """One edge of a region: ``forward_op`` in the forward, ``backward_op`` on the gradient, both
    ``(tensor, dim, communicator) -> tensor``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int, forward_op: Callable,
                backward_op: Callable) -> torch.Tensor:
        group = as_group(group, "group")
        ctx.communicator, ctx.dim, ctx.backward_op = group, dim, backward_op
        return forward_op(x, dim, group)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_op(grad, ctx.dim, ctx.communicator), None, None, None, None


@renamed_args(communicator="group")
def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enters a tensor-parallel region with a replicated input: identity forward, gradient summed
    over ranks in the backward."""
    return _Region.apply(x, group, 0, _identity, _sum)


@renamed_args(communicator="group")
def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leaves a region whose ranks hold partial sums: all-reduce forward, identity backward."""
    return _Region.apply(x, group, 0, _sum, _identity)


@renamed_args(communicator="group")
def scatter_to_region(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Keeps this rank's slice of ``x`` along ``dim`` (default: the last); the backward
    all-gathers the gradient."""
    return _Region.apply(x, group, dim, partial(split, what="scatter_to_region"), all_gather)


@renamed_args(communicator="group")
def gather_from_region(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Concatenates the ranks' slices along ``dim`` (default: the last); the backward keeps this
    rank's slice of the gradient."""
    return _Region.apply(x, group, dim, partial(all_gather, what="gather_from_region"), split)


@renamed_args(communicator="group")
def scatter_to_sequence_region(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Enters sequence parallelism: keeps this rank's slice of the sequence dimension ``dim``; the
    backward all-gathers the gradient along it."""
    return _Region.apply(x, group, dim, partial(split, what="scatter_to_sequence_region"), all_gather)


@renamed_args(communicator="group")
def gather_from_sequence_region(x: torch.Tensor, group: Any, dim: int = 1, *,
                                tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gathers sequence slices along ``dim`` into the whole sequence.

    ``tensor_parallel_output_grad``: the whole sequence feeds a tensor-parallel computation, so
    each rank's gradient of it is partial and the backward reduce-scatters it (the default). Pass
    False when what follows is replicated (every rank computes the same thing, e.g. a loss on the
    gathered output): the gradients are then equal and the backward keeps this rank's slice."""
    return _Region.apply(x, group, dim, partial(all_gather, what="gather_from_sequence_region"),
                         reduce_scatter if tensor_parallel_output_grad else split)


@renamed_args(communicator="group")
def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """Sums partial results over ranks and keeps this rank's sequence slice along ``dim``; the
    backward all-gathers the gradient."""
    forward_op = partial(reduce_scatter, what="reduce_scatter_to_sequence_region")
    return _Region.apply(x, group, dim, forward_op, all_gather)

