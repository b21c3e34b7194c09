"""braid.kernels: compute kernels (the Triton fused attention lives here)."""
from .attention import flash_attention, scaled_dot_product_attention

__all__ = ["flash_attention", "scaled_dot_product_attention"]
