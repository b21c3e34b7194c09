"""When the sharded wrapper's collectives run: all-gathers around each unit's forward and backward,
reduce-scatters of gradients as the backward produces them, and the end of the backward.

Gathers (ZeRO stage 3). A unit's buckets are all-gathered before its forward (forward pre-hook) and
again before its backward (a hook on the gradient of the unit's output), the next unit in
execution order prefetched, at most two all-gathers in flight; the full buffers are freed after
the unit's forward (``reshard_after_forward``) and after its gradients are ready. The root unit
stays gathered from the start of the forward to the end of the backward.

Gradients. Autograd accumulates a bucket's gradient into its full flat tensor; the post-accumulate
hook of that tensor fires once every parameter of the bucket has its gradient, and launches an
async reduce-scatter with braid's average (the mean over ranks, as DDP) into a new shard-sized
tensor. Results are added to their shard's ``.grad`` oldest first: those already done whenever
another bucket launches, the oldest waited for past two pending (a pending one holds a full-size
gradient), the rest at the end of the backward (an autograd engine callback). Inside
``no_sync()`` nothing is launched: the gradients stay in the full flat tensors, and the next
synchronized backward reduces the sum. With ``grad_compression`` a block quantizer encodes the
pieces (qgZ); an Adaptive chooses per bucket (comm/compression/adaptive/: exact, 16-bit or quantized
pieces), this schedule issuing what it chose and telling it where each synchronized backward
ends.

Parameter refresh (ZeRO stages 1, 2). An optimizer updates the shards in place after a synchronized
backward; the next forward (each unit's pre-hook, with the prefetch) all-gathers the buckets
whose gradient that backward reduced, and any other whose shard's version counter moved since its
last gather (fused optimizers do not bump the counters, so these are not relied upon alone).

Every collective is issued by every rank in the same order: ranks must run the same forward and
backward (the same units, the same parameters used), as with DDP.
"""
from __future__ import annotations

import functools
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..compression.adaptive import Adaptive
from ..compression import FLOAT_DTYPES, Cast
from ..core.device_kernels import kernels_for
from ..core.group import as_group
from ..core.placement import Placement
from ..core.wire import WireStats
from .layout import Bucket, Unit, alloc, free, gather_input, set_views, wire

# Buckets whose gathers a param_compression quantizes (others, frozen integer or float64 ones, travel
# exactly).
QUANTIZABLE = FLOAT_DTYPES
# How many unit all-gathers may be in flight at once (the one about to be used and one ahead):
# each holds a unit's full buffers, so this bounds ZeRO stage 3's memory above the shards.
MAX_GATHERS_IN_FLIGHT = 2
# How many bucket reduce-scatters may be pending during the backward: each holds a full-size
# gradient until done, so without a bound the backward of ZeRO stages 2 and 3 would peak at the whole
# unsharded gradient. Past it the oldest is waited for (it is usually done by then).
MAX_REDUCES_IN_FLIGHT = 2


class _Done:
    """The work of a reduction finished when it was issued."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


def _weakly(method: Any, *bound: Any) -> Any:
    """``functools.partial(method, *bound)`` that does not keep ``method``'s schedule alive: the
    hooks live on parameters and tensors autograd holds in C++, where Python's collector cannot see
    a cycle back to the schedule, so a strong hook would keep a dropped wrapper (its buffers, its
    groups and their threads) for good. Once the schedule is gone the hook does nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        fn = ref()
        return None if fn is None else fn(*bound, *args)

    return call


def grad_key(b: Bucket) -> tuple:
    """The key of a bucket's gradient in a grad_compression compressor (its residual, its calls)."""
    return ("braid.fsdp.grad", b.index)


