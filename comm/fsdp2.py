"""FSDP2 custom communication on braid: all-gather and reduce-scatter objects for ``fully_shard`` modules.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps its own scheduling (which parameters are
gathered when, prefetching, resharding) and hands each flat collective to the objects installed
with ``set_custom_all_gather`` / ``set_custom_reduce_scatter``. These objects run that collective
on a braid group (comm/core/group.py): a braid Communicator, or any torch ProcessGroup (an NCCL group
on GPUs), instead of the process group FSDP2 was built on, which still serves FSDP2's bookkeeping;
its ranks must be the group's ranks, in order. Built with None, they run on the very group FSDP2
hands each call (its mesh's), through braid's group interface.

What FSDP2 (torch 2.13) passes, and what comes back:

- ``allocate(size, dtype=, device=)`` for the flat buffers of both collectives: plain memory of
  that device (CPU, or CUDA where the group serves it).
- all-gather ``(output_tensor, input_tensor, group, async_op)``: ``input_tensor`` is this rank's
  slice of ``output_tensor`` (an in-place gather, which braid supports as such). With ``async_op``
  FSDP2 waits on the result only if it is a ``torch.distributed.Work``, so the braid work is
  returned inside one; otherwise the call blocks and returns None.
- reduce-scatter ``(output_tensor, input_tensor, group, op)``: FSDP2 reads the output right after
  the call, so it blocks. ``op`` is SUM or AVG (braid's own average: the fixed-order sum divided
  by the world size), or ``PREMUL_SUM(factor)`` when a gradient divide factor other than the world
  size is set: every rank's input is multiplied by the factor, then summed, as NCCL does. The input
  buffer is scaled in place: FSDP2 allocates it for this call only (its own pre-divide is in place
  too).
- All-gather inputs of mixed dtypes arrive as bytes (uint8), a dtype braid's collectives do not
  take: they travel as a wider type of the same size, or through a padded copy when the byte
  count does not divide.

FSDP2 on CUDA tensors over a mesh whose CUDA backend is gloo is refused (see
:func:`gloo_mesh_problem`): torch's gloo backend kills the process on the DTensor gathers such a
model needs, a fault braid's objects cannot route around.

The interface classes live in a private torch module (torch 2.13 exports no public name for
them); FSDP2 only calls the methods above.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .compression import FLOAT_DTYPES, Adaptive, BlockQuantizer
from .core.group import adapter, as_group, check_device, renamed_args
from .core.vocabulary import AVG, WIRE_DTYPES, op_code

# Same-size carriers for moving bytes, widest first: a view needs the byte count to divide. A
# gather only copies, so float16 carries any 2-byte pattern unchanged.
_CARRIERS = ((8, torch.int64), (4, torch.int32), (2, torch.float16))


class BraidWork(dist.Work):
    """A ``torch.distributed.Work`` around a braid Work, for callers that only accept the former
    (FSDP2 waits on an async all-gather only when it is one). ``after`` runs once, on the first
    ``wait`` that sees the collective done (a copy out of a staging buffer)."""

    def __init__(self, work: Any, after: Optional[Any] = None):
        super().__init__()
        self._work = work
        self._after = after

    def wait(self, timeout: Any = None) -> bool:
        seconds = None
        if timeout is not None:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            if seconds <= 0:  # c10d's "no timeout" spelling
                seconds = None
        done = self._work.wait(seconds)
        if done and self._after is not None:
            after, self._after = self._after, None
            after()
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()


def _group_for(mine: Any, group: Optional[dist.ProcessGroup], what: str) -> Any:
    """The group a call runs on: the one these comms were built with (checked against FSDP2's
    ``group``: same size, same rank), or FSDP2's own when they were built with None."""
    if mine is None:
        if group is None:
            raise ValueError(f"{what} was built with no group and FSDP2 passed none: build it with a "
                             "braid Communicator or a ProcessGroup")
        return as_group(group, "group", what)
    if group is not None and (group.size() != mine.world_size or group.rank() != mine.rank):
        raise ValueError(f"{what}: FSDP2's group (rank {group.rank()} of {group.size()}) is not braid's "
                         f"(rank {mine.rank} of {mine.world_size}); shard over a mesh whose ranks are "
                         "the group's")
    return mine


