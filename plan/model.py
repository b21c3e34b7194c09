"""The model a layout is planned for: a decoder-only transformer described by its shape.

``TransformerShape`` holds the sizes the planner's formulas need (layers, widths, heads, vocabulary,
experts, sequence length, global batch, dtype, optimizer) and counts parameters and FLOPs from them.
``profile_module`` counts the parameters of a real ``nn.Module`` (and, on the meta device, the bytes
its forward saves for the backward); ``TransformerShape.from_module`` puts that count into a shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}
OPTIMIZERS = ("adam", "sgd")
_OPTIMIZER_ALIASES = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}


def _positive_int(value: Any, name: str, zero_ok: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be {'>= 0' if zero_ok else 'a positive int'}, got {value}")
    return value


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer and its training batch.

    Args:
        layers: transformer blocks.
        hidden: model width h.
        heads: query heads a.
        kv_heads: key/value heads (grouped-query attention); default ``heads``.
        ffn: MLP inner width f (of one expert for MoE); default 4 * hidden.
        vocab: vocabulary size V.
        seq: training sequence length s, in tokens.
        batch: global batch, in sequences (one optimizer step).
        experts: experts per MoE layer; 0 for a dense model (every block is MoE otherwise).
        top_k: experts each token goes to (MoE only).
        dtype: "bf16" (16-bit weights and activations, float32 master weights when the optimizer
            keeps state) or "fp32".
        optimizer: "adam" (two float32 moments) or "sgd" (one float32 momentum buffer).
        gated: SwiGLU-style MLP with three matrices (gate, up, down); False: two (up, down).
        tie_embeddings: the output projection shares the input embedding's weights.
        flash_attention: attention that never stores the s x s score matrix (FlashAttention and
            braid's ring attention); False adds the scores to the activation estimate.
        dropout: dropout layers keep one-byte masks for the backward.
        head_dim: width of one head; default hidden / heads.
        params: a measured parameter count (``profile_module``): every parameter part the formulas
            give is scaled by params / formula count.
        name: a label for the output.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    kv_heads: Optional[int] = None
    ffn: Optional[int] = None
    experts: int = 0
    top_k: int = 2
    dtype: str = "bf16"
    optimizer: str = "adam"
    gated: bool = True
    tie_embeddings: bool = False
    flash_attention: bool = True
    dropout: bool = False
    head_dim: Optional[int] = None
    params: Optional[int] = None
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq", "batch"):
            _positive_int(getattr(self, name), name)
        _positive_int(self.experts, "experts", zero_ok=True)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _positive_int(self.kv_heads, "kv_heads")
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        _positive_int(self.ffn, "ffn")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(
                    f"heads={self.heads} does not divide hidden={self.hidden} "
                    "(give head_dim to use another head width)"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _positive_int(self.head_dim, "head_dim")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} does not divide heads={self.heads}")
        if self.experts:
            _positive_int(self.top_k, "top_k")
            if self.top_k > self.experts:
                raise ValueError(f"top_k={self.top_k} is larger than experts={self.experts}")
        dtype = _DTYPE_ALIASES.get(str(self.dtype).lower()) if isinstance(self.dtype, str) else None
        if dtype is None:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        optimizer = (
            _OPTIMIZER_ALIASES.get(str(self.optimizer).lower()) if isinstance(self.optimizer, str) else None
        )
        if optimizer is None:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        object.__setattr__(self, "optimizer", optimizer)
        for name in ("gated", "tie_embeddings", "flash_attention", "dropout"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.params is not None:
            _positive_int(self.params, "params")
        object.__setattr__(self, "_memo", {})  # derived numbers, computed once (not a field)

    def _cached(self, key: str, compute: Any) -> Any:
        memo = self.__dict__["_memo"]
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together (kv_heads x head_dim)."""
        return self.kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one weight, gradient or activation value (2 for bf16, 4 for fp32)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step: batch x seq."""
        return self.batch * self.seq

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP (3 gated, 2 plain)."""
        return 3 if self.gated else 2

    def attention_params(self) -> int:
        """Parameters of one attention block: q and o (h x a d), k and v (h x kv d each)."""
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim

    def mlp_params(self) -> int:
        """Parameters of one MLP (one expert of an MoE layer): 3 h f gated, 2 h f plain."""
        return self.mlp_matrices * self.hidden * self.ffn

    def formula_params(self) -> Dict[str, int]:
        """Parameter counts by part, from the shape alone: ``embedding`` (V h), ``head`` (V h, 0 when
        tied), ``final_norm`` (h), ``layer_dense`` (per layer: attention, two norms (2 h), the router
        (h E) for MoE, the MLP for a dense model) and ``layer_experts`` (per layer: E MLPs)."""
        dense = self.attention_params() + 2 * self.hidden
        if self.moe:
            dense += self.hidden * self.experts
            experts = self.experts * self.mlp_params()
        else:
            dense += self.mlp_params()
            experts = 0
        return {
            "embedding": self.vocab * self.hidden,
            "head": 0 if self.tie_embeddings else self.vocab * self.hidden,
            "final_norm": self.hidden,
            "layer_dense": dense,
            "layer_experts": experts,
        }

    @property
    def param_scale(self) -> float:
        """params / formula count when a measured count was given, else 1."""
        if self.params is None:
            return 1.0
        return self._cached("scale", lambda: self.params / self._formula_total())

    def _formula_total(self) -> int:
        p = self.formula_params()
        return (
            p["embedding"]
            + p["head"]
            + p["final_norm"]
            + self.layers * (p["layer_dense"] + p["layer_experts"])
        )

    def param_count(self) -> int:
        """Total parameters (the measured count when one was given)."""
        if self.params is not None:
            return self.params
        return self._formula_total()

    def active_param_count(self) -> int:
        """Parameters one token goes through: all of a dense model; for MoE the experts' part
        counts top_k of the E experts."""
        p = self.formula_params()
        experts = p["layer_experts"] * self.top_k // self.experts if self.moe else 0
        total = p["embedding"] + p["head"] + p["final_norm"] + self.layers * (p["layer_dense"] + experts)
        return int(round(total * self.param_scale))

    # -- FLOPs ---------------------------------------------------------------------------------
    def layer_matmul_params(self) -> float:
        """Matrix parameters one token multiplies in one block: attention, then the MLP (top_k expert
        MLPs and the router for MoE); norms are left out."""

        def compute() -> float:
            mlp = (
                self.mlp_params() * self.top_k + self.hidden * self.experts if self.moe else self.mlp_params()
            )
            return (self.attention_params() + mlp) * self.param_scale

        return self._cached("layer_matmul", compute)

    def head_matmul_params(self) -> float:
        """Parameters of the output projection (V h, counted even when tied)."""
        return self.vocab * self.hidden * self.param_scale

    def layer_forward_flops(self) -> float:
        """Forward FLOPs of one block for one sequence: 2 N_layer s (matmuls) + 4 s^2 (a d) (scores
        Q K^T and their product with V, the whole s x s square, as Megatron and PaLM count)."""
        return self._cached(
            "layer_fwd",
            lambda: 2 * self.layer_matmul_params() * self.seq + 4 * self.seq * self.seq * self.q_dim,
        )

    def head_forward_flops(self) -> float:
        """Forward FLOPs of the output projection for one sequence: 2 V h s (V the vocabulary)."""
        return 2 * self.head_matmul_params() * self.seq

    def model_flops(self) -> float:
        """Model FLOPs of one optimizer step (no recomputation): 3 x forward (backward = 2 forward)
        over the global batch = 6 N_active T + 12 L s^2 (a d) B, with N_active the matrix
        parameters a token multiplies (blocks and output head, not the embedding lookup) and
        T = B s tokens."""
        return self._cached(
            "model_flops",
            lambda: 3 * self.batch * (self.layers * self.layer_forward_flops() + self.head_forward_flops()),
        )

    # -- construction --------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "TransformerShape":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        """The fields and the derived counts, JSON-ready."""
        d = dataclasses.asdict(self)
        d["param_count"] = self.param_count()
        d["active_param_count"] = self.active_param_count()
        d["model_flops_per_step"] = self.model_flops()
        return d

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "TransformerShape":
        """A named shape (``MODEL_PRESETS``), with fields replaced by ``overrides``."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}")
        fields = dict(MODEL_PRESETS[name])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        fields.setdefault("name", name)
        return cls(**fields)

    @classmethod
    def from_module(cls, module: Any, **shape: Any) -> "TransformerShape":
        """A shape whose parameter count is ``module``'s (``profile_module``); the other fields come
        from ``shape`` (layers, hidden, heads, vocab, seq, batch, ...), which the planner still
        needs for activations, FLOPs and communication."""
        shape["params"] = profile_module(module).parameters
        return cls(**shape)


# Shapes from the models' published configurations. seq and batch are training settings: Llama 3
# 405B's final pre-training batch was 16M tokens of 8K sequences (arXiv 2407.21783); the other
# presets' batches are defaults of this planner (4M tokens), to be set with batch=/--batch.
MODEL_PRESETS: Dict[str, Dict[str, Any]] = {
    "llama3-8b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192, batch=512
    ),
    "llama3-70b": dict(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192, batch=512
    ),
    "llama3-405b": dict(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, seq=8192, batch=2048
    ),
    "mixtral-8x7b": dict(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        vocab=32000,
        experts=8,
        top_k=2,
        seq=4096,
        batch=1024,
    ),
    # Qwen3-30B-A3B (its published configuration: 128 experts of width 768, top 8, heads of 128
    # wider than hidden / heads); seq and batch as NeMo AutoModel's H100 benchmark trains it.
    "qwen3-30b-a3b": dict(
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        ffn=768,
        vocab=151936,
        experts=128,
        top_k=8,
        seq=4096,
        batch=512,
    ),
    # GPT-3 175B as Megatron-LM's scaling runs give it (vocab 131072, seq 4096, GeLU MLP of 4 h).
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, vocab=131072, seq=4096, batch=1152, gated=False),
}


@dataclass(frozen=True)
class ModuleProfile:
    """What ``profile_module`` measured: parameter counts and bytes, and the bytes the forward
    saved for the backward (None when no inputs were given)."""

    parameters: int
    trainable: int
    parameter_bytes: int
    activation_bytes: Optional[int] = None
    saved_tensors: int = 0
    by_dtype: Dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """The fields, JSON-ready."""
        return dataclasses.asdict(self)


def profile_module(module: Any, *inputs: Any, **kwargs: Any) -> ModuleProfile:
    """Counts ``module``'s parameters; with ``inputs``, also runs its forward on the meta device and
    adds up the bytes of the tensors autograd saves for the backward (parameters and their views
    left out, each tensor counted once).

    The module must then be on the meta device (build it under ``with torch.device("meta"):``) so
    nothing is allocated; tensor inputs are replaced by meta tensors of the same shape and dtype.
    Works for any module; the planner itself uses only the parameter count."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    params = list(module.parameters())
    by_dtype: Dict[str, int] = {}
    for p in params:
        by_dtype[str(p.dtype).replace("torch.", "")] = (
            by_dtype.get(str(p.dtype).replace("torch.", ""), 0) + p.numel()
        )
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    if not inputs and not kwargs:
        return ModuleProfile(total, trainable, nbytes, None, 0, by_dtype)
    off_meta = [n for n, p in module.named_parameters() if p.device.type != "meta"]
    if off_meta:
        raise ValueError(
            f"module: parameter {off_meta[0]!r} is on {module.get_parameter(off_meta[0]).device}, "
            "not the meta device; build the module under `with torch.device('meta'):` "
            "to measure activations"
        )

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty(x.shape, dtype=x.dtype, device="meta", requires_grad=x.requires_grad)
        return x

    param_ids = {id(p) for p in params}
    seen: set = set()
    saved = [0, 0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) in param_ids or id(base) in param_ids or id(base) in seen:
            return t
        seen.add(id(base))
        saved[0] += base.numel() * base.element_size()
        saved[1] += 1
        return t

    keep = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        keep.append(module(*[meta(x) for x in inputs], **{k: meta(v) for k, v in kwargs.items()}))
    return ModuleProfile(total, trainable, nbytes, saved[0], saved[1], by_dtype)
