"""What this build of braid's extension (``braid.comm._C``) carries: whether it has the CUDA path."""
from __future__ import annotations

import braid.comm._C as _C  # the extension module itself (not the package)


def is_cuda_build() -> bool:
    """Whether braid was built with CUDA (torch had CUDA and nvcc was found at build time). The
    CUDA kernels, the staging of CUDA tensors through pinned host memory and the c10d backend's
    CUDA side are built together, so this one answer covers them all."""
    return bool(_C.has_cuda_kernels)
