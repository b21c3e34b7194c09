"""The interface between compression and the braid communicator that carries it: what a compressed
all-reduce calls on the communicator's collectives, and the wire statistics it returns.

The communicator is above compression: ``Communicator.all_reduce(t, compression=q)`` hands the
compressor its collectives (:class:`BraidCollectives`), gets back the work and a
:class:`WireStats`, and records the statistics. Compression never imports the communicator; a
compressor given a communicator (``q.all_reduce(c, t)``, the DDP hook's call) recognizes it as a
:class:`CompressionHost` and hands it the call.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class WireStats:
    """Bytes one rank sends and receives for one call, counted as a point-to-point transport
    moves them (an all-gather or all-to-all sends world_size - 1 pieces, a dense all-reduce
    2 (n - 1) / n of the message); ``dense`` is what the uncompressed all-reduce of the same
    tensor would send. The shared-memory transport moves the same payloads through memory."""

    sent: int
    received: int
    dense: int

    @property
    def ratio(self) -> float:
        """dense / sent: how many times fewer bytes travel than without compression."""
        return self.dense / self.sent if self.sent else 1.0

    def __add__(self, other: "WireStats") -> "WireStats":
        return WireStats(self.sent + other.sent, self.received + other.received, self.dense + other.dense)


def dense_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes a rank sends in an uncompressed all-reduce of ``nbytes`` (reduce-scatter + all-gather)."""
    return 2 * (world_size - 1) * nbytes // world_size


class BraidCollectives(Protocol):
    """What a compressed all-reduce uses of a braid communicator: its shape and the collectives of
    its binding (``braid.comm._C.Communicator``), each issued as one unit of work in the
    communicator's order and returning the binding's work (None when ``async_op`` is False).
    ``op`` is a code of ``braid.comm.core.vocabulary.REDUCE_OPS``; ``tag`` is compared across ranks with the
    call's sequence, kind, dtype and size."""

    rank: int
    world_size: int
    local_world_size: int
    num_hosts: int
    uniform_hosts: bool  # every host holds the same number of ranks

    def all_reduce(self, tensor: Tensor, op: int, async_op: bool) -> Any: ...

    def all_gather(self, output: Tensor, input: Tensor, async_op: bool, tag: int = 0) -> Any: ...

    def quantized_all_reduce(self, send: Tensor, recv: Tensor, accumulator: Tensor,
                             gathered: Tensor, bits: int, block: int, chunk: int, average: bool,
                             stochastic: bool, seed: int, async_op: bool, tag: int = 0) -> Any: ...

    def pipelined_quantized_all_reduce(self, tensor: Tensor, residual: Optional[Tensor], bits: int,
                                       block: int, chunk: int, average: bool, stochastic: bool, seed: int,
                                       requant_seed: int, async_op: bool, tag: int = 0) -> Any: ...

    def host_quantized_all_reduce(self, tensor: Tensor, residual: Optional[Tensor],
                                  padded: Tensor, mine: Tensor, bits: int, block: int, chunk: int,
                                  average: bool, stochastic: bool, seed: int, quantize_seed: int,
                                  async_op: bool, tag: int = 0) -> Any: ...

    def host_top_k_all_reduce(self, tensor: Tensor, residual: Optional[Tensor], padded: Tensor,
                              mine: Tensor, values: Tensor, indices: Tensor, send: Tensor,
                              gathered: Tensor, accumulator: Tensor, k: int, sparse: bool,
                              average: bool, async_op: bool, tag: int = 0) -> Any: ...

    def host_cast_all_reduce(self, tensor: Tensor, residual: Optional[Tensor], padded: Tensor,
                             mine: Tensor, sent: Tensor, accumulator: Tensor, average: bool,
                             async_op: bool) -> Any: ...


class CompressionHost(abc.ABC):
    """A communicator that runs compressed all-reduces over its own collectives and records their
    wire statistics (braid's ``Communicator``): ``Compressor.all_reduce`` hands it the call."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum", async_op: bool = False, *,
                   compression: Any = None, key: Hashable = "default", step: Optional[int] = None) -> Any:
        """Reduces ``tensor`` in place, compressed by ``compression`` when given (``step`` overrides
        the compressor's per-key call count for its warm-up)."""
