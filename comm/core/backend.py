"""braid as a torch.distributed backend: ``dist.init_process_group("braid")`` runs c10d on braid.

Importing ``braid.comm`` registers the backend name ``"braid"`` for CPU tensors, and for CUDA
tensors too when braid is built with CUDA: ``"braid"`` (or ``"cpu:braid,cuda:braid"``) then runs
both on braid, CUDA calls staged through pinned host memory and ordered on the caller's stream,
while ``"cpu:braid,cuda:nccl"`` keeps NCCL for CUDA tensors. The object torch
gets is a C++ ``c10d::Backend`` subclass (``torch.distributed._Backend`` from Python, so
DeviceMesh and DTensor accept it) that owns a braid :class:`~braid.comm.Communicator` built from
the store, rank, size and timeout torch hands over; every sub-group (``dist.new_group``) gets its
own. Variants it cannot serve (bitwise ops or PREMUL_SUM on the wrong dtype,
unsupported dtypes) raise naming what is missing. ``PREMUL_SUM(f)`` (what FSDP2 sends for a
gradient divide factor other than the world size) multiplies a copy of each rank's input by ``f``
and sums it.
"""
from __future__ import annotations

import sys
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist

import braid.comm._C as _C  # the extension module itself (not the package)
from .build_info import is_cuda_build
from .communicator import Communicator

BACKEND_NAME = "braid"


def backend_devices(cuda_build: Optional[bool] = None) -> List[str]:
    """The device types braid serves as a torch.distributed backend: the CPU, and CUDA in a build
    with braid's CUDA path (``cuda_build``; None: this build's, :func:`is_cuda_build`)."""
    return ["cpu", "cuda"] if (is_cuda_build() if cuda_build is None else cuda_build) else ["cpu"]


def _check_served_devices(device_backends: dict, cuda_build: bool) -> None:
    """Refuses a group whose device map gives braid a device type it does not serve in this build
    (``"cuda:braid"`` in a build without CUDA), before any rank joins it."""
    served = backend_devices(cuda_build)
    for device, backend in device_backends.items():
        if str(backend) != BACKEND_NAME or device in served:
            continue
        if device == "cuda":
            raise ValueError("backend 'cuda:braid' needs braid built with CUDA (this build takes CPU tensors "
                             "only); use 'cpu:braid,cuda:nccl' to run CUDA tensors on NCCL")
        raise ValueError(f"backend '{device}:braid': braid serves {' and '.join(served)} tensors, "
                         f"not {device}")


def _device_backends() -> Optional[dict]:
    """The device -> backend map of the group torch is creating, from the frame of the torch
    function that calls the factory (``_new_process_group_helper``'s ``backend_config``); None
    where it cannot be found (another torch, another caller)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper":
            config = frame.f_locals.get("backend_config")
            getter = getattr(config, "get_device_backend_map", None)
            return dict(getter()) if getter is not None else None
        frame = frame.f_back
    return None


def _create_backend(options, backend_options=None):
    """torch.distributed's factory hook (extended API): ``options`` carries store, group rank,
    group size and timeout.

    A group that runs on braid alone gets a whole process group that names itself "braid"
    (torch would call it "custom", which DDP's logging reports), with braid's backend registered
    for each device type of the group (torch asks the factory once, for the first device, and
    uses a process group returned here for every device). A group that pairs braid with another
    backend (``"cpu:braid,cuda:nccl"``) gets braid's backend alone, which torch registers for the
    device it asked for."""
    devices = _device_backends()
    if devices:
        _check_served_devices(devices, is_cuda_build())
    timeout = options.timeout if isinstance(options.timeout, timedelta) else timedelta(seconds=300)
    # torch gives every group (and device) its own prefixed store, so a fixed prefix is unique.
    c = Communicator(options.store, options.group_rank, options.group_size, timeout=timeout,
                     prefix="braid-backend/")
    backend = _C.Backend(c._release_core())
    if devices and all(str(b) == BACKEND_NAME for b in devices.values()):
        return _C.ProcessGroup(options.store, backend, list(devices))
    return backend


def register() -> None:
    """Registers the ``"braid"`` backend with torch.distributed for :func:`backend_devices` (done
    when braid.comm is imported; repeated calls do nothing)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=backend_devices())
