"""A communicator's CUDA staging pipelines, one per GPU (pinned host buffers and two copy streams
through which CUDA tensors travel to and from the host collectives), each set up at its device's
first use; the Python face of csrc/binding/cuda_stager.h's CudaStagers."""
from __future__ import annotations

from typing import Optional

import torch

from . import _C
from .build_info import is_cuda_build


class CudaStagers:
    """The staging pipeline of each CUDA device a communicator has met. ``chunk_bytes`` (bytes per
    chunk part) and ``slots`` (chunks in flight) override ``BRAID_STAGING_CHUNK_BYTES`` and
    ``BRAID_STAGING_SLOTS`` where not None; every rank must use the same."""

    def __init__(self, chunk_bytes: Optional[int] = None, slots: Optional[int] = None):
        for name, value in (("staging_chunk_bytes", chunk_bytes), ("staging_slots", slots)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        self._chunk_bytes = chunk_bytes
        self._slots = slots
        self._by_index: dict = {}

    def get(self, device: torch.device, arg: str):
        """The pipeline of CUDA ``device``, set up at its first use; a ValueError naming ``arg`` for
        a device braid cannot stage from."""
        if not is_cuda_build():
            raise ValueError(f"{arg} is on {device}, but this braid build takes CPU tensors only (it was "
                             "built where torch had no CUDA or nvcc was not found): reinstall braid on a "
                             "machine with both, or move the tensor to the CPU")
        if device.type != "cuda":
            raise ValueError(f"{arg} must be a CPU or CUDA tensor, got a tensor on {device}")
        index = torch.cuda.current_device() if device.index is None else device.index
        stager = self._by_index.get(index)
        if stager is None:
            env_chunk, env_slots = _C.staging_options_from_env()
            stager = _C.CudaStager(index, env_chunk if self._chunk_bytes is None else self._chunk_bytes,
                                   env_slots if self._slots is None else self._slots)
            self._by_index[index] = stager
        return stager

    def of(self, output: torch.Tensor, input: torch.Tensor):
        """The pipeline of the device of an out-of-place call (the output's, else the input's); the
        binding then requires the other tensor on the same device."""
        if isinstance(output, torch.Tensor) and not output.is_cpu:
            return self.get(output.device, "output")
        return self.get(input.device, "input")