def gloo_mesh_problem(group: Any, device: torch.device) -> Optional[str]:
    """Why FSDP2 must not shard tensors on ``device`` over ``group`` (its mesh's ProcessGroup), or
    None where it may.

    torch's gloo backend copies CUDA tensors through host memory in its all-reduce, broadcast and
    ``_allgather_base``, but not in ``allgather_into_tensor_coalesced``: that one forwards to
    ``ProcessGroupGloo::allgather_coalesced``, which has no CUDA path and hands the device pointers
    to gloo's TCP transport (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp). Every functional
    all-gather takes it (``_c10d_functional.all_gather_into_tensor``, Functional.cpp), so on a CUDA
    mesh over gloo a fully_shard model's ``full_tensor()``, ``redistribute`` to Replicate and full
    state dicts die with SIGSEGV (pytorch/pytorch#132471), with braid's comm objects or without."""
    if torch.device(device).type != "cuda" or not isinstance(group, dist.ProcessGroup):
        return None
    if adapter(group).backend_for(device) != "gloo":
        return None
    return ("FSDP2 shards CUDA tensors over a mesh whose CUDA backend is gloo, and torch's gloo hands "
            "CUDA pointers to its TCP transport in allgather_into_tensor_coalesced (ProcessGroupGloo::"
            "allgather_coalesced has no CUDA path), which DTensor's full_tensor(), redistribute and full "
            "state dicts use: the process dies with SIGSEGV (pytorch/pytorch#132471). Build the mesh over "
            "a group whose CUDA backend gathers CUDA tensors: init_process_group(\"cpu:gloo,cuda:braid\") "
            "(braid's backend, in a braid build with CUDA) or \"cpu:gloo,cuda:nccl\"")


def _check_devices(c: Any, group: Optional[dist.ProcessGroup], what: str, **tensors: torch.Tensor) -> None:
    """The tensors' device can travel over ``c`` (braid's group) and FSDP2 may shard it over
    ``group`` (FSDP2's)."""
    for name, t in tensors.items():
        check_device(c, t.device, f"{what}: {name}'s elements")
        problem = gloo_mesh_problem(group, t.device)
        if problem:
            raise ValueError(f"{what}: {name} is on {t.device}, but {problem}")


def _carrier(nbytes: int) -> Optional[torch.dtype]:
    for size, dtype in _CARRIERS:
        if nbytes % size == 0:
            return dtype
    return None


