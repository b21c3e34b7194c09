"""Backward pass of the fused attention: delta = rowsum(dO * O), then dK/dV and dQ in two kernels.

The probabilities P = exp(S - LSE) are recomputed from Q, K and the forward's LSE instead of being
stored. Two kernels instead of one fused kernel with atomics: the dK/dV kernel owns a tile of keys
(of one kv head) and walks the query tiles of every query head of its group, the dQ kernel owns a
tile of queries and walks the key tiles. Each output is then written by exactly one program, so
the gradients are deterministic and dK/dV of GQA/MQA need no reduction afterwards, at the price of
computing Q K^T twice.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import attention_configs as cfg
from .attention_forward import LOG2E, int32_addressable, key_range, strides


@triton.jit
def attention_delta_kernel(Out, DO, DELTA,
                           stride_ob, stride_oh, stride_om, stride_od,
                           stride_dob, stride_doh, stride_dom, stride_dod,
                           num_heads, seq_q,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """DELTA[bh, i] = sum_d dO[i, d] * O[i, d] in float32: the row term of dS = P * (dP - delta)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * seq_q + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_src, do_src, q_b, q_h, lse_ptr, delta_ptr,
                stride_qm, stride_qd, stride_dom, stride_dod,
                offs_n, offs_d, d_ok, seq_q, qk_scale, lo, hi,
                MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Adds the query tiles [lo, hi) of one query head to dK and dV of a key tile, working on the
    transposed scores (keys x queries) so that no tile needs a transpose before its dot product.
    Query rows past seq_q load as zeros (dO = 0, delta = 0): their dS and dO terms vanish, so only
    the causal diagonal (MASKED) needs an element-wise mask. q_src and do_src are the (batch,
    head) base pointers, or with USE_TMA the descriptors of the whole q and dO, read at (q_b, q_h)."""
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < seq_q
        if USE_TMA:
            q = q_src.load([q_b, q_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
            do = do_src.load([q_b, q_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        else:
            tile_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_src + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=tile_mask,
                        other=0.0)
            do = tl.load(do_src + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=tile_mask,
                         other=0.0)
        lse2 = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attention_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd,
        stride_dvb, stride_dvh, stride_dvn, stride_dvd,
        num_kv_heads, group, seq_q, seq_k, softmax_scale, qk_scale,
        BUCKET_Q, BUCKET_K,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK and dV of one BLOCK_N tile of keys of one (batch, kv head), summed over the `group`
    query heads that share the kv head: dV = P^T dO, dK = scale * dS^T Q. (With a causal mask the
    first key tiles have the most query rows: launch order is already longest first.) With
    USE_TMA, Q and DO are tensor descriptors (their stride arguments are then unused)."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = (bhk // num_kv_heads).to(tl.int64)
    hk = (bhk % num_kv_heads).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tile_mask = (offs_n[:, None] < seq_k) & d_ok[None, :]
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=tile_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn
                + offs_d[None, :] * stride_vd, mask=tile_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Top-left causal: key j is seen by rows i >= j. Query tiles that start at or after the
    # tile's last key see all of it (no mask); the tiles across the diagonal before them do not.
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        lo_full = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M), tl.cdiv(seq_q, BLOCK_M)) * BLOCK_M
        lo_full = tl.maximum(lo_full, lo)
    else:
        lo = 0
        lo_full = 0
    num_heads = num_kv_heads * group
    for g in range(0, group):
        h = hk * group + g
        bh = b * num_heads + h
        if USE_TMA:
            q_src = Q
            do_src = DO
        else:
            q_src = Q + b * stride_qb + h * stride_qh
            do_src = DO + b * stride_dob + h * stride_doh
        # Descriptor coordinates are 32-bit; batch and head indices always fit.
        q_b = b.to(tl.int32)
        q_h = h.to(tl.int32)
        lse_ptr = LSE + bh * seq_q
        delta_ptr = DELTA + bh * seq_q
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, q_b, q_h, lse_ptr, delta_ptr, stride_qm, stride_qd,
                             stride_dom, stride_dod, offs_n, offs_d, d_ok, seq_q, qk_scale, lo, lo_full,
                             True, DOT_PRECISION, USE_TMA, BLOCK_M, BLOCK_D)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, q_b, q_h, lse_ptr, delta_ptr, stride_qm, stride_qd,
                             stride_dom, stride_dod, offs_n, offs_d, d_ok, seq_q, qk_scale, lo_full, seq_q,
                             False, DOT_PRECISION, USE_TMA, BLOCK_M, BLOCK_D)

    dk = dk * softmax_scale
    tl.store(DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn
             + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=tile_mask)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvn
             + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=tile_mask)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_src, v_src, kv_b, kv_h, stride_kn, stride_kd, stride_vn, stride_vd,
              offs_m, offs_d, d_ok, seq_k, qk_scale, lo, hi,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Adds the key tiles [lo, hi) to dQ (unscaled) of one query tile; MASKED, k_src and v_src as
    in the forward."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k_t = tl.trans(k_src.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D))
            v_t = tl.trans(v_src.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D))
        else:
            if MASKED:
                t_mask = d_ok[:, None] & (cols[None, :] < seq_k)
            else:
                t_mask = d_ok[:, None]
            k_t = tl.load(k_src + offs_d[:, None] * stride_kd + cols[None, :] * stride_kn, mask=t_mask,
                          other=0.0)
            v_t = tl.load(v_src + offs_d[:, None] * stride_vd + cols[None, :] * stride_vn, mask=t_mask,
                          other=0.0)
        p = tl.exp2(tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            visible = cols[None, :] < seq_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attention_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        num_heads, group, seq_q, seq_k, softmax_scale, qk_scale,
        BUCKET_Q, BUCKET_K,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ = scale * dS K of one BLOCK_M tile of queries of one (batch, head). With USE_TMA, K and
    V are tensor descriptors (their stride arguments are then unused)."""
    tile = tl.program_id(0)
    if CAUSAL:  # the longest tiles first, as in the forward kernel
        tile = tl.num_programs(0) - 1 - tile
    start_m = tile * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    hk = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < seq_q
    tile_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=tile_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=tile_mask, other=0.0)
    lse2 = tl.load(LSE + bh.to(tl.int64) * seq_q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * seq_q + offs_m, mask=row_ok, other=0.0)
    if USE_TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b * stride_kb + hk * stride_kh
        v_src = V + b * stride_vb + hk * stride_vh
    kv_b = b.to(tl.int32)
    kv_h = hk.to(tl.int32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    hi_full, hi = key_range(start_m, seq_k, CAUSAL, BLOCK_M, BLOCK_N)  # as in the forward kernel
    dq = _dq_tiles(dq, q, do, lse2, delta, k_src, v_src, kv_b, kv_h, stride_kn, stride_kd, stride_vn,
                   stride_vd, offs_m, offs_d, d_ok, seq_k, qk_scale, 0, hi_full,
                   False, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_src, v_src, kv_b, kv_h, stride_kn, stride_kd, stride_vn,
                   stride_vd, offs_m, offs_d, d_ok, seq_k, qk_scale, hi_full, hi,
                   True, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)

    dq = dq * softmax_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=tile_mask)


