"""The compressed all-reduce: one driver for every codec.

A codec (compressors.py) is a format with its state: how a tensor becomes bytes and back
(``encode``, ``decode``, its wire bytes), its error-feedback residuals, its call counts. The one
thing the driver asks of it about the algorithm is how its payloads combine, its ``reduction``:

- ``REQUANTIZE`` (int8, int4 and fp8 blocks): payloads cannot be summed as they travel. Each rank
  splits its tensor in one chunk per rank and an all-to-all brings chunk i of every rank to rank
  i, which decodes and sums them in rank order in float32, encodes the sum once and all-gathers it.
- ``GATHER`` (top-k): every rank's (value, index) pairs are all-gathered and summed in rank order.
- ``NATIVE`` (16-bit casts): the encoded values are summed by the group's exact all-reduce.

The algorithm is chosen in one function, :func:`choose_path`: the warm-up's exact all-reduce
(EXACT), the dense fallback where the codec's payloads would weigh more than the tensor (DENSE),
compressed among all the ranks (FLAT), exact in each host and compressed between hosts (HOSTS over
a :class:`HostGroups`; BETWEEN_HOSTS in braid's communicator), or the quantized pipeline between
hosts (PIPELINED). Each path then runs over its target:

- a carrier (a :class:`GroupCarrier` over any group, or :class:`HostGroups`): the algorithm is
  written here (``_ON_GROUP``), over the group's collectives, with the kernels of the tensor's device;
- braid's communicator's C++ object: its calls (``ON_BRAID``, the fused one-call paths among
  them), each one unit of work on its progress thread. A communicator offers them as its
  ``COMPRESSED_ALL_REDUCE`` capability; codecs whose format braid's C++ core does not have (fp8)
  run the carrier algorithm over the communicator's collectives instead.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Hashable, Optional, Union

import torch

import braid.comm._C as _C  # the extension module itself (not the package)

from ..core import group_carrier
from ..core.device_kernels import kernels_for
from ..core.group import COMPRESSED_ALL_REDUCE, GroupWork, capabilities_of
from ..core.group_carrier import GroupCarrier, HostGroups
from ..core.vocabulary import AVG, Op, compressed_op_code
from ..core.wire import BraidCollectives, WireStats
from ..core.work import Work

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MASK64 = (1 << 64) - 1

# How a codec's payloads combine (its ``reduction``).
REQUANTIZE = "requantize"
GATHER = "gather"
NATIVE = "native"

# The algorithms of a compressed all-reduce (choose_path):
EXACT = "exact"  # the warm-up, a group of one: the group's own exact all-reduce
DENSE = "dense"  # input + residual uncompressed: where the codec's payloads weigh more (top-k)
FLAT = "flat"  # compressed among all the ranks
HOSTS = "hosts"  # a HostGroups: exact in each host, compressed across (any groups)
BETWEEN_HOSTS = "between_hosts"  # braid's communicator across hosts: the same in one fused call
PIPELINED = "pipelined"  # braid's communicator, one rank per host: the quantized pipeline between hosts


def mix64(*parts: int) -> int:
    """A 64-bit hash of integers (splitmix64 rounds): seeds of the stochastic rounding streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


def check_tensor(tensor: torch.Tensor) -> None:
    """A tensor a compressor can carry: a float32, bfloat16 or float16 torch.Tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"tensor must be float32, bfloat16 or float16 to be compressed, got {tensor.dtype}")


def copy_back(flat: torch.Tensor, tensor: torch.Tensor) -> None:
    """The result into the caller's tensor, when the call worked on a contiguous copy of it."""
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one dimension: a view where it is contiguous, else a contiguous copy (the
    result then goes back through :func:`copy_back`)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _exact_on_hosts(comm: BraidCollectives) -> bool:
    """Whether a compressed all-reduce on ``comm`` reduces exactly on each host and compresses
    only between hosts: ranks on several hosts, the same number on each, more than one."""
    return comm.num_hosts > 1 and comm.local_world_size > 1 and comm.uniform_hosts


def flat_path(q: Any, numel: int, peers: int, elem_size: int) -> str:
    """FLAT, or DENSE where ``q``'s payloads for ``numel`` elements among ``peers`` ranks would
    weigh more than the dense tensor."""
    return FLAT if q.sends_less(numel, peers, elem_size) else DENSE


