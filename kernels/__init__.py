"""braid.kernels: compute kernels (the Triton fused attention lives here)."""
