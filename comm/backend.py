"""braid as a torch.distributed backend: ``dist.init_process_group("braid")`` runs c10d on braid.

Importing ``braid.comm`` registers the backend name ``"braid"`` for CPU tensors. The object torch
gets is a C++ ``c10d::Backend`` subclass (``torch.distributed._Backend`` from Python, so
DeviceMesh and DTensor accept it) that owns a braid :class:`~braid.comm.Communicator` built from
the store, rank, size and timeout torch hands over; every sub-group (``dist.new_group``) gets its
own. Ops braid does not implement (``recv`` from any source) raise "Backend braid does not
support <op>"; variants it cannot serve (bitwise ops or PREMUL_SUM on the wrong dtype,
unsupported dtypes) raise naming what is missing. ``PREMUL_SUM(f)`` (what FSDP2 sends for a
gradient divide factor other than the world size) multiplies a copy of each rank's input by ``f``
and sums it.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from . import _C
from .communicator import Communicator

BACKEND_NAME = "braid"


def _create_backend(options, backend_options=None):
    """torch.distributed's factory hook (extended API): ``options`` carries store, group rank,
    group size and timeout."""
    timeout = options.timeout if isinstance(options.timeout, timedelta) else timedelta(seconds=300)
    # torch gives every group (and device) its own prefixed store, so a fixed prefix is unique.
    c = Communicator(options.store, options.group_rank, options.group_size, timeout=timeout,
                     prefix="braid-backend/")
    return _C.Backend(c._release_core())


def register() -> None:
    """Registers the ``"braid"`` backend with torch.distributed (done when braid.comm is imported;
    repeated calls do nothing)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])