def choose_path(q: Any, target: Any, numel: int, step: int, elem_size: int = 4) -> str:
    """The algorithm of ``q``'s all-reduce of ``numel`` elements of ``elem_size`` bytes at warm-up
    ``step`` over ``target``: a carrier (GroupCarrier or HostGroups: the algorithm over the group's
    collectives) or braid's communicator's C++ object (its calls, ``ON_BRAID``). The only place the
    choice is made."""
    braid = not isinstance(target, (GroupCarrier, HostGroups))
    n = target.world_size if braid else target.size
    if step < q.warmup_steps or n == 1 or (numel == 0 and not braid):
        return EXACT
    if isinstance(target, HostGroups):
        return HOSTS
    if braid:
        if _exact_on_hosts(target):
            return BETWEEN_HOSTS
        if (q.reduction, PIPELINED) in ON_BRAID and target.num_hosts == target.world_size > 1:
            return PIPELINED
    return flat_path(q, numel, n, elem_size)


class CompressedWork(Work):
    """Handle of an async compressed all-reduce, a :class:`~braid.comm.Work`: the collective runs
    on braid's progress thread, and decoding into the caller's tensor is chained to it, so it
    happens once, on that thread, as soon as the collective completes (it issues no collective, so
    it may run there)."""

    __slots__ = ("_decoded",)

    def __init__(self, work: Any, finish: Callable[[], None], tensor: torch.Tensor):
        super().__init__(work, "all_reduce")

        def decode(fut: torch.futures.Future) -> list:
            fut.value()  # raises the collective's error
            finish()
            return [tensor]

        self._decoded = work.get_future().then(decode)

    def wait(self, timeout: Optional[Union[float, timedelta]] = None) -> bool:
        """Blocks until the collective is done and the result decoded; raises its error. With
        ``timeout`` (seconds or a timedelta) returns False if the collective is still running
        then; 0 only polls."""
        if not super().wait(timeout):  # raises braid's typed errors
            return False
        self._decoded.wait()
        return True

    def is_completed(self) -> bool:
        return self._decoded.done()

    def is_success(self) -> bool:
        return self._decoded.done() and super().is_success()

    def describe(self) -> str:
        if super().is_completed() and super().is_success() and not self._decoded.done():
            return "all_reduce decoding"
        return super().describe()

    def __repr__(self) -> str:
        return f"<braid.comm.CompressedWork {self.describe()}>"

    def get_future(self) -> torch.futures.Future:
        """A future holding ``[tensor]`` once the result is decoded into it."""
        return self._decoded


# -- the entry points ---------------------------------------------------------------------------
def all_reduce(q: Any, comm: Any, tensor: torch.Tensor, op: Op, key: Hashable, async_op: bool,
               step: Optional[int]) -> Optional[Union[CompressedWork, GroupWork]]:
    """``q.all_reduce(comm, tensor, ...)`` (compressors.py documents it): a group offering the
    compressed all-reduce as a capability runs the call; any other group carries the algorithm."""
    if COMPRESSED_ALL_REDUCE in capabilities_of(comm):
        return comm.all_reduce(tensor, op, async_op, compression=q, key=key, step=step)
    code = compressed_op_code(op)
    check_tensor(tensor)
    carrier = group_carrier.carrier_of(comm, "comm")
    kernels_for(tensor.device)  # a device without kernels fails here, before any state changes
    q.check_numel(tensor.numel())  # before any state changes: a refused call leaves none
    calls, step = q.count_call(key, step)
    return _on_carrier(q, carrier, tensor, flat_view(tensor), code, key, calls, step, async_op)


def all_reduce_on_communicator(q: Any, communicator: Any, tensor: torch.Tensor, op: Op, key: Hashable,
                               async_op: bool, step: Optional[int]) -> tuple[Optional[Any], Any]:
    """``Communicator.all_reduce(tensor, compression=q)``: the communicator's calls where it offers
    them and braid's C++ core has ``q``'s format, else the carrier algorithm over its collectives.
    Returns the work (None unless ``async_op``) and the wire statistics."""
    if not (q.fused and COMPRESSED_ALL_REDUCE in communicator.capabilities):
        work = q.all_reduce(GroupCarrier(communicator), tensor, op, key=key, async_op=async_op, step=step)
        return work, q.last_wire_bytes
    return q.all_reduce_on(communicator._c, tensor, op, key=key, async_op=async_op, step=step)


