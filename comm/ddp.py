"""DDP communication hook: gradient buckets reduced by braid, exactly or compressed, while
backward keeps running.

    state, hook = braid.comm.ddp.comm_hook(c, compression=comm.Int8Quantizer())
    model.register_comm_hook(state, hook)

The hook issues an async braid all-reduce per bucket and returns the torch future that braid's
progress thread completes; the averaged (decompressed) gradients land in place in
``bucket.buffer()``, so ``gradient_as_bucket_view=True`` works as is.
"""

import os
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .communicator import Communicator
from .compression import FLOAT_DTYPES, Compressor

# Buckets smaller than this go uncompressed: their all-reduce costs its latency, not its bytes,
# and compression would add two kernel passes and a second collective for nothing.
DEFAULT_MIN_COMPRESS_BYTES = 64 * 1024


def _min_bytes_from_env() -> int:
    """BRAID_COMPRESS_MIN_BYTES: a byte count, optionally with a K, M or G suffix (as the other
    BRAID_* sizes)."""
    raw = os.environ.get("BRAID_COMPRESS_MIN_BYTES")
    if raw is None or raw == "":
        return DEFAULT_MIN_COMPRESS_BYTES
    shift = {"K": 10, "M": 20, "G": 30}.get(raw[-1].upper(), 0)
    digits = raw[:-1] if shift else raw
    if not digits.isdigit():
        raise ValueError("BRAID_COMPRESS_MIN_BYTES must be a non-negative integer number of bytes, "
                         f"optionally with a K, M or G suffix; got {raw!r}")
    return int(digits) << shift


class CommHookState:
    """State of the braid DDP hook: the communicator, the compressor (with its residuals) and the
    number of synchronized steps seen.

    Pickling and ``state_dict()`` keep the compressor state and the step but not the
    communicator: after loading, set ``state.communicator`` before the next backward.

    The compressor's warm-up counts the steps this state has run since it was built or loaded
    (``steps_here``), not the restored ``step``: a DDP built to resume from a checkpoint lays out
    its first step's buckets in another order than the one the residuals were kept for, and
    rebuilds them after that step, as the original run did. So the first ``warmup_steps`` steps
    after loading are exact again, and compression resumes on the bucket layout whose residuals
    were saved.
    """

    def __init__(
        self, communicator: Optional[Communicator], compression: Optional[Compressor], min_compress_bytes: int
    ):
        self.communicator = communicator
        self.compression = compression
        self.min_compress_bytes = min_compress_bytes
        self.step = 0
        self.steps_here = 0

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "min_compress_bytes": self.min_compress_bytes,
            "compression": None if self.compression is None else self.compression.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["compression"] is None) != (self.compression is None):
            raise ValueError("state and hook disagree on whether gradients are compressed")
        self.step = int(state["step"])
        self.steps_here = 0
        self.min_compress_bytes = int(state["min_compress_bytes"])
        if self.compression is not None:
            self.compression.load_state_dict(state["compression"])

    def __getstate__(self) -> dict:
        return {
            "compression": self.compression,
            "min_compress_bytes": self.min_compress_bytes,
            "step": self.step,
        }

    def __setstate__(self, state: dict) -> None:
        self.communicator = None
        self.compression = state["compression"]
        self.min_compress_bytes = state["min_compress_bytes"]
        self.step = state["step"]
        self.steps_here = 0


def _bucket_tensor(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


# Annotations are real objects here (no `from __future__ import annotations`): DDP compares the
# hook's annotations with dist.GradBucket and Future[Tensor] and rejects strings.
def braid_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages ``bucket.buffer()`` over the ranks in place with braid; compressed when the state
    has a compressor, the bucket holds floats, is at least ``min_compress_bytes`` and the warm-up
    is over. Returns a future of the bucket's tensor."""
    c = state.communicator
    if c is None:
        raise RuntimeError(
            "the braid comm hook state has no communicator (set state.communicator after "
            "loading a checkpoint)"
        )
    buf = bucket.buffer()
    steps_here = state.steps_here
    if bucket.is_last():
        state.step += 1
        state.steps_here += 1
    comp = state.compression
    small = buf.numel() * buf.element_size() < state.min_compress_bytes
    if comp is None or small or buf.dtype not in FLOAT_DTYPES:
        work = c.all_reduce(buf, op="avg", async_op=True)
    else:
        work = comp.all_reduce(c, buf, "avg", key=bucket.index(), async_op=True, step=steps_here)
    return work.get_future().then(_bucket_tensor)


def comm_hook(
    communicator: Communicator,
    compression: Optional[Compressor] = None,
    *,
    min_compress_bytes: Optional[int] = None,
) -> Tuple[CommHookState, Callable[..., Any]]:
    """Returns ``(state, hook)`` for ``model.register_comm_hook(state, hook)``.

    Args:
        communicator: the braid communicator of the DDP ranks (same ranks, same order).
        compression: None for the exact average, or a compressor (``Int8Quantizer()``,
            ``Int4Quantizer()``, ``TopK(0.01)``, ``Cast(torch.bfloat16)``); its warm-up counts
            DDP steps, so the first ``warmup_steps`` steps (and the bucket rebuild after step 1)
            are exact, and so are the first ones after loading a checkpoint into the state.
        min_compress_bytes: buckets smaller than this are reduced exactly (default
            ``BRAID_COMPRESS_MIN_BYTES`` or 64 KiB).
    """
    if not isinstance(communicator, Communicator):
        raise TypeError(f"communicator must be a braid.comm.Communicator, got {type(communicator).__name__}")
    if compression is not None and not isinstance(compression, Compressor):
        raise TypeError(
            f"compression must be a braid.comm compressor or None, got {type(compression).__name__}"
        )
    if min_compress_bytes is None:
        min_compress_bytes = _min_bytes_from_env()
    elif (
        isinstance(min_compress_bytes, bool)
        or not isinstance(min_compress_bytes, int)
        or min_compress_bytes < 0
    ):
        raise ValueError(f"min_compress_bytes must be an int >= 0, got {min_compress_bytes!r}")
    return CommHookState(communicator, compression, min_compress_bytes), braid_hook
