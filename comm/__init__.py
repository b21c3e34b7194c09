"""braid.comm: collective communication for PyTorch. A communicator's collectives run through
shared memory among the ranks of a host and over authenticated TCP between hosts (connections
opened as algorithms use them), on CPU tensors and, in builds with CUDA, on CUDA tensors staged
through pinned host memory; compressors (int8/int4/fp8 quantization, top-k, 16-bit casts, with
error feedback) shrink what crosses the wire. Importing this package registers the
torch.distributed backend "braid". The layers (ddp, fsdp, tp, cp, moe) run over a communicator or
any torch ProcessGroup through braid's group interface (comm/group.py).

    from braid import comm
    c = comm.init()                  # torchrun environment or the default process group
    c.all_reduce(t)                  # in place; op="sum" | "avg" | "max" | "min" | "prod"
    c.all_reduce(t, op="avg", compression=comm.Int8Quantizer())   # compressed (see compression.py)
    comm.Adaptive()                  # the compressor chosen per tensor from the link (adaptive.py)
"""
import torch  # noqa: F401  (the extension links against torch: load it first)

from . import backend as _backend
from .adaptive import Adaptive
from .communicator import Communicator, P2POp, Work, init
from .compression import (Cast, CompressedWork, Compressor, FP8Quantizer, Int4Quantizer, Int8Quantizer, TopK,
                          WireStats)
from .errors import CollectiveMismatch, CommClosed, CommError, CommTimeout, PeerError

_backend.register()  # dist.init_process_group("braid") from here on

# The parts a user reaches as attributes after `from braid import comm` (comm.ddp.comm_hook, ...),
# imported on first use: importing braid.comm stays quick, and none of them imports back here
# at import time.
_PARTS = ("ddp", "fsdp", "tp", "cp", "moe")


def __getattr__(name):
    if name in _PARTS:
        import importlib

        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PARTS))

__all__ = ["Communicator", "P2POp", "Work", "init", "CommError", "CommTimeout", "PeerError",
           "CollectiveMismatch", "CommClosed", "Compressor", "Int8Quantizer", "Int4Quantizer", "FP8Quantizer",
           "TopK", "Cast", "WireStats", "CompressedWork", "Adaptive"]