def all_reduce_on(q: Any, comm: BraidCollectives, tensor: torch.Tensor, op: Op, key: Hashable, async_op: bool,
                  step: Optional[int]) -> tuple[Optional[CompressedWork], WireStats]:
    """The compressed all-reduce of the CPU ``tensor`` over braid's communicator's C++ object
    ``comm``: the path of :func:`choose_path`, run by ``comm``'s call for it. Returns the work
    (None unless ``async_op``) and the wire statistics."""
    if not q.fused:
        raise TypeError(f"{type(q).__name__} has no fused call in braid's communicator: reduce with "
                        "Communicator.all_reduce(t, compression=q) or q.all_reduce(c, t)")
    op_code = compressed_op_code(op)
    check_tensor(tensor)
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor must be a CPU tensor to travel through a braid Communicator, "
                         f"got a tensor on {tensor.device} (reduce CUDA tensors over a torch "
                         "process group)")
    q.check_numel(tensor.numel())  # before any state changes: a refused call leaves none
    calls, step = q.count_call(key, step)
    flat = flat_view(tensor)
    n, es = comm.world_size, flat.element_size()
    path = q.last_path = choose_path(q, comm, flat.numel(), step, es)
    if path == EXACT:
        work = comm.all_reduce(flat, op_code, async_op)
        stats = q.exact_wire_stats(flat.numel() * es, n)
        finish = None
    else:
        run = _dense_on_braid if path == DENSE else ON_BRAID[q.reduction, path]
        work, finish = run(q, comm, flat, op_code, key, q.seed_for(comm.rank, key, calls), async_op)
        if path == BETWEEN_HOSTS:  # exact inside each host, compressed across
            stats = q.wire_stats(flat.numel(), es, comm.num_hosts, comm.local_world_size,
                                 float32_fallback=True)
        else:
            stats = q.wire_stats(flat.numel(), es, n)
    q.count_wire(stats)

    def done() -> None:
        if finish is not None:
            finish()
        copy_back(flat, tensor)

    if not async_op:
        done()
        return None, stats
    return CompressedWork(work, done, tensor), stats


# -- over a carrier: the algorithms written here -------------------------------------------------
def _on_carrier(q: Any, carrier: Any, tensor: torch.Tensor, flat: torch.Tensor, op_code: int, key: Hashable,
                calls: int, step: int, async_op: bool) -> Optional[GroupWork]:
    """The all-reduce over a process group carrier as one job (comm/core/group_carrier.py's issue:
    in order on CPU, on the current stream on CUDA)."""
    n, es, average = carrier.size, flat.element_size(), op_code == AVG
    path = q.last_path = choose_path(q, carrier, flat.numel(), step, es)
    if path == EXACT:
        stats = q.exact_wire_stats(flat.numel() * es, n)

        def run() -> None:
            carrier.reduce_exact(flat, average, n)
    else:
        seed = q.seed_for(carrier.rank, key, calls)
        if path == HOSTS:
            run = _on_hosts(q, carrier, flat, average, key, seed)
            stats = q.wire_stats(flat.numel(), es, carrier.inter.size, carrier.intra.size)
        else:
            run = _group_algorithm(q, path)(q, carrier, flat, average, key, seed, n)
            stats = q.wire_stats(flat.numel(), es, n)
    q.count_wire(stats)

    def job() -> None:
        run()
        copy_back(flat, tensor)

    inline = (carrier.group if isinstance(carrier, HostGroups) else carrier).inline
    work = GroupWork(group_carrier.issue(job, [tensor], tensor.device, inline))
    if async_op:
        return work
    work.wait()
    return None


def _group_algorithm(q: Any, path: str) -> Callable[..., Callable[[], None]]:
    return _dense_on_group if path == DENSE else _ON_GROUP[q.reduction]