class Schedule:
    """The collectives of one sharded module, issued from its forward and autograd hooks.

    ``units`` (the root unit last, when there is one) hold the buckets; ``sync`` False is
    ``no_sync()``; ``pending`` holds (bucket, work, reduced, gradient) per reduce-scatter not yet
    added to its shard's gradient."""

    def __init__(self, group: Any, stage: int, prefetch: int, reshard_after_forward: bool,
                 units: list, root: Optional[Unit], device: torch.device, param_compression: Any = None,
                 grad_compression: Any = None, hosts: Any = None):
        self.communicator = group
        # hpZ: the group of this rank's host, which the backward's gathers use.
        hpz = hosts is not None and stage == 3 and reshard_after_forward
        self.intra = as_group(hosts.intra.group, "hierarchical") if hpz else None
        # Hierarchical qgZ: gradients summed exactly inside the host, quantized across hosts.
        self.layout = (Placement(group, device, hosts)
                       if hosts is not None and grad_compression is not None else None)
        self.hosts = hosts if self.layout is not None else None
        self.param_compression = param_compression  # a block quantizer: gathers travel quantized
        # A block quantizer (reduce-scatters travel quantized), or an Adaptive (which decides per
        # bucket among exact, 16-bit and quantized pieces).
        self.grad_compression = grad_compression
        self.wire = {"all_gather": WireStats(0, 0, 0), "all_gather_in_host": WireStats(0, 0, 0),
                     "reduce_scatter": WireStats(0, 0, 0), "reduce_scatter_in_host": WireStats(0, 0, 0)}
        self.stage = stage
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.units = units
        self.root = root
        self.sync = True
        self.optimizer: Any = None        # stepped per bucket as its reduce-scatter lands (step_in_backward)
        self.delay = False                # step_in_backward's delay: the steps run during the next step
        self.delayed_jobs: list = []      # their futures on the host thread
        self.finish_queued = False
        self.in_flight: list[Unit] = []   # units with all-gathers launched, oldest first
        self.pending: list = []           # (bucket, work, finish, gradient) per reduce-scatter
        self.order: list[Unit] = []       # non-root units in the order their forwards ran
        self.order_done = False
        # offload_optimizer: the host's part of each reduced bucket (its gradient added to the
        # master shard's, the shard stepped under step_in_backward) runs on one thread of its own,
        # in retire order, while the backward goes on; ``host_jobs`` are its futures this backward.
        self.host_pool: Optional[ThreadPoolExecutor] = None
        self.host_jobs: list = []

    def install(self) -> None:
        """Hooks every unit's forward and every trainable bucket's gradient, and leaves the
        parameters as the stage keeps them between steps (ZeRO stage 3 resharded, else as views)."""
        for b in self.buckets():
            if b.trainable:
                b.full.register_hook(_weakly(self._before_accumulate, b))
                b.full.register_post_accumulate_grad_hook(_weakly(self._on_grad_ready, b))
        for unit in self.units:
            if unit.module is not None:
                unit.module.register_forward_pre_hook(_weakly(self._pre_forward, unit))
                unit.module.register_forward_hook(_weakly(self._post_forward, unit))
            if self.stage == 3:
                self.reshard(unit)
            else:
                set_views(unit, False)

    def buckets(self) -> Iterator[Bucket]:
        for unit in self.units:
            yield from unit.buckets

    def check_idle(self, what: str) -> None:
        """Raises when called during a backward (reduce-scatters or host steps pending); between
        steps, completes the delayed steps still running (step_in_backward's delay)."""
        if self.pending or self.finish_queued or self.host_jobs:
            raise RuntimeError(f"{what} during a backward pass: call it between steps")
        self.finish_delayed()

    def finish_delayed(self) -> None:
        """Waits for the delayed steps (step_in_backward's delay) and lets the next forward
        gather the masters they updated; the first error is raised."""
        jobs, self.delayed_jobs = self.delayed_jobs, []
        errors = [job.exception() for job in jobs]
        for b in self.buckets():
            if b.frozen:
                b.frozen = False
                b.synced_version = b.uploaded_version = -1
        for e in errors:
            if e is not None:
                raise e

    def _delay_steps(self) -> None:
        """The end of a synchronized backward under step_in_backward's delay (ZeRO-Offload's
        delayed parameter update): the previous step's updates are done; every master as it is now
        goes to its image, which the next forward and backward compute with, and its step with
        the gradient just reduced runs on the host thread meanwhile. The gradient leaves the
        shard's ``.grad`` for that step, so that the next backward starts a fresh one."""
        self.finish_delayed()
        stepped = [b for b in self.buckets() if b.trainable and b.shard.grad is not None]
        if not stepped:
            return
        ready = None
        for b in stepped:
            b.uploaded_version = -1  # the image the next step computes with: the master as it is now
            self._upload(b)
        device = stepped[0].on_device.device
        if device.type != "cpu":  # the uploads read the masters: the steps start after them
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        if self.host_pool is None:
            self.host_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="braid-offload")
        for b in stepped:
            grad, b.shard.grad = b.shard.grad, None
            b.frozen = True
            b.synced_version = b.uploaded_version = -1
            self.delayed_jobs.append(self.host_pool.submit(self._delayed_step, b, grad, ready))

    def _delayed_step(self, b: Bucket, grad: torch.Tensor, ready: Any) -> None:
        if ready is not None:
            ready.synchronize()
        with torch.no_grad():
            self.optimizer.step_param(b.shard, grad)

    # -- gathers -----------------------------------------------------------------------------
    def _stale(self, unit: Unit) -> bool:
        if self.stage == 3:
            return not unit.gathered
        return any(self._bucket_stale(b) for b in unit.buckets)

    @staticmethod
    def _bucket_stale(b: Bucket) -> bool:
        """Whether the bucket's full buffer must be gathered again (ZeRO stages 1, 2): its shard
        changed since the last gather. A frozen bucket's master changes on the host thread at no
        time the ranks agree on: it is stale only until its image is gathered once."""
        return b.synced_version == -1 if b.frozen else b.shard._version != b.synced_version

    def _launch_gather(self, unit: Unit, force: bool = False) -> None:
        """Starts the all-gathers of ``unit``'s buckets: at ZeRO stage 3 all of them, at ZeRO stages 1 and 2
        those whose shard changed since their last gather (every one with ``force``)."""
        if unit.in_flight or not (force or self._stale(unit)):
            return
        while len(self.in_flight) >= MAX_GATHERS_IN_FLIGHT:
            self._wait_gather(self.in_flight[0])
        c = self.communicator
        for b in unit.buckets:
            if self.stage != 3 and not force and not self._bucket_stale(b):
                continue
            alloc(b.full)
            b.synced_version = -2 if b.frozen else b.shard._version
            self._upload(b)
            # A process group's all-gather bumps the full buffer's version counter (which the
            # shard, a view of it at ZeRO stages 1 and 2, and the forward's saved views share) when it
            # writes the output, on the group's own thread, at a time no rank controls. Autograd
            # would then refuse the backward of ZeRO stage 3, and the stale test above would differ
            # between ranks. The buffer is refilled with the values it is meant to hold (as FSDP2
            # refills its unsharded parameters), so its counter is put back once the gather is
            # done (_wait_gather).
            keep = torch.autograd._unsafe_preserve_version_counter(b.full)
            if b.secondary is not None:
                # hpZ: the backward's gather inside the host, from the pieces kept after the forward.
                piece, b.secondary = b.secondary, None
                work = self.intra.all_gather(wire(b.full.detach()), wire(piece), async_op=True)
                b.work = (work, keep, None, piece)
                nbytes = piece.numel() * piece.element_size()
                self._count("all_gather_in_host", nbytes, nbytes, self.intra.world_size)
                self._share_link((self.intra.world_size - 1) * nbytes, work, piece.device, in_host=True)
                continue
            out, inp, decode = self._gather_buffers(b)
            work = c.all_gather(out, inp, async_op=True)
            b.work = (work, keep, decode, inp)
            nbytes = inp.numel() * inp.element_size()
            self._count("all_gather", nbytes, b.shard_numel * b.full.element_size())
            self._share_link((c.world_size - 1) * nbytes, work, inp.device)
        unit.in_flight = True
        self.in_flight.append(unit)

    @staticmethod
    def _upload(b: Bucket) -> None:
        """offload_optimizer: copies the master shard to its image on the device when the master
        changed since (asynchronously from pinned memory, ordered before the all-gather that reads
        it, which the caller issues next on the same stream)."""
        if b.on_device is not None and not b.frozen and b.uploaded_version != b.shard._version:
            with torch.no_grad():
                b.on_device.copy_(b.shard.detach(), non_blocking=True)
            b.uploaded_version = b.shard._version

    def _adaptive_in_backward(self) -> Optional[Adaptive]:
        """The Adaptive grad_compression while a synchronized backward runs (else None)."""
        q = self.grad_compression
        return q if self.finish_queued and self.sync and isinstance(q, Adaptive) else None

    def _share_link(self, nbytes: int, work: Any, device: torch.device, in_host: bool = False) -> None:
        """A gather during a synchronized backward shares the link with the gradients'
        reduce-scatters: an Adaptive grad_compression counts it against their windows and times
        the link by it."""
        q = self._adaptive_in_backward()
        if q is not None:
            q.share_link(nbytes, in_host=in_host, work=work, device=device)

    def _gather_buffers(self, b: Bucket) -> tuple:
        """(output, input, decode or None) of a bucket's all-gather. Quantized (qwZ): this rank's
        shard block-quantized once (rounded to nearest, so the forward's and the backward's
        gathers agree), the payloads gathered, every rank decoding the same bytes into the full
        buffer: identical weights everywhere, the master shards untouched."""
        q = self.param_compression
        if q is None or b.dtype not in QUANTIZABLE or b.compute_dtype not in QUANTIZABLE:
            return wire(b.full.detach()), gather_input(b), None
        n, per = self.communicator.world_size, b.shard_numel
        source = b.shard.detach() if b.on_device is None else b.on_device
        payload = q.encode(source, None, 0, self.communicator.rank * per, per, 1, stochastic=False)
        gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=payload.device)

        def decode() -> None:
            q.decode(gathered, b.full.detach(), per)

        return gathered, payload, decode

    def _reduce_scatter(self, b: Bucket, sent: torch.Tensor, q: Any, call: Optional[int] = None,
                        residual: Optional[torch.Tensor] = None) -> tuple:
        """Issues the reduce-scatter of the bucket's gradient ``sent``; returns (work, finish),
        ``finish()`` giving the reduced shard once the work is done. ``q`` None: braid's exact
        average over the group, with ``residual`` (what an Adaptive's compression of the bucket
        dropped before it switched to exact) added to this rank's input first. Otherwise
        compressed with ``q``, its ``call``-th compression of the bucket (qgZ): flat over the
        group, or with hosts exact inside each host and compressed across."""
        if q is not None:
            if self.layout is None:
                return self._exchange(b, sent, q, call, self.communicator, sent.element_size())
            return self._hierarchical_reduce_scatter(b, sent, q, call)
        if residual is not None:
            self._add_residual(b, sent, residual)
        reduced = torch.empty(b.shard_numel, dtype=b.reduce_dtype, device=sent.device)
        work = self.communicator.reduce_scatter(reduced, sent, op="avg", async_op=True)
        piece = b.shard_numel * reduced.element_size()
        self._count("reduce_scatter", piece, piece)
        return work, lambda: reduced

    def _add_residual(self, b: Bucket, sent: torch.Tensor, residual: torch.Tensor) -> None:
        """Adds to this rank's input ``sent`` the residual its compressed reduce-scatters left: of
        the whole bucket (flat), or (with hosts) of this rank's slice of the host's sum, whose
        pieces are those of this rank's cross-host group's ranks; the exact sum carries it alike."""
        n, per = self.communicator.world_size, b.shard_numel
        with torch.no_grad():
            if self.layout is None:
                sent.add_(residual.to(sent.device).view(sent.shape))
                return
            across, index = self.layout.inter.world_size, self.layout.intra.rank
            rows = self.layout.local_major(sent.device)[index * across:(index + 1) * across]
            sent.view(n, per).index_add_(0, rows, residual.to(sent).view(across, per))

    def _hierarchical_reduce_scatter(self, b: Bucket, grad: torch.Tensor, q: Any, call: int) -> tuple:
        """Hierarchical qgZ: the host sums the bucket's gradient exactly (an all-to-all inside the
        host, in float32, in local rank order), so that local rank i holds the host's sum of the
        pieces of its cross-host group's ranks; those are encoded once (error feedback on this
        host's partial sum) and exchanged by an all-to-all across hosts, each rank decoding the
        hosts' pieces in host order in float32 and dividing by n. One host: nothing is
        encoded. Returns (work, finish)."""
        layout, n, per = self.layout, self.communicator.world_size, b.shard_numel
        across = layout.inter.world_size
        arranged = grad.view(n, per).index_select(0, layout.local_major(grad.device)).view(-1)
        partial = self.hosts.intra.sum_slices(arranged, across * per)  # float32: the host's fixed-order sums
        host_bytes = across * per * grad.element_size()
        self._count("reduce_scatter_in_host", host_bytes, host_bytes, layout.intra.world_size)
        if across == 1:
            reduced = partial.div_(n)
            return _Done(), lambda: reduced
        return self._exchange(b, partial, q, call, layout.inter, grad.element_size())

    def _exchange(self, b: Bucket, x: torch.Tensor, q: Any, call: int, group: Any, dense_elem: int) -> tuple:
        """``x`` (+ the bucket's residual) encoded by ``q`` into ``group.world_size`` pieces of the
        shard's size (block-quantized, or cast to 16 bits), piece j sent to the group's rank j by
        an all-to-all; ``finish`` sums what arrives in the group's rank order in float32 and
        divides by the whole group's size. Returns (work, finish)."""
        m, per, key = group.world_size, b.shard_numel, grad_key(b)
        residual = q.residual_for(key, x.numel(), x.device)
        if isinstance(q, Cast):  # one pass: payload = round(x + residual), residual = what it dropped
            payload = torch.empty(x.numel(), dtype=q.dtype, device=x.device)
            kernels_for(x.device).cast(x, residual, payload)
        else:
            payload = q.encode(x, residual, q.seed_for(self.communicator.rank, key, call), 0, per, m)
        received = torch.empty_like(payload)
        work = group.all_to_all(received, payload, async_op=True)
        self._count("reduce_scatter", payload.numel() * payload.element_size() // m, per * dense_elem, m)
        n = self.communicator.world_size

        def finish() -> torch.Tensor:
            acc = torch.zeros(per, dtype=torch.float32, device=x.device)
            if isinstance(q, Cast):
                for piece in received.view(m, per):  # rank order: the same sum on every rank
                    acc.add_(piece)
            else:
                q.decode_sum(received, m, acc)
            return acc.div_(n)

        return work, finish

    def _count(self, kind: str, piece_bytes: int, dense_piece_bytes: int, ranks: int = 0) -> None:
        """Adds one collective of ``piece_bytes`` per rank among ``ranks`` (default: the group's; an
        all-gather or reduce-scatter sends and receives ranks - 1 pieces) to the totals of ``kind``."""
        peers = (ranks or self.communicator.world_size) - 1
        self.wire[kind] = self.wire[kind] + WireStats(peers * piece_bytes, peers * piece_bytes,
                                                      peers * dense_piece_bytes)

    def _wait_gather(self, unit: Unit) -> None:
        if not unit.in_flight:
            return
        q = self._adaptive_in_backward()
        waited = 0.0  # a synchronized backward blocked on the link (an Adaptive leaves it out of windows)
        for b in unit.buckets:
            if b.work is not None:
                (work, keep, decode, sent), b.work = b.work, None
                timed = q is not None and sent.device.type == "cpu"  # a CUDA wait only orders the stream
                began = time.perf_counter() if timed else 0.0
                work.wait()
                if timed:
                    waited += time.perf_counter() - began
                if decode is not None:
                    decode()
                keep.__exit__(None, None, None)  # the counter as it was at the launch
        if q is not None:
            q.stalled(waited)
        unit.in_flight = False
        unit.gathered = True
        self.in_flight.remove(unit)

    def _gather(self, unit: Unit, ahead: Sequence[Unit]) -> None:
        """Makes ``unit``'s full parameters current, prefetching ``ahead`` while waiting."""
        self._launch_gather(unit)
        for other in ahead[:self.prefetch]:
            self._launch_gather(other)
        self._wait_gather(unit)

    def reshard(self, unit: Unit, keep_secondary: bool = False) -> None:
        """Frees ``unit``'s full buffers (after its all-gathers, if in flight). ``keep_secondary``
        (hpZ, after a forward): each rank first keeps its host piece of every full buffer, which
        the backward's gather then collects inside the host."""
        if unit.in_flight:
            self._wait_gather(unit)
        for b in unit.buckets:
            b.secondary = None
            if keep_secondary and unit.gathered:
                local, me = self.intra.world_size, self.intra.rank
                seg = b.padded // local
                b.secondary = b.full.detach()[me * seg:(me + 1) * seg].clone()
            free(b)
        unit.gathered = False

    def _next_units(self, unit: Optional[Unit], backward: bool) -> list:
        order = self.order if self.order_done else [u for u in self.units if u is not self.root]
        if backward:
            order = order[::-1]
        if unit is None:
            return list(order)
        try:
            i = order.index(unit)
        except ValueError:
            return []
        return order[i + 1:]

    def gather_all(self) -> None:
        """All-gathers every bucket now and points the module at the full buffers (ZeRO stages 1, 2)."""
        for unit in self.units:
            self._launch_gather(unit, force=True)
        for unit in list(self.in_flight):
            self._wait_gather(unit)
        for unit in self.units:
            set_views(unit, False)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Runs ``module`` with the root unit gathered around it (the units' hooks do the rest)."""
        if not self.order_done:
            self.order = []
        grad = torch.is_grad_enabled()
        if self.root is not None:
            self._gather(self.root, self._next_units(None, False))
            set_views(self.root, grad)
        out = module(*args, **kwargs)
        self.order_done = True
        if self.stage == 3 and self.root is not None and not grad:
            self.reshard(self.root)
        return out

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        if not self.order_done and unit not in self.order:
            self.order.append(unit)
        self._gather(unit, self._next_units(unit, False))
        set_views(unit, torch.is_grad_enabled())

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        if self.stage != 3:
            return
        if not torch.is_grad_enabled():
            self.reshard(unit)
            return
        hooked = False
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(_weakly(self._pre_backward, unit))
                hooked = True
        # The last unit's backward comes first: keeping it avoids a gather on the critical path.
        # An output with no tensor in reach (a type pytree does not know) gives no hook to gather
        # again before the backward: the parameters then stay until their gradients are done.
        last = self.order_done and self.order and self.order[-1] is unit
        if self.reshard_after_forward and hooked and not last:
            self.reshard(unit, keep_secondary=self.intra is not None)

    # -- backward ----------------------------------------------------------------------------
    def _queue_finish(self) -> None:
        if not self.finish_queued:
            self.finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._queue_finish()
        self._gather(unit, self._next_units(unit, True))

    def _before_accumulate(self, b: Bucket, grad: torch.Tensor) -> None:
        """Runs before autograd adds a gradient to the bucket's full flat tensor. A local gradient
        left there by ``no_sync()`` backwards is dropped when the shard's gradient was cleared
        since (``optimizer.zero_grad()``, with or without ``set_to_none``), as DDP's would be: it
        lives in ``param.grad`` there."""
        if b.local_guard is not None:
            kept, version = b.local_guard
            b.local_guard = None
            if b.shard.grad is not kept or kept._version != version:
                self.drop_local_grad(b)

    def drop_local_grad(self, b: Bucket) -> None:
        """Forgets the gradient ``no_sync()`` backwards left in the bucket's full tensor."""
        if b.full.grad is not None:
            if self.stage == 1:
                b.full.grad.zero_()  # the persistent buffer stays
            else:
                b.full.grad = None

    def _on_grad_ready(self, b: Bucket, full: torch.Tensor) -> None:
        """The bucket's flat gradient is complete: reduce-scatter it (async), free what can go."""
        self._queue_finish()
        if self.sync:
            # The optimizer will update the shard: gather it before the next forward even when the
            # update leaves the version counter alone (fused optimizers' kernels do).
            b.synced_version = b.uploaded_version = -1
            grad = full.grad
            if self.stage != 1:
                full.grad = None
            # Mixed precision: the gradient travels in reduce_dtype (a copy; ZeRO stage 1's persistent
            # buffer keeps accumulating in the compute dtype).
            sent = grad if grad.dtype == b.reduce_dtype else grad.to(b.reduce_dtype)
            q, key = self.grad_compression, grad_key(b)
            if q is None or sent.dtype not in QUANTIZABLE:
                work, finish = self._reduce_scatter(b, sent, None)
            elif isinstance(q, Adaptive):  # it decides, measures and keeps the residuals; this issues
                issue = functools.partial(self._reduce_scatter_with, b, sent, key)
                work, finish = q.reduce_scatter(self.communicator, sent, issue, key=key, hosts=self.hosts)
            else:
                call = q.next_call(key)
                work, finish = self._reduce_scatter(b, sent, q if call >= q.warmup_steps else None, call)
            self.pending.append((b, work, finish, grad))
            self._retire(MAX_REDUCES_IN_FLIGHT)
        if self.stage == 3 and b.unit is not self.root:
            # Every use of the bucket's parameters in this backward is done (autograd produced
            # all their gradients): its full buffer can go now, not at the end of the backward.
            # The unit counts as resharded: a later use gathers all its buckets again.
            free(b)
            b.unit.gathered = False

    def _reduce_scatter_with(self, b: Bucket, sent: torch.Tensor, key: tuple, q: Any,
                             residual: Optional[torch.Tensor]) -> tuple:
        """An Adaptive's ``issue``: the reduce-scatter with the compressor it chose (None: exact,
        with its residual), the compressor's next call of the bucket seeding the rounding."""
        work, finish = self._reduce_scatter(b, sent, q, None if q is None else q.next_call(key), residual)
        return work, finish

    def _finish_backward(self) -> None:
        """End of the backward: wait for the reduce-scatters in issue order, set the shard
        gradients, release what ZeRO stage 3 still holds."""
        self.finish_queued = False
        if self.sync and isinstance(self.grad_compression, Adaptive):
            # Every gradient is computed: the backward is over, which closes the buckets' windows.
            self.grad_compression.end_step()
        self._retire(0)
        self._drain_host()
        if self.sync and self.delay and self.optimizer is not None:
            self._delay_steps()
        if not self.sync:
            # Remember the shard gradients as they are now: if they are cleared before the next
            # backward, so is the local gradient these no_sync() backwards accumulated. A shard
            # without one gets zeros, so that a clear (set to None) can be seen.
            with torch.no_grad():
                for b in self.buckets():
                    if b.trainable and b.full.grad is not None:
                        if b.shard.grad is None:
                            b.shard.grad = torch.zeros_like(b.shard)
                        b.local_guard = (b.shard.grad, b.shard.grad._version)
        for unit in list(self.in_flight):
            self._wait_gather(unit)
        for unit in self.units:
            if self.stage == 3:
                self.reshard(unit)
            else:
                # The forward's views belong to this backward's graph: autograd forbids using
                # them once the optimizer updates the bucket in place, so plain views replace them.
                set_views(unit, False)

    def _retire(self, keep: int) -> None:
        """Completes pending reduce-scatters, oldest first: every one already done, then waits
        until at most ``keep`` remain. Each result goes into its shard's ``.grad`` (offloaded: by
        the host thread, :meth:`_to_host`)."""
        with torch.no_grad():
            while self.pending and (len(self.pending) > keep or self.pending[0][1].is_completed()):
                b, work, finish, grad = self.pending.pop(0)
                work.wait()
                reduced = finish()
                if reduced.dtype != b.shard.dtype:  # mixed precision: into the master shard's dtype
                    reduced = reduced.to(b.shard.dtype)
                if b.on_device is not None:
                    self._to_host(b, reduced)
                else:
                    self._land(b, reduced, None)
                if self.stage == 1:
                    grad.zero_()  # the persistent buffer accumulates the next step's gradient

    def _land(self, b: Bucket, reduced: torch.Tensor, ready: Any) -> None:
        """Adds the reduced gradient to the shard's ``.grad`` and, under step_in_backward, steps
        the shard: the bucket's gradient is final for this step, and the later buckets'
        reduce-scatters are in flight meanwhile. ``ready``: the CUDA event after which
        ``reduced`` (a reused pinned buffer) holds the gradient, or None."""
        if ready is not None:
            ready.synchronize()
        with torch.no_grad():
            if b.shard.grad is None:
                b.shard.grad = reduced if ready is None else reduced.clone()
            else:
                b.shard.grad += reduced
            if self.optimizer is not None and not self.delay:
                self.optimizer.step_param(b.shard, b.shard.grad)

    def _to_host(self, b: Bucket, reduced: torch.Tensor) -> None:
        """offload_optimizer: streams the reduced shard gradient to host memory (from a GPU: an
        async copy into the bucket's pinned buffer, then an event) and hands the rest of
        :meth:`_land` to the host thread, so that the backward goes on while the CPU adds and steps."""
        ready = None
        if reduced.device.type != "cpu":
            if b.grad_staging is None:
                b.grad_staging = torch.empty(b.shard_numel, dtype=b.shard.dtype, pin_memory=True)
            b.grad_staging.copy_(reduced, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(reduced.device))  # the copy's stream
            reduced = b.grad_staging
        if self.host_pool is None:
            self.host_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="braid-offload")
        self.host_jobs.append(self.host_pool.submit(self._land, b, reduced, ready))

    def _drain_host(self) -> None:
        """Waits for every host job of this backward; the first one's error is raised."""
        jobs, self.host_jobs = self.host_jobs, []
        errors = [job.exception() for job in jobs]
        for e in errors:
            if e is not None:
                raise e
