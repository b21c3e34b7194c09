"""braid.comm: collective communication for PyTorch (shared-memory CPU collectives).

    from braid import comm
    c = comm.init()                  # torchrun environment or the default process group
    c.all_reduce(t)                  # in place; op="sum" | "avg" | "max" | "min" | "prod"
    c.all_reduce(t, op="avg", compression=comm.Int8Quantizer())   # compressed (see compression.py)
"""
import torch  # noqa: F401  (the extension links against torch: load it first)

from . import backend as _backend
from .communicator import Communicator, P2POp, Work, init
from .compression import Cast, CompressedWork, Compressor, Int4Quantizer, Int8Quantizer, TopK, WireStats
from .errors import CollectiveMismatch, CommClosed, CommError, CommTimeout, PeerError

_backend.register()  # dist.init_process_group("braid") from here on

__all__ = ["Communicator", "P2POp", "Work", "init", "CommError", "CommTimeout", "PeerError",
           "CollectiveMismatch", "CommClosed", "Compressor", "Int8Quantizer", "Int4Quantizer", "TopK",
           "Cast", "WireStats", "CompressedWork"]