class _BraidComm:
    """What both collectives share: the group (None: FSDP2's own, per call), the compression (a
    block quantizer or None) and plain buffers."""

    @renamed_args(communicator="group")
    def __init__(self, group: Any = None, compression: Any = None):
        what = type(self).__name__
        self.communicator = None if group is None else as_group(group, "group", what)
        if compression is not None and not isinstance(compression, BlockQuantizer):
            raise TypeError(f"{what}: compression must be None or a block quantizer (braid.comm."
                            f"Int8Quantizer, Int4Quantizer or FP8Quantizer), got "
                            f"{type(compression).__name__}")
        self.compression = compression

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer for a collective: ordinary memory of ``device`` (braid copies through its
        own segments; process groups take it as it is)."""
        return torch.empty(*size, dtype=dtype, device=device)


class BraidAllGather(_BraidComm, AllGather):
    """FSDP2 all-gather on a braid communicator (install with ``module.set_custom_all_gather``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[dist.Work]:
        c = _group_for(self.communicator, group, "BraidAllGather")
        _check_devices(c, group, "BraidAllGather", output_tensor=output_tensor, input_tensor=input_tensor)
        out, inp, after = output_tensor, input_tensor, None
        if self.compression is not None and out.dtype in FLOAT_DTYPES:
            out, inp, after = self._quantized(c, output_tensor, input_tensor)
        elif out.dtype not in WIRE_DTYPES:
            out, inp, after = self._as_wire(c, output_tensor, input_tensor)
        work = c.all_gather(out, inp, async_op=async_op)
        if not async_op:
            if after is not None:
                after()
            return None
        return BraidWork(work, after)

    def _quantized(self, c: Any, output: torch.Tensor, input: torch.Tensor):
        """qwZ: this rank's piece quantized once (to nearest), the payloads gathered, every rank
        decoding the same bytes (its own included): identical weights everywhere."""
        q, n, m = self.compression, c.world_size, input.numel()
        chunk = q.chunk_elems(m, 1)  # whole quantization blocks
        payload = q.encode(input.reshape(-1), None, 0, c.rank * chunk, chunk, 1, stochastic=False)
        gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=payload.device)

        def decode() -> None:
            decoded = torch.empty(n * chunk, dtype=output.dtype, device=output.device)
            q.decode(gathered, decoded, chunk)
            output.view(n, m).copy_(decoded.view(n, chunk)[:, :m])

        return gathered, payload, decode

    @staticmethod
    def _as_wire(c: Any, output: torch.Tensor, input: torch.Tensor):
        """Views (or stages) a gather of an unsupported dtype as a supported one of the same bytes."""
        n = c.world_size
        in_bytes = input.numel() * input.element_size()
        carrier = _carrier(in_bytes) if output.is_contiguous() and input.is_contiguous() else None
        if carrier is not None:
            return output.view(torch.uint8).view(carrier), input.view(torch.uint8).view(carrier), None
        # Odd byte count: gather padded rows, then copy each rank's bytes into place.
        row = -(-in_bytes // 8)
        staged_in = torch.zeros(row, dtype=torch.int64, device=input.device)
        staged_in.view(torch.uint8)[:in_bytes].copy_(input.reshape(-1).view(torch.uint8))
        staged_out = torch.empty(n * row, dtype=torch.int64, device=output.device)

        def copy_out() -> None:
            rows = staged_out.view(torch.uint8).view(n, row * 8)[:, :in_bytes]
            output.view(torch.uint8).view(n, in_bytes).copy_(rows)

        return staged_out, staged_in, copy_out


class BraidReduceScatter(_BraidComm, ReduceScatter):
    """FSDP2 reduce-scatter on a braid communicator (install with ``module.set_custom_reduce_scatter``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Optional[dist.ProcessGroup] = None, op: Any = dist.ReduceOp.SUM,
                 async_op: bool = False) -> Optional[dist.Work]:
        c = _group_for(self.communicator, group, "BraidReduceScatter")
        _check_devices(c, group, "BraidReduceScatter", output_tensor=output_tensor, input_tensor=input_tensor)
        # FSDP2 passes a RedOpType (SUM, AVG) or a ReduceOp instance (PREMUL_SUM with its factor).
        kind = op.op if type(op) is dist.ReduceOp else op
        if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
            if type(op) is not dist.ReduceOp:
                raise ValueError("BraidReduceScatter: op PREMUL_SUM needs its factor: pass "
                                 "ReduceOp.PREMUL_SUM(factor), not the bare RedOpType")
            input_tensor.mul_(op.factor)
            op = "sum"
        if self.compression is not None and input_tensor.dtype in FLOAT_DTYPES:
            return self._quantized(c, output_tensor, input_tensor, op_code(op) == AVG, async_op)
        work = c.reduce_scatter(output_tensor, input_tensor, op=op, async_op=async_op)
        return BraidWork(work) if async_op else None

    def _quantized(self, c: Any, output: torch.Tensor, input: torch.Tensor, average: bool,
                   async_op: bool) -> Optional[dist.Work]:
        """qgZ: the gradient quantized once into one piece per rank (stochastic rounding as the
        compressor says; no error feedback: FSDP2 names no module per call to keep a residual
        for), an all-to-all, and this rank's pieces decoded and summed in rank order in float32."""
        q, n, m = self.compression, c.world_size, output.numel()
        chunk = q.chunk_elems(m, 1)  # whole quantization blocks
        rows = torch.zeros(n, chunk, dtype=input.dtype, device=input.device)
        rows[:, :m] = input.view(n, m)
        seed = q.seed_for(c.rank, "braid.fsdp2.grad", q.next_call("braid.fsdp2.grad"))
        payload = q.encode(rows.view(-1), None, seed, 0, chunk, n)
        received = torch.empty_like(payload)
        work = c.all_to_all(received, payload, async_op=True)

        def decode() -> None:
            acc = q.decode_sum(received, n, torch.zeros(chunk, dtype=torch.float32, device=input.device))
            if average:
                acc.div_(n)
            output.copy_(acc[:m].view(output.shape))

        if async_op:
            return BraidWork(work, decode)
        work.wait()
        decode()
        return None


@renamed_args(communicator="group")
def fsdp2_comms(group: Any = None, *, param_compression: Any = None,
                grad_compression: Any = None) -> tuple[BraidAllGather, BraidReduceScatter]:
    """The (all_gather, reduce_scatter) pair that makes FSDP2 move its bytes through ``group``:
    a braid Communicator, any torch ProcessGroup, or None (each call runs on the group FSDP2 hands
    it, through braid's group interface).

        ag, rs = fsdp2_comms(c)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(ag)
                m.set_custom_reduce_scatter(rs)

    (:func:`use_braid_comms` does this loop.) The FSDP2 mesh's ranks must be the group's. On CUDA
    tensors the mesh's CUDA backend must not be gloo: the objects refuse it at FSDP2's first call
    (:func:`gloo_mesh_problem` says why).

    ``param_compression`` (``comm.Int8Quantizer()`` or ``Int4Quantizer()``): the weights' gathers
    travel block-quantized, rounded to nearest, identical on every rank (ZeRO++'s qwZ; FSDP2 keeps
    its exact sharded parameters). ``grad_compression``: the gradients' reduce-scatters travel
    block-quantized by an all-to-all and are summed in float32 (qgZ), without error feedback
    (``error_feedback=False`` is required: FSDP2 names no module per call to keep a residual for).
    ``comm.Adaptive`` is refused for the same reason: it decides, measures and keeps residuals per
    bucket and per step, and FSDP2's calls say neither which parameters they carry nor where a
    backward ends (braid's own ``fsdp.shard(..., grad_compression=comm.Adaptive())`` does).
    """
    if isinstance(grad_compression, Adaptive):
        raise TypeError("grad_compression: braid.comm.Adaptive cannot run under FSDP2: it decides and keeps "
                        "error feedback per bucket and measures each step's overlap, and FSDP2's custom "
                        "reduce-scatter is told neither which module's gradients it carries nor where a "
                        "backward ends; use braid's fsdp.shard(..., grad_compression=comm.Adaptive()), or a "
                        "block quantizer with error_feedback=False here")
    if grad_compression is not None and getattr(grad_compression, "error_feedback", False):
        raise ValueError("grad_compression: FSDP2's reduce-scatters carry no identity of their module, so "
                         "braid keeps no error-feedback residual for them: pass a quantizer with "
                         "error_feedback=False (braid's own fsdp.shard keeps residuals per bucket)")
    return (BraidAllGather(group, param_compression),
            BraidReduceScatter(group, grad_compression))


@renamed_args(communicator="group")
def use_braid_comms(module: torch.nn.Module, group: Any = None, *, param_compression: Any = None,
                    grad_compression: Any = None) -> int:
    """Installs braid's collectives on every ``fully_shard`` module inside ``module`` (itself
    included); returns how many were set. Call after ``fully_shard``, before the first forward.
    ``param_compression`` / ``grad_compression``: as for :func:`fsdp2_comms`."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    all_gather, reduce_scatter = fsdp2_comms(group, param_compression=param_compression,
                                             grad_compression=grad_compression)
    count = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(all_gather)
            m.set_custom_reduce_scatter(reduce_scatter)
            count += 1
    if count == 0:
        raise ValueError("module holds no fully_shard module: call fully_shard on it (and its parts) first")
    return count