def _on_hosts(q: Any, hosts: HostGroups, flat: torch.Tensor, average: bool, key: Hashable, seed: int
              ) -> Callable[[], None]:
    """Exact inside the host, compressed across hosts: the host reduce-scatters ``flat`` (sum in
    local rank order, rounded once to its dtype), this rank's slice is compressed once (its own
    residual) and all-reduced among the ranks of its local index on every host (avg divides by
    every rank), and the host all-gathers the slices."""
    per = -(-flat.numel() // hosts.intra.size)
    mine = torch.empty(per, dtype=flat.dtype, device=flat.device)
    if hosts.inter.size == 1:  # one host: nothing is compressed

        def run_across() -> None:
            hosts.inter.reduce_exact(mine, average, hosts.size)
    else:
        across = flat_path(q, per, hosts.inter.size, flat.element_size())
        run_across = _group_algorithm(q, across)(q, hosts.inter, mine, average, key, seed, hosts.size)

    def run() -> None:
        mine.copy_(hosts.intra.sum_slices(flat, per))
        run_across()
        hosts.intra.gather_slices(mine, flat)

    return run


def _chunk_buffers(q: Any, key: Hashable, n: int, chunk: int, device: torch.device) -> list:
    """send, recv, accumulator, gathered of a requantizing all-reduce among ``n`` ranks: kept per
    key between calls (fresh memory would cost its page faults every call)."""
    cb = q.wire_bytes(chunk)

    def make() -> list:
        return [torch.empty(n * cb, dtype=torch.uint8, device=device),
                torch.empty(n * cb, dtype=torch.uint8, device=device),
                torch.empty(chunk, dtype=torch.float32, device=device),
                torch.empty(n * cb, dtype=torch.uint8, device=device)]

    return q.take_scratch(key, make, lambda b: b[0].numel() == n * cb and b[2].numel() == chunk
                          and b[0].device == device)


def _requantize_on_group(q: Any, c: GroupCarrier, flat: torch.Tensor, average: bool, key: Hashable, seed: int,
                         divisor: int) -> Callable[[], None]:
    """Encode once on flat's device, all-to-all of the chunks, every chunk decoded and summed once
    in rank order in float32 by its owner, encoded once more, all-gathered, decoded: the steps (and
    bits) of the communicator's quantized all-reduce (quantized_all_reduce.cc)."""
    n, numel = c.size, flat.numel()
    chunk = q.chunk_elems(numel, n)
    cb = q.wire_bytes(chunk)
    kernels_for(flat.device)  # a device without kernels fails here

    def run() -> None:
        bufs = _chunk_buffers(q, key, n, chunk, flat.device)
        send, recv, acc, gathered = bufs
        q.encode(flat, q.residual_for(key, numel, flat.device), seed, 0, chunk, n, out=send)
        c.all_to_all(recv, send)
        q.decode_sum(recv, n, acc.zero_())
        if average:
            acc.div_(divisor)
        mine = send[:cb]  # free again once the all-to-all is done
        q.encode(acc, None, mix64(seed, 1), c.rank * chunk, chunk, 1, out=mine)
        c.all_gather(gathered, mine)
        q.decode(gathered, flat, chunk)
        q.keep_scratch(key, bufs)

    return run


def _gather_on_group(q: Any, c: GroupCarrier, flat: torch.Tensor, average: bool, key: Hashable, seed: int,
                     divisor: int) -> Callable[[], None]:
    """Every rank's payload (of flat + residual) all-gathered and summed in rank order."""
    n, numel = c.size, flat.numel()

    def run() -> None:
        send = q.encode(flat, q.residual_for(key, numel, flat.device))
        gathered = torch.empty(n * send.numel(), dtype=torch.uint8, device=flat.device)
        c.all_gather(gathered, send)
        q.decode_sum(gathered, n, flat, divisor if average else 1)

    return run


def _native_on_group(q: Any, c: GroupCarrier, flat: torch.Tensor, average: bool, key: Hashable, seed: int,
                     divisor: int) -> Callable[[], None]:
    """flat + residual encoded once on its device, all-reduced exactly in rank order (the encoded
    values on the wire, float32 sums, one rounding), decoded into flat."""
    numel = flat.numel()

    def run() -> None:
        bufs = _encoded_buffer(q, key, numel, flat.device)
        sent = q.encode(flat, q.residual_for(key, numel, flat.device), bufs[0])
        c.reduce_exact(sent, average, divisor)
        q.decode(sent, flat)
        q.keep_scratch(key, bufs)

    return run


def _dense_on_group(q: Any, c: GroupCarrier, flat: torch.Tensor, average: bool, key: Hashable, seed: int,
                    divisor: int) -> Callable[[], None]:
    """The dense fallback of any codec: flat + residual all-reduced exactly, uncompressed (the
    residual then keeps nothing)."""
    numel = flat.numel()
    kern = kernels_for(flat.device)

    def run() -> None:
        dense = _send_everything(kern, flat, q.residual_for(key, numel, flat.device))
        c.reduce_exact(dense, average, divisor)
        if dense is not flat:
            flat.copy_(dense)

    return run


_ON_GROUP = {REQUANTIZE: _requantize_on_group, GATHER: _gather_on_group, NATIVE: _native_on_group}


def _send_everything(kern: Any, flat: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """What the dense fallback sends: input + residual (summed into the residual, which then keeps
    nothing), or the input itself without error feedback."""
    if residual is None:
        return flat
    kern.error_feedback(flat, residual, None)  # residual = input + residual
    dense = residual.clone()
    residual.zero_()
    return dense


def _encoded_buffer(q: Any, key: Hashable, numel: int, device: torch.device) -> list:
    """[the encoded copy that travels] of a NATIVE codec, kept per key between calls."""
    return q.take_scratch(key, lambda: [torch.empty(numel, dtype=q.dtype, device=device)],
                          lambda b: b[0].numel() == numel and b[0].device == device)


def _slice_buffers(flat: torch.Tensor, local: int) -> list:
    """The padded copy of ``flat`` (empty when its size divides) for an all-reduce exact on the
    host, and this rank's slice of ``flat`` across ``local`` host ranks."""
    per = -(-flat.numel() // local)
    size = per * local if per * local != flat.numel() else 0
    return [torch.empty(size, dtype=flat.dtype, device=flat.device),
            torch.empty(per, dtype=flat.dtype, device=flat.device)]


# -- over braid's communicator: its calls, one unit of work each ---------------------------------
# Each takes (codec, communicator's C++ object, flat CPU tensor, op code, key, seed, async_op) and
# returns (work or None, finish: what runs once the work is done, or None).
def _requantize_on_braid(q, comm, flat, op_code, key, seed, async_op):
    """The communicator's quantized all-reduce: the steps of _requantize_on_group in one call."""
    n, numel = comm.world_size, flat.numel()
    chunk = q.chunk_elems(numel, n)
    bufs = _chunk_buffers(q, key, n, chunk, flat.device)
    send, recv, acc, gathered = bufs
    q.encode(flat, q.residual_for(key, numel), seed, 0, chunk, n, out=send)
    work = comm.quantized_all_reduce(send, recv, acc, gathered, q.bits, q.block, chunk, op_code == AVG,
                                     q.stochastic, mix64(seed, 1), async_op, q.call_tag(op_code, flat))

    def finish() -> None:
        q.decode(gathered, flat, chunk)
        q.keep_scratch(key, bufs)

    return work, finish


def _requantize_between_hosts(q, comm, flat, op_code, key, seed, async_op):
    """Exact on each host, quantized between hosts: the host reduce-scatters the tensor (local
    rank i keeps slice i), slice i is quantized once (its own error-feedback residual) and
    all-reduced with the ranks of local index i on the other hosts, pipelined in pieces, and the
    host all-gathers the slices."""
    local, hosts = comm.local_world_size, comm.num_hosts
    per = -(-flat.numel() // local)
    chunk = q.chunk_elems(per, hosts)
    padded, mine = q.take_scratch(key, lambda: _slice_buffers(flat, local),
                                  lambda b: b[1].numel() == per and b[1].dtype == flat.dtype)
    work = comm.host_quantized_all_reduce(
        flat, q.residual_for(key, per), padded, mine, q.bits, q.block, chunk, op_code == AVG,
        q.stochastic, mix64(seed, 1), seed, async_op, q.call_tag(op_code, flat))
    return work, lambda: q.keep_scratch(key, [padded, mine])


def _requantize_pipelined(q, comm, flat, op_code, key, seed, async_op):
    """Every rank on a host of its own: the quantized all-reduce between hosts pipelined in pieces
    (quantize, send, reduce, re-quantize, send back, decode overlapped), with the bits of the
    one-call layout."""
    n, numel = comm.world_size, flat.numel()
    chunk = q.chunk_elems(numel, n)
    work = comm.pipelined_quantized_all_reduce(
        flat, q.residual_for(key, numel), q.bits, q.block, chunk, op_code == AVG, q.stochastic,
        seed, mix64(seed, 1), async_op, q.call_tag(op_code, flat))
    return work, None


def _gather_on_braid(q, comm, flat, op_code, key, seed, async_op):
    """The payloads all-gathered by the communicator, summed in rank order once they arrive."""
    n = comm.world_size
    send = q.encode(flat, q.residual_for(key, flat.numel()))
    gathered = torch.empty(n * send.numel(), dtype=torch.uint8, device=flat.device)
    work = comm.all_gather(gathered, send, async_op, q.call_tag(op_code, flat))
    return work, lambda: q.decode_sum(gathered, n, flat, n if op_code == AVG else 1)


def _gather_between_hosts(q, comm, flat, op_code, key, seed, async_op):
    """Exact on each host, top-k between hosts: the host reduce-scatters the tensor, this rank's
    slice (+ its residual) keeps its top k of the slice, all-gathered among the ranks of the same
    local index on the other hosts and summed in host order (the dense fallback where the pairs
    weigh more), and the host all-gathers the slices."""
    local, hosts = comm.local_world_size, comm.num_hosts
    per = -(-flat.numel() // local)
    k = q.k(per)
    sparse = flat_path(q, per, hosts, flat.element_size()) == FLAT

    def make() -> list:  # padded, slice, values, indices, send, gathered, accumulator
        on = flat.device
        return [*_slice_buffers(flat, local), torch.empty(k, device=on),
                torch.empty(k, dtype=torch.int32, device=on),
                torch.empty(8 * k, dtype=torch.uint8, device=on),
                torch.empty(hosts * 8 * k, dtype=torch.uint8, device=on), torch.empty(per, device=on)]

    bufs = q.take_scratch(key, make, lambda b: b[1].numel() == per and b[1].dtype == flat.dtype
                          and b[2].numel() == k)
    work = comm.host_top_k_all_reduce(flat, q.residual_for(key, per), *bufs, k, sparse, op_code == AVG,
                                      async_op, q.call_tag(op_code, flat))
    return work, lambda: q.keep_scratch(key, bufs)


def _native_on_braid(q, comm, flat, op_code, key, seed, async_op):
    """flat + residual encoded once (one C++ pass also updating the residual), all-reduced by the
    communicator, decoded into flat."""
    numel = flat.numel()
    bufs = _encoded_buffer(q, key, numel, flat.device)
    sent = q.encode(flat, q.residual_for(key, numel), bufs[0])
    work = comm.all_reduce(sent, op_code, async_op)

    def finish() -> None:
        q.decode(sent, flat)
        q.keep_scratch(key, bufs)

    return work, finish


def _native_between_hosts(q, comm, flat, op_code, key, seed, async_op):
    """Exact on each host, cast between hosts: the host reduce-scatters the tensor, this rank's
    slice (+ its residual) is rounded once to the codec's dtype and all-reduced among the ranks of
    the same local index on the other hosts, and the host all-gathers the slices."""
    local = comm.local_world_size
    per = -(-flat.numel() // local)

    def make() -> list:  # padded, slice, sent, accumulator
        return [*_slice_buffers(flat, local), torch.empty(per, dtype=q.dtype, device=flat.device),
                torch.empty(per, device=flat.device)]

    bufs = q.take_scratch(key, make, lambda b: b[1].numel() == per and b[1].dtype == flat.dtype)
    work = comm.host_cast_all_reduce(flat, q.residual_for(key, per), *bufs, op_code == AVG, async_op)
    return work, lambda: q.keep_scratch(key, bufs)


def _dense_on_braid(q, comm, flat, op_code, key, seed, async_op):
    """The dense fallback: flat + residual through the communicator's exact all-reduce."""
    dense = _send_everything(_C, flat, q.residual_for(key, flat.numel()))
    work = comm.all_reduce(dense, op_code, async_op)

    def finish() -> None:
        if dense is not flat:
            flat.copy_(dense)

    return work, finish


# The communicator's call for each (reduction, path); PIPELINED is chosen only where one is here.
ON_BRAID = {
    (REQUANTIZE, FLAT): _requantize_on_braid,
    (REQUANTIZE, BETWEEN_HOSTS): _requantize_between_hosts,
    (REQUANTIZE, PIPELINED): _requantize_pipelined,
    (GATHER, FLAT): _gather_on_braid,
    (GATHER, BETWEEN_HOSTS): _gather_between_hosts,
    (NATIVE, FLAT): _native_on_braid,
    (NATIVE, BETWEEN_HOSTS): _native_between_hosts,
}
