"""braid.comm: collective communication for PyTorch. A communicator's collectives run through
shared memory among the ranks of a host and over authenticated TCP between hosts (connections
opened as algorithms use them), on CPU tensors and, in builds with CUDA, on CUDA tensors staged
through pinned host memory; compressors (int8/int4/fp8 quantization, top-k, 16-bit casts, with
error feedback) shrink what crosses the wire. Importing this package registers the
torch.distributed backend "braid". The layers (ddp, zero, fsdp2, tp, cp, moe) run over a communicator
or any torch ProcessGroup through braid's group interface (core/group.py).

Arranged by layer, each importing only those below it: core/ (the communicator, its bootstrap,
the group interface and the torch.distributed backend), compression/ (compressors and adaptive
control), then one module or package per parallel layer (ddp.py, zero/, fsdp2.py, tp/, cp.py,
moe/).

    from braid import comm
    c = comm.init()                  # torchrun environment or the default process group
    c.all_reduce(t)                  # in place; op="sum" | "avg" | "max" | "min" | "prod"
    c.all_reduce(t, op="avg", compression=comm.Int8Quantizer())   # compressed (see compression/)
    comm.Adaptive()                  # the compressor chosen per tensor from the link (compression/adaptive)
"""
import torch  # noqa: F401  (the extension links against torch: load it first)

from . import _aliases
from .compression import (Adaptive, Cast, CompressedWork, Compressor, FP8Quantizer, Int4Quantizer,
                          Int8Quantizer, TopK, WireStats)
from .core import backend as _backend
from .core.communicator import Communicator, P2POp, Work, init
from .core.errors import CollectiveMismatch, CommClosed, CommError, CommTimeout, PeerError

_backend.register()  # dist.init_process_group("braid") from here on
_aliases.install()  # the module paths of before the arrangement by layer (braid.comm.communicator, ...)

# The layers a user reaches as attributes after `from braid import comm` (comm.ddp.comm_hook, ...),
# imported on first use: importing braid.comm stays quick, and none of them imports back here
# at import time. ("fsdp" is the old name of zero + fsdp2, kept.)
_PARTS = ("ddp", "zero", "fsdp2", "tp", "cp", "moe", "fsdp")


def __getattr__(name):
    import importlib

    if name in _PARTS:
        module = importlib.import_module(f"{__name__}.{name}")
    else:
        module = _aliases.resolve(name)  # an old module name: comm.communicator, comm.adaptive, ...
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = module
    return module


def __dir__():
    return sorted(set(globals()) | set(_PARTS))

__all__ = ["Communicator", "P2POp", "Work", "init", "CommError", "CommTimeout", "PeerError",
           "CollectiveMismatch", "CommClosed", "Compressor", "Int8Quantizer", "Int4Quantizer", "FP8Quantizer",
           "TopK", "Cast", "WireStats", "CompressedWork", "Adaptive"]