_delta_tuned = triton.autotune(cfg.DELTA_CONFIGS, key=["BLOCK_D"])(attention_delta_kernel)
_dkdv_tuned = triton.autotune(cfg.DKDV_CONFIGS, key=cfg.TUNING_KEY,
                              prune_configs_by=cfg.PRUNE_DKDV)(attention_dkdv_kernel)
_dq_tuned = triton.autotune(cfg.DQ_CONFIGS, key=cfg.TUNING_KEY,
                            prune_configs_by=cfg.PRUNE_DQ)(attention_dq_kernel)
# By kernel name, for attention.autotuner_choices().
AUTOTUNERS = {"delta": _delta_tuned, "dkdv": _dkdv_tuned, "dq": _dq_tuned}


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse2: torch.Tensor, dlse: Optional[torch.Tensor], causal: bool, scale: float,
                       dot_precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (in the dtypes and layouts of q, k, v) from the output gradient `do`, the
    natural-log LSE's gradient `dlse` (None when the LSE was not used) and what the forward kept:
    its inputs, output and float32 base-2 LSE `lse2`."""
    do, q, k, v, o = (int32_addressable(t) for t in (do, q, k, v, o))
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_d = cfg.block_d(head_dim)
    fixed = {name: cfg.fixed_launch(name, q, block_d) for name in ("delta", "dkdv", "dq")}
    delta = torch.empty((batch, heads, seq_q), device=q.device, dtype=torch.float32)
    delta_args = (o, do, delta, *strides(o), *strides(do), heads, seq_q)
    if fixed["delta"]:
        blocks = fixed["delta"]
        attention_delta_kernel[(triton.cdiv(seq_q, blocks["BLOCK_M"]), batch * heads)](
            *delta_args, HEAD_DIM=head_dim, BLOCK_D=block_d, **blocks)
    else:
        _delta_tuned[lambda m: (triton.cdiv(seq_q, m["BLOCK_M"]), batch * heads)](
            *delta_args, HEAD_DIM=head_dim, BLOCK_D=block_d)
    if dlse is not None:
        # d lse_i / d s_ij = p_ij, so the LSE's gradient adds p_ij * dlse_i to dS_ij: the same as
        # dS = P * (dP - (delta - dlse)). Folding it into delta leaves the kernels unchanged.
        delta.sub_(dlse)

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    use_tma = cfg.tensor_descriptors_requested() and all(cfg.descriptor_usable(t) for t in (q, k, v, do))
    # What each kernel streams: Q and dO for dK/dV, K and V for dQ; through descriptors with TMA,
    # whose box is set per configuration (by the autotuner's pre-hook, or here for a fixed launch).
    dkdv_q, dkdv_do, dq_k, dq_v = q, do, k, v
    if use_tma:
        rows = fixed["dkdv"]["BLOCK_M"] if fixed["dkdv"] else 64
        dkdv_q, dkdv_do = cfg.descriptor(q, rows, block_d), cfg.descriptor(do, rows, block_d)
        rows = fixed["dq"]["BLOCK_N"] if fixed["dq"] else 64
        dq_k, dq_v = cfg.descriptor(k, rows, block_d), cfg.descriptor(v, rows, block_d)
    meta = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "CAUSAL": causal, "DOT_PRECISION": dot_precision,
            "USE_TMA": use_tma}
    tail = (seq_q, seq_k, scale, scale * LOG2E, cfg.bucket(seq_q), cfg.bucket(seq_k))
    dkdv_args = (dkdv_q, k, v, dkdv_do, lse2, delta, dk, dv, *strides(q), *strides(k), *strides(v),
                 *strides(do), *strides(dk), *strides(dv), kv_heads, group, *tail)
    dq_args = (q, dq_k, dq_v, do, lse2, delta, dq, *strides(q), *strides(k), *strides(v), *strides(do),
               *strides(dq), heads, group, *tail)
    if fixed["dkdv"]:
        blocks = fixed["dkdv"]
        attention_dkdv_kernel[(triton.cdiv(seq_k, blocks["BLOCK_N"]), batch * kv_heads)](*dkdv_args, **meta,
                                                                                        **blocks)
    else:
        _dkdv_tuned[lambda m: (triton.cdiv(seq_k, m["BLOCK_N"]), batch * kv_heads)](*dkdv_args, **meta)
    if fixed["dq"]:
        blocks = fixed["dq"]
        attention_dq_kernel[(triton.cdiv(seq_q, blocks["BLOCK_M"]), batch * heads)](*dq_args, **meta,
                                                                                     **blocks)
    else:
        _dq_tuned[lambda m: (triton.cdiv(seq_q, m["BLOCK_M"]), batch * heads)](*dq_args, **meta)
    return dq, dk, dv
