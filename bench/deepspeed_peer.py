"""DeepSpeed peer of the collectives benchmark: DeepSpeed's CPU shared-memory all_reduce.

DeepSpeed ships a shared-memory all_reduce for CPU inference (``deepspeed.comm.inference_all_reduce``,
built from its ``ShareMemCommBuilder`` op with ninja on first use), the strongest CPU all_reduce
of the common libraries that we know of: the peer to beat beside gloo and Open MPI. It runs in
the benchmark's own ranks, its timed batches alternating with braid's and gloo's, on the same
buffers and protocol.

Only what the op implements is measured: all_reduce with sum, float32 (its kernels need AVX2),
bfloat16 and float16 (AVX-512BW), every rank on one host. The op is called directly
(``torch.ops.deepspeed.inference_all_reduce_``), never through ``deepspeed.comm``, which falls
back to torch.distributed silently where the op does not apply: a fallback would be reported as
DeepSpeed. DeepSpeed leaves its segments in /dev/shm; each rank unlinks its own once every rank
has mapped them.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from . import launch

OPS = ("all_reduce",)
DTYPES = ("float32", "bfloat16", "float16")
# DeepSpeed's vector_kernel_level(): 1 = AVX2 (float32 kernels), 2 = AVX-512BW (half types too).
_LEVEL_NEEDED = {"float32": 1, "bfloat16": 2, "float16": 2}
_SEGMENT_PREFIX = "deepspeed_allreduce_buffer"


def unavailable(dtype: str) -> str | None:
    """Why the peer cannot run here for ``dtype``, or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (`make bench-peers` installs it)"
    if dtype not in DTYPES:
        return f"DeepSpeed's shared-memory all_reduce has no {dtype} kernel"
    return None


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 goes to 2 meanwhile: the op's build (ninja, compiler) and DeepSpeed's
    prints must not mix with the tables on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _agreed(error: str | None) -> None:
    """Raises RuntimeError on every rank when any rank had ``error`` (its own reason, or a
    pointer to the failing rank's), so that no rank goes on to wait for the others in
    DeepSpeed's own handshake, which has no deadline."""
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise RuntimeError(error or "it failed on another rank (see that rank's message)")


def _load(rank: int):
    """The op's module, built once (rank 0 first: concurrent ninja builds of one directory collide)."""
    def load():
        with _stdout_to_stderr():
            from deepspeed.accelerator import get_accelerator

            builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
            if builder is None:
                raise RuntimeError("this DeepSpeed has no ShareMemCommBuilder op for the CPU")
            return builder.load(verbose=False)

    module, error = None, None
    for turn in (0, 1):
        if (rank == 0) == (turn == 0):
            try:
                module = load()
            except Exception as e:  # noqa: BLE001 -- a broken install or build: report, skip the peer
                error = f"loading DeepSpeed's shared-memory op failed: {type(e).__name__}: {e}"
        _agreed(error)
    return module


def shm_all_reduce(rank: int, world_size: int, local_world_size: int, dtype: str, run_id: str
                   ) -> Callable[[torch.Tensor], object]:
    """Builds (first use) and initializes DeepSpeed's shared-memory all_reduce on every rank of
    the default (gloo) process group; returns the in-place sum. ``run_id`` names this run's
    segments (DeepSpeed derives them from MASTER_ADDR and MASTER_PORT). Raises RuntimeError with
    the reason on every rank when the op cannot reduce ``dtype`` here."""
    if local_world_size != world_size:
        raise RuntimeError("DeepSpeed's shared-memory all_reduce needs every rank on one host")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # its CUDA accelerator has no such op
    module = _load(rank)
    error = None
    if module.vector_kernel_level() < _LEVEL_NEEDED[dtype]:
        need = "AVX2" if _LEVEL_NEEDED[dtype] == 1 else "AVX-512BW"
        error = f"DeepSpeed's {dtype} all_reduce kernel needs {need}, which this CPU lacks"
    _agreed(error)
    names = {"LOCAL_SIZE": str(world_size), "MASTER_ADDR": "braid-bench", "MASTER_PORT": run_id}
    with launch.scoped_environ(names):
        module.initialize(world_size, rank)
    dist.barrier()  # every rank has mapped every segment: the names can go
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{_SEGMENT_PREFIX}_{os.getuid()}_braid-bench_{run_id}_{rank}")
    return torch.ops.deepspeed.inference_all_reduce_
