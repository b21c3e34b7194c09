"""braid.kernels: compute kernels (the Triton fused attention lives here)."""
from .attention import flash_attention, scaled_dot_product_attention
from .attention_varlen import flash_attention_varlen

__all__ = ["flash_attention", "flash_attention_varlen", "scaled_dot_product_attention"]
