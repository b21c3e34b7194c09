"""Tensor-parallel layers: column/row parallel linear and vocabulary-parallel embedding (Megatron style).

A column-parallel linear holds rows [r*out/N, (r+1)*out/N) of the weight (its slice of the output
features); a row-parallel linear holds columns [r*in/N, (r+1)*in/N) (its slice of the input
features) and sums its partial products over the ranks. Put back to back (column then row) they
need one all-reduce in the forward and one in the backward for the pair. With sequence
parallelism the activations outside the pair are split along the sequence: the column layer
all-gathers its input and the row layer reduce-scatters its output instead.

Every layer is a collective: all ranks of the group run the same layers in the same order. The group
(``group``) is a braid Communicator, any torch.distributed ProcessGroup (NCCL, gloo, braid's
backend, a DeviceMesh dimension's group) or None, the default group (comm/core/group.py); weights and
activations may be on any device the group serves (CUDA tensors over NCCL, say).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from ..core.group import as_group, check_device, renamed_args
from .regions import (all_gather, all_reduce, gather_from_region, reduce_from_region, reduce_scatter,
                      reduce_scatter_to_sequence_region, scatter_to_region, split)


def _shard_size(size: int, world_size: int, name: str, layer: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{layer}: {name} must be a positive int, got {size!r}")
    if size % world_size:
        raise ValueError(f"{layer}: {name}={size} does not divide evenly by the world size "
                         f"{world_size}")
    return size // world_size


def _dense_source(tensor: torch.Tensor, group: Any, src: Optional[int]) -> torch.Tensor:
    """The dense tensor every rank slices: rank ``src``'s copy (broadcast), or each rank's own."""
    t = tensor.detach()
    if src is None or group.world_size == 1:
        return t
    t = t.clone(memory_format=torch.contiguous_format)
    group.broadcast(t, src)
    return t


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _ColumnParallelLinearFn(Function):
    """y = x W_r^T + b_r. Backward: the input gradient's collective (all-reduce, or reduce-scatter
    along the sequence) runs on braid's progress thread while the weight gradient is computed."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, sequence_dim):
        ctx.communicator = group
        ctx.sequence_parallel, ctx.sequence_dim = sequence_parallel, sequence_dim
        ctx.has_bias = bias is not None
        total = all_gather(x, sequence_dim, group, what="ColumnParallelLinear input") \
            if sequence_parallel else x
        # With sequence parallelism only the local slice is kept for the backward, which gathers
        # it again: memory for activations stays 1/N, and that gather overlaps a matmul there.
        ctx.save_for_backward(x, weight)
        return F.linear(total, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        c = ctx.communicator
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gathering = all_gather(x, ctx.sequence_dim, c, async_op=True) \
            if ctx.sequence_parallel and need_w else None
        grad_x = grad.matmul(weight) if need_x else None  # overlaps the input all-gather
        total = gathering.wait() if gathering is not None else x
        pending = None
        if need_x:
            # grad_x is a fresh tensor, so it can be reduced in place.
            pending = reduce_scatter(grad_x, ctx.sequence_dim, c, async_op=True) \
                if ctx.sequence_parallel else all_reduce(grad_x, c, async_op=True)
        g = _flat(grad)
        grad_w = g.t().matmul(_flat(total)) if need_w else None  # overlaps the input-gradient collective
        grad_b = g.sum(0) if ctx.has_bias and need_b else None
        if pending is not None:
            grad_x = pending.wait()
        return grad_x, grad_w, grad_b, None, None, None


class _RowParallelLinearFn(Function):
    """y = sum_r x_r W_r^T (+ b). Forward: all-reduce of the partial products, or reduce-scatter
    along the sequence. Backward: with sequence parallelism the output gradient is all-gathered
    first and the bias gradient (each rank saw only its slice of the sequence) summed over ranks."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, sequence_dim):
        ctx.communicator = group
        ctx.sequence_parallel, ctx.sequence_dim = sequence_parallel, sequence_dim
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        partial = F.linear(x, weight)  # a fresh tensor: reduced in place
        if sequence_parallel:
            out = reduce_scatter(partial, sequence_dim, group, what="RowParallelLinear output")
        else:
            out = all_reduce(partial, group)
        return out.add_(bias) if bias is not None else out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        c = ctx.communicator
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        summing = None
        grad_b = None
        if ctx.has_bias and need_b:
            grad_b = _flat(grad).sum(0)
            if ctx.sequence_parallel:
                summing = all_reduce(grad_b, c, async_op=True)  # overlaps what follows
        total = all_gather(grad, ctx.sequence_dim, c) if ctx.sequence_parallel else grad
        grad_x = total.matmul(weight) if need_x else None
        grad_w = _flat(total).t().matmul(_flat(x)) if need_w else None
        if summing is not None:
            grad_b = summing.wait()
        return grad_x, grad_w, grad_b, None, None, None


class _ParallelLinear(nn.Module):
    """What the two linear layers share: shapes, initialization, conversion to and from nn.Linear."""

    # The weight dimension that is split over ranks: 0 (output features) or 1 (input features).
    split_dim = 0

    def __init__(self, in_features: int, out_features: int, *, group: Any = None, bias: bool,
                 sequence_parallel: bool, sequence_dim: int,
                 device: Optional[torch.device], dtype: Optional[torch.dtype]):
        super().__init__()
        name = type(self).__name__
        group = as_group(group, "group", name)
        world = group.world_size
        self.in_features = in_features
        self.out_features = out_features
        out_local, in_local = out_features, in_features
        if self.split_dim == 0:
            out_local = _shard_size(out_features, world, "out_features", name)
            _shard_size(in_features, 1, "in_features", name)
        else:
            in_local = _shard_size(in_features, world, "in_features", name)
            _shard_size(out_features, 1, "out_features", name)
        self.communicator = group
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"{name}: sequence_parallel must be a bool, got {sequence_parallel!r}")
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"{name}: sequence_dim must be an int, got {sequence_dim!r}")
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.weight = nn.Parameter(torch.empty(out_local, in_local, device=device, dtype=dtype))
        bias_size = out_local if self.split_dim == 0 else out_features
        self.bias = nn.Parameter(torch.empty(bias_size, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initializes this rank's slice exactly as the matching slice of an ``nn.Linear`` built
        from the same random state: same-seeded ranks together hold that nn.Linear's weights,
        whatever the world size. (The dense weight exists for a moment on each rank.)"""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
        self._load_dense(dense, src=None)

    def _load_dense(self, dense: nn.Linear, src: Optional[int]) -> None:
        check_device(self.communicator, self.weight.device, f"{type(self).__name__}: the weights")
        with torch.no_grad():
            weight = _dense_source(dense.weight, self.communicator, src)
            self.weight.copy_(split(weight, self.split_dim, self.communicator))
            if self.bias is not None:
                bias = _dense_source(dense.bias, self.communicator, src)
                self.bias.copy_(split(bias, 0, self.communicator) if self.split_dim == 0 else bias)

    @classmethod
    @renamed_args(communicator="group")
    def from_dense(cls, layer: nn.Linear, group: Any = None, *, src: Optional[int] = 0, **options):
        """Shards an existing ``nn.Linear`` (e.g. of a pretrained model) over ``group``.

        Every rank calls it. With ``src`` (default 0) rank ``src``'s weights are broadcast first,
        so every rank slices the same matrix; ``src=None`` slices each rank's own copy, which must
        then be identical. ``options`` are the layer's keyword arguments (``gather_output``,
        ``sequence_parallel``, ...). ``requires_grad`` carries over."""
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_dense: layer must be an nn.Linear, "
                            f"got {type(layer).__name__}")
        sharded = torch.nn.utils.skip_init(
            cls, layer.in_features, layer.out_features, group=group,
            bias=layer.bias is not None, device=layer.weight.device, dtype=layer.weight.dtype, **options)
        sharded._load_dense(layer, src)
        sharded.weight.requires_grad_(layer.weight.requires_grad)
        if layer.bias is not None:
            sharded.bias.requires_grad_(layer.bias.requires_grad)
        return sharded

    def to_dense(self) -> nn.Linear:
        """The whole layer as an ``nn.Linear`` on every rank (a collective: all ranks call it)."""
        c = self.communicator
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(all_gather(self.weight.detach(), self.split_dim, c))
            if self.bias is not None:
                dense.bias.copy_(all_gather(self.bias.detach(), 0, c) if self.split_dim == 0
                                 else self.bias.detach())
        dense.weight.requires_grad_(self.weight.requires_grad)
        if self.bias is not None:
            dense.bias.requires_grad_(self.bias.requires_grad)
        return dense


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear`` with the weight split by output features over the communicator's ranks.

    Args:
        in_features, out_features: the whole layer's sizes; ``out_features`` must divide by the
            world size.
        group: the tensor-parallel group: a ``braid.comm.Communicator``, a
            ``torch.distributed.ProcessGroup`` or None (the default group).
        bias: whether to learn a bias (split like the output features).
        gather_output: all-gather the output so every rank holds all ``out_features`` (otherwise
            each rank keeps its ``out_features / N`` slice, the input of a row-parallel layer).
        sequence_parallel: the input is split along ``sequence_dim`` over the ranks; it is
            all-gathered before the matmul (and again, overlapped, in the backward).
        sequence_dim: the sequence dimension of the input (1 for (batch, seq, hidden), 0 for
            (seq, batch, hidden)).
        device, dtype: as for ``nn.Linear``.

    The input is replicated on every rank (or sequence-split). In the backward, the input
    gradient's all-reduce (or reduce-scatter) runs asynchronously while the weight gradient is
    computed.
    """

    split_dim = 0

    @renamed_args(communicator="group")
    def __init__(self, in_features: int, out_features: int, *, group: Any = None, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, sequence_dim: int = 1,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        self.gather_output = bool(gather_output)
        super().__init__(in_features, out_features, group=group, bias=bias,
                         sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                         device=device, dtype=dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = _ColumnParallelLinearFn.apply(input, self.weight, self.bias, self.communicator,
                                            self.sequence_parallel, self.sequence_dim)
        return gather_from_region(out, self.communicator) if self.gather_output else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.weight.shape[0]} on rank {self.communicator.rank}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear`` with the weight split by input features over the communicator's ranks.

    Args:
        in_features, out_features: the whole layer's sizes; ``in_features`` must divide by the
            world size.
        group: the tensor-parallel group (as for :class:`ColumnParallelLinear`).
        bias: whether to learn a bias (whole on every rank, added once after the reduction).
        input_is_parallel: the input is already this rank's slice of the last dimension (the
            output of a column-parallel layer); otherwise the whole input is given and sliced here.
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` instead of
            all-reducing it (requires ``input_is_parallel``); the bias gradient is then summed
            over ranks.
        sequence_dim: the sequence dimension of the output.
        device, dtype: as for ``nn.Linear``.
    """

    split_dim = 1

    @renamed_args(communicator="group")
    def __init__(self, in_features: int, out_features: int, *, group: Any = None, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, sequence_dim: int = 1,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.input_is_parallel = bool(input_is_parallel)
        super().__init__(in_features, out_features, group=group, bias=bias,
                         sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                         device=device, dtype=dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            input = scatter_to_region(input, self.communicator)
        return _RowParallelLinearFn.apply(input, self.weight, self.bias, self.communicator,
                                          self.sequence_parallel, self.sequence_dim)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.weight.shape[1]} on rank {self.communicator.rank}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary split over the communicator's ranks.

    Rank r holds rows [r*V/N, (r+1)*V/N). Each rank looks up the ids it owns, writes zeros for the
    others, and the partial results are all-reduced (or, with ``sequence_parallel``,
    reduce-scattered along ``sequence_dim`` of the output).

    Args:
        num_embeddings, embedding_dim: the whole table's sizes; ``num_embeddings`` must divide by
            the world size.
        group: the tensor-parallel group (as for :class:`ColumnParallelLinear`).
        padding_idx: as for ``nn.Embedding`` (that row gets no gradient).
        sequence_parallel, sequence_dim: reduce-scatter the output along ``sequence_dim``.
        device, dtype: as for ``nn.Embedding``.

    ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` of ``nn.Embedding`` are not supported.
    """

    @renamed_args(communicator="group")
    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any = None,
                 padding_idx: Optional[int] = None, sequence_parallel: bool = False,
                 sequence_dim: int = 1, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        name = type(self).__name__
        group = as_group(group, "group", name)
        per_rank = _shard_size(num_embeddings, group.world_size, "num_embeddings", name)
        _shard_size(embedding_dim, 1, "embedding_dim", name)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"{name}: padding_idx must be within num_embeddings, got {padding_idx}")
            padding_idx %= num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.communicator = group
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = sequence_dim
        self.vocab_start = group.rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initializes this rank's rows exactly as the same rows of an ``nn.Embedding`` built from
        the same random state (the dense table exists for a moment on each rank)."""
        dense = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx,
                             device=self.weight.device, dtype=self.weight.dtype)
        self._load_dense(dense, src=None)

    def _load_dense(self, dense: nn.Embedding, src: Optional[int]) -> None:
        check_device(self.communicator, self.weight.device, f"{type(self).__name__}: the weights")
        with torch.no_grad():
            self.weight.copy_(split(_dense_source(dense.weight, self.communicator, src), 0,
                                    self.communicator))

    @property
    def _local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            return self.padding_idx - self.vocab_start
        return None

    def _check_ids(self, input: torch.Tensor) -> None:
        """Ids outside the vocabulary raise, as nn.Embedding's do: an IndexError on the CPU; on a
        device an assertion the device raises when it gets there (the host never waits for the
        ids: a read here would stall every forward), as nn.Embedding's CUDA kernel asserts."""
        if not input.numel():
            return
        if input.device.type != "cpu":
            inside = ((input >= 0) & (input < self.num_embeddings)).all()
            torch._assert_async(inside, f"VocabParallelEmbedding: ids must be in [0, {self.num_embeddings})")
            return
        low, high = int(input.min()), int(input.max())
        if low < 0 or high >= self.num_embeddings:
            raise IndexError(f"VocabParallelEmbedding: ids must be in [0, {self.num_embeddings}), got "
                             f"values in [{low}, {high}]")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VocabParallelEmbedding: input must hold int32 or int64 ids, got {input.dtype}")
        self._check_ids(input)
        foreign = (input < self.vocab_start) | (input >= self.vocab_end)
        local = (input - self.vocab_start).masked_fill_(foreign, 0)
        # Foreign ids look up row 0 and are then zeroed: masked_fill sends them no gradient.
        out = F.embedding(local, self.weight, self._local_padding_idx).masked_fill_(foreign.unsqueeze(-1), 0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.communicator, self.sequence_dim)
        return reduce_from_region(out, self.communicator)

    @classmethod
    @renamed_args(communicator="group")
    def from_dense(cls, layer: nn.Embedding, group: Any = None, *, src: Optional[int] = 0,
                   **options) -> "VocabParallelEmbedding":
        """Shards an existing ``nn.Embedding`` over ``group`` (every rank calls it); ``src``
        as in :meth:`ColumnParallelLinear.from_dense`."""
        if not isinstance(layer, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_dense: layer must be an nn.Embedding, "
                            f"got {type(layer).__name__}")
        for attr, off in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
            if getattr(layer, attr) != off:
                raise ValueError(f"{cls.__name__}.from_dense: {attr}={getattr(layer, attr)!r} is not "
                                 "supported")
        sharded = torch.nn.utils.skip_init(
            cls, layer.num_embeddings, layer.embedding_dim, group=group,
            padding_idx=layer.padding_idx, device=layer.weight.device, dtype=layer.weight.dtype, **options)
        sharded._load_dense(layer, src)
        sharded.weight.requires_grad_(layer.weight.requires_grad)
        return sharded

    def to_dense(self) -> nn.Embedding:
        """The whole table as an ``nn.Embedding`` on every rank (a collective)."""
        dense = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx,
                             device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(all_gather(self.weight.detach(), 0, self.communicator))
        dense.weight.requires_grad_(self.weight.requires_grad)
        return dense

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}:{self.vocab_end} "
                f"on rank {self.communicator.rank}), padding_idx={self.padding_idx}, "
                f"sequence_parallel={self.sequence_parallel}")
