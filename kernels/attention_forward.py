"""Forward pass of the fused attention: one Triton program per (query tile, batch x head)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_configs as cfg

LOG2E = 1.4426950408889634  # log2(e): scores are kept in base 2 so that exp2 can be used
LN2 = 0.6931471805599453  # back from base 2 to the natural-log LSE callers see


@triton.jit
def key_range(start_m, seq_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys a tile of queries starting at row start_m reads: [0, hi_full) in whole unmasked tiles,
    then [hi_full, hi) through the masked loop. Causal is aligned top-left as in torch: row i sees
    keys 0..i, so keys below start_m + 1 are seen by every row of the tile; the rest, up to the
    last key any row sees, and the ragged end of the keys need the mask."""
    if CAUSAL:
        hi_full = tl.minimum(seq_k, start_m + 1)
        hi = tl.minimum(seq_k, start_m + BLOCK_M)
    else:
        hi_full = seq_k
        hi = seq_k
    return (hi_full // BLOCK_N) * BLOCK_N, hi


@triton.jit
def _forward_tiles(acc, l_i, m_i, q, k_src, v_src, kv_b, kv_h, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, d_ok, seq_k, qk_scale, lo, hi,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Folds the key tiles [lo, hi) into the running softmax state (acc, l_i, m_i) of one query
    tile. MASKED tiles may hold keys past seq_k or, when CAUSAL, keys after some of the rows;
    the others are whole and visible to every row, so they skip the element-wise mask.
    k_src and v_src are the (batch, kv head) base pointers, or with USE_TMA the tensor descriptors
    of the whole k and v, read at (kv_b, kv_h)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k_t = tl.trans(k_src.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D))
        elif MASKED:
            k_t = tl.load(k_src + offs_d[:, None] * stride_kd + cols[None, :] * stride_kn,
                          mask=d_ok[:, None] & (cols[None, :] < seq_k), other=0.0)
        else:
            k_t = tl.load(k_src + offs_d[:, None] * stride_kd + cols[None, :] * stride_kn, mask=d_ok[:, None],
                          other=0.0)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            visible = cols[None, :] < seq_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        # Online softmax: raise the running max, rescale what was accumulated under the old one.
        # Every row sees key 0 in its first tile, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # V is loaded only now: loaded with K, it would hold registers through the softmax.
        if USE_TMA:
            v = v_src.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        elif MASKED:
            v = tl.load(v_src + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=(cols[:, None] < seq_k) & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_src + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=d_ok[None, :],
                        other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_forward_kernel(
        Q, K, V, Out, LSE,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        num_heads, group, seq_q, seq_k, qk_scale,
        BUCKET_Q, BUCKET_K,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """O = softmax(Q K^T * scale) V for one BLOCK_M tile of queries of one (batch, head), and
    LSE = the base-2 logsumexp of each row's scaled scores (m + log2(l)), in float32.

    qk_scale is the softmax scale times log2(e). The kv head of query head h is h // group.
    BUCKET_Q and BUCKET_K only key the autotuner. With USE_TMA, K and V are tensor descriptors
    (their stride arguments are then unused).
    """
    tile = tl.program_id(0)
    if CAUSAL:
        # Causal query tiles further down see more keys: launch those first, so that the short
        # ones fill the gaps at the end instead of a long one running alone.
        tile = tl.num_programs(0) - 1 - tile
    start_m = tile * BLOCK_M
    bh = tl.program_id(1)
    # 64-bit offsets: batch * stride alone can pass 2**31 elements on large inputs.
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    hk = h // group
    q_base = Q + b * stride_qb + h * stride_qh
    if USE_TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b * stride_kb + hk * stride_kh
        v_src = V + b * stride_vb + hk * stride_vh
    # Descriptor coordinates are 32-bit; batch and head indices always fit.
    kv_b = (bh // num_heads).to(tl.int32)
    kv_h = ((bh % num_heads) // group).to(tl.int32)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # the padding of the head dim to BLOCK_D loads as zeros
    row_ok = offs_m < seq_q
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    hi_full, hi = key_range(start_m, seq_k, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_src, v_src, kv_b, kv_h, stride_kn, stride_kd,
                                   stride_vn, stride_vd, offs_m, offs_d, d_ok, seq_k, qk_scale, 0, hi_full,
                                   False, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_src, v_src, kv_b, kv_h, stride_kn, stride_kd,
                                   stride_vn, stride_vd, offs_m, offs_d, d_ok, seq_k, qk_scale, hi_full, hi,
                                   True, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)

    tl.store(LSE + bh.to(tl.int64) * seq_q + offs_m, m_i + tl.log2(l_i), mask=row_ok)
    o = acc / l_i[:, None]
    o_base = Out + b * stride_ob + h * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, o.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


_forward_tuned = triton.autotune(cfg.FORWARD_CONFIGS, key=cfg.TUNING_KEY,
                                 prune_configs_by=cfg.PRUNE_FORWARD)(attention_forward_kernel)
# By kernel name, for attention.autotuner_choices().
AUTOTUNERS = {"forward": _forward_tuned}


def strides(t: torch.Tensor) -> tuple[int, ...]:
    """The four strides of a (B, H, S, D) tensor, in elements."""
    return tuple(t.stride())


# The kernels address a (batch, head) slice from its origin (a 64-bit offset) with 32-bit offsets:
# recomputed per tile from the row index, they are cheap, where 64-bit ones cost registers that
# the sm_90 tiles do not have to spare (measured with ptxas: spills at d = 128).
INT32_SPAN_LIMIT = 2**31


def int32_addressable(t: torch.Tensor) -> torch.Tensor:
    """t when 32-bit offsets reach every element of each of its (batch, head) slices, else a
    contiguous copy (whose slices span S * D elements; callers send larger ones to torch)."""
    span = (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3)
    return t if span < INT32_SPAN_LIMIT else t.contiguous()


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      dot_precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the forward kernel on (B, H, S, D) tensors of any strides; k and v may have fewer
    heads (a divisor of q's). Returns the output (q's dtype and layout) and the float32 base-2 LSE
    (B, H, Sq): the backward recomputes P = exp2(S * scale * log2(e) - LSE) from it, which is
    consistent with the forward's own exponents only in base 2 (converting to the natural log and
    back would add a rounding per row, the same for every key of the row, that dK accumulates)."""
    q, k, v = (int32_addressable(t) for t in (q, k, v))
    batch, heads, seq_q, head_dim = q.shape
    group = heads // k.shape[1]
    seq_k = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((batch, heads, seq_q), device=q.device, dtype=torch.float32)
    block_d = cfg.block_d(head_dim)
    fixed = cfg.fixed_launch("forward", q, block_d)
    use_tma = (cfg.tensor_descriptors_requested() and cfg.descriptor_usable(k) and cfg.descriptor_usable(v))
    k_arg, v_arg = k, v
    if use_tma:
        # The box is set per configuration: by the autotuner's pre-hook, or here for a fixed launch.
        block_n = fixed["BLOCK_N"] if fixed else 64
        k_arg, v_arg = cfg.descriptor(k, block_n, block_d), cfg.descriptor(v, block_n, block_d)
    args = (q, k_arg, v_arg, o, lse, *strides(q), *strides(k), *strides(v), *strides(o),
            heads, group, seq_q, seq_k, scale * LOG2E, cfg.bucket(seq_q), cfg.bucket(seq_k))
    meta = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "CAUSAL": causal, "DOT_PRECISION": dot_precision,
            "USE_TMA": use_tma}
    if fixed:
        grid = (triton.cdiv(seq_q, fixed["BLOCK_M"]), batch * heads)
        attention_forward_kernel[grid](*args, **meta, **fixed)
    else:
        _forward_tuned[lambda m: (triton.cdiv(seq_q, m["BLOCK_M"]), batch * heads)](*args, **meta)
    return o, lse
