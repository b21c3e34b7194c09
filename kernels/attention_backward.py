"""Backward pass of the fused attention: delta = rowsum(dO * O), then dK/dV and dQ in two kernels.

The probabilities P = exp(S - LSE) are recomputed from Q, K and the forward's LSE instead of being
stored. Two kernels instead of one fused kernel with atomics: the dK/dV kernel owns a tile of keys
(of one kv head) and walks the query tiles of every query head of its group, the dQ kernel owns a
tile of queries and walks the key tiles. Each output is then written by exactly one program, so
the gradients are deterministic and dK/dV of GQA/MQA need no reduction afterwards, at the price of
computing Q K^T twice. Both kernels read only the tiles that the causal mask and the window leave
visible (tile_range), as the forward does.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import attention_configs as cfg
from .attention_forward import (int32_addressable, logits, lse_strides, score_args, sequence, strides,
                                tile_range, variant, visible_offsets)


@triton.jit
def attention_delta_kernel(Out, DO, DELTA,
                           stride_ob, stride_oh, stride_om, stride_od,
                           stride_dob, stride_doh, stride_dom, stride_dod,
                           stride_lb, stride_lh, seq_q,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """DELTA[b, h, i] = sum_d dO[i, d] * O[i, d] in float32: the row term of dS = P * (dP - delta).
    Program (row tile, h, b); packed tokens are one batch entry of all rows here."""
    start_m = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b * stride_lb + h * stride_lh + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_src, do_src, desc_b, q_h, q_row0, lse_ptr, delta_ptr,
                stride_qm, stride_qd, stride_dom, stride_dod,
                offs_n, offs_d, d_ok, len_q, len_k, shift, c_lo, c_hi, qk_scale, softcap, slope, window_left,
                lo, hi,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Adds the query tiles [lo, hi) of one query head to dK and dV of a key tile, working on the
    transposed scores (keys x queries) so that no tile needs a transpose before its dot product.
    Query rows past len_q load as zeros (dO = 0, delta = 0) on the pointer path; MASKED tiles,
    which hold every row outside the key tile's range or past len_q, zero their P as well (the
    descriptors of packed inputs read the next sequence's rows there, and unmasked tiles never
    hold such rows). q_src and do_src are the base pointers of the sequence's rows of one head, or
    with USE_TMA the descriptors of the whole q and dO, read at (desc_b, q_h, q_row0 + row)."""
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < len_q
        if USE_TMA:
            q = q_src.load([desc_b, q_h, q_row0 + start_m, 0]).reshape(BLOCK_M, BLOCK_D)
            do = do_src.load([desc_b, q_h, q_row0 + start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        else:
            tile_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_src + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=tile_mask,
                        other=0.0)
            do = tl.load(do_src + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=tile_mask,
                         other=0.0)
        lse2 = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        # A row that sees no key has LSE -inf; as +inf it makes P = exp2(logits - LSE) 0 for every
        # key, hidden (-inf) or not, instead of NaN or inf. (Such rows are only in masked tiles.)
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        s_t, cap_t = logits(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), rows[None, :],
                            offs_n[:, None], len_q, len_k, shift, c_lo, c_hi, qk_scale, softcap, slope,
                            window_left, MASKED, CAUSAL)
        p_t = tl.exp2(s_t - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if softcap is not None:
            ds_t = ds_t * (1.0 - cap_t * cap_t)  # d/dx of c * tanh(x / c) is 1 - tanh^2
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attention_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd,
        stride_dvb, stride_dvh, stride_dvn, stride_dvd,
        stride_lb, stride_lh,
        num_kv_heads, group, seq_q, seq_k, softmax_scale, qk_scale, softcap, window_left, window_right,
        stride_alibi_b,
        BUCKET_Q, BUCKET_K, VARIANT,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK and dV of one BLOCK_N tile of keys of one kv head of one sequence, summed over the `group`
    query heads that share the kv head: dV = P^T dO, dK = scale * dS^T Q. Program (key tile, kv
    head, batch entry or sequence); the sequences, options and USE_TMA as in the forward kernel,
    here with Q and DO as the descriptors. (With a causal mask the first key tiles have the most
    query rows: launch order is already longest first.)"""
    start_n = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, len_q, k_start, len_k, shift = sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, seq_q, seq_k)
    desc_b = b
    if CU_SEQLENS_K is not None:
        if start_n >= len_k:
            return
        desc_b = 0
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tile_mask = (offs_n[:, None] < len_k) & d_ok[None, :]
    k = tl.load(K + b64 * stride_kb + hk64 * stride_kh + k_start * stride_kn + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=tile_mask, other=0.0)
    v = tl.load(V + b64 * stride_vb + hk64 * stride_vh + k_start * stride_vn + offs_n[:, None] * stride_vn
                + offs_d[None, :] * stride_vd, mask=tile_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Key j is seen by the rows i with i + c_lo <= j < i + c_hi, that is j - c_hi < i <= j - c_lo:
    # the query tiles to walk follow from the rows' offsets (1 - c_hi, 1 - c_lo).
    c_lo, c_hi = visible_offsets(shift, window_left, window_right, CAUSAL)
    last_n = tl.minimum(start_n + BLOCK_N, len_k) - 1
    lo, lo_full, hi_full, hi = tile_range(start_n, last_n, len_q, 1 - c_hi, 1 - c_lo, BLOCK_M)
    # Rows past len_q load as zeros (pointers, and descriptors of dense inputs) and then add
    # nothing: without a window the unmasked loop takes the ragged last query tile as well, and the
    # masked loop after it is compiled out (as a third loop it cost registers: ptxas, sm_90, bf16,
    # d = 128, 32 x 32 tiles: 56 bytes of spills instead of none). Descriptors of packed tokens read
    # the next sequence's rows there, so they keep that tile masked.
    TAIL_MASKED: tl.constexpr = window_left is not None or (USE_TMA and CU_SEQLENS_Q is not None)
    if not TAIL_MASKED:
        hi_full = hi
    q_row0 = q_start.to(tl.int32)
    for g in range(0, group):
        h = hk * group + g
        h64 = h.to(tl.int64)
        if USE_TMA:
            q_src = Q
            do_src = DO
        else:
            q_src = Q + b64 * stride_qb + h64 * stride_qh + q_start * stride_qm
            do_src = DO + b64 * stride_dob + h64 * stride_doh + q_start * stride_dom
        lse_ptr = LSE + b64 * stride_lb + h64 * stride_lh + q_start
        delta_ptr = DELTA + b64 * stride_lb + h64 * stride_lh + q_start
        slope = None
        if ALIBI_SLOPES is not None:
            slope = tl.load(ALIBI_SLOPES + b64 * stride_alibi_b + h64).to(tl.float32)
        # The rows before the key tile's range come from its upper end (causal or window): without
        # either, lo_full == lo.
        if CAUSAL or window_left is not None:
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, desc_b, h, q_row0, lse_ptr, delta_ptr,
                                 stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d, d_ok,
                                 len_q, len_k, shift, c_lo, c_hi, qk_scale, softcap, slope, window_left,
                                 lo, lo_full, True, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_M, BLOCK_D)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, desc_b, h, q_row0, lse_ptr, delta_ptr,
                             stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d, d_ok,
                             len_q, len_k, shift, c_lo, c_hi, qk_scale, softcap, slope, window_left,
                             lo_full, hi_full, False, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_M, BLOCK_D)
        if TAIL_MASKED:
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_src, do_src, desc_b, h, q_row0, lse_ptr, delta_ptr,
                                 stride_qm, stride_qd, stride_dom, stride_dod, offs_n, offs_d, d_ok,
                                 len_q, len_k, shift, c_lo, c_hi, qk_scale, softcap, slope, window_left,
                                 hi_full, hi, True, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_M, BLOCK_D)

    dk = dk * softmax_scale
    tl.store(DK + b64 * stride_dkb + hk64 * stride_dkh + k_start * stride_dkn + offs_n[:, None] * stride_dkn
             + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=tile_mask)
    tl.store(DV + b64 * stride_dvb + hk64 * stride_dvh + k_start * stride_dvn + offs_n[:, None] * stride_dvn
             + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=tile_mask)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_src, v_src, desc_b, kv_h, k_row0, stride_kn, stride_kd, stride_vn,
              stride_vd, offs_m, offs_d, d_ok, len_q, len_k, shift, c_lo, c_hi, qk_scale, softcap, slope,
              window_left, lo, hi,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Adds the key tiles [lo, hi) to dQ (unscaled) of one query tile; MASKED, k_src and v_src as
    in the forward."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k_t = tl.trans(k_src.load([desc_b, kv_h, k_row0 + start_n, 0]).reshape(BLOCK_N, BLOCK_D))
            v_t = tl.trans(v_src.load([desc_b, kv_h, k_row0 + start_n, 0]).reshape(BLOCK_N, BLOCK_D))
        else:
            if MASKED:
                t_mask = d_ok[:, None] & (cols[None, :] < len_k)
            else:
                t_mask = d_ok[:, None]
            k_t = tl.load(k_src + offs_d[:, None] * stride_kd + cols[None, :] * stride_kn, mask=t_mask,
                          other=0.0)
            v_t = tl.load(v_src + offs_d[:, None] * stride_vd + cols[None, :] * stride_vn, mask=t_mask,
                          other=0.0)
        s, cap = logits(tl.dot(q, k_t, input_precision=DOT_PRECISION), offs_m[:, None], cols[None, :], len_q,
                        len_k, shift, c_lo, c_hi, qk_scale, softcap, slope, window_left, MASKED, CAUSAL)
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if softcap is not None:
            ds = ds * (1.0 - cap * cap)
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attention_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        stride_lb, stride_lh,
        num_heads, group, seq_q, seq_k, softmax_scale, qk_scale, softcap, window_left, window_right,
        stride_alibi_b,
        BUCKET_Q, BUCKET_K, VARIANT,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ = scale * dS K of one BLOCK_M tile of queries of one head of one sequence. Program (query
    tile, head, batch entry or sequence); the sequences, options and USE_TMA as in the forward
    kernel."""
    tile = tl.program_id(0)
    if CAUSAL:  # the longest tiles first, as in the forward kernel
        tile = tl.num_programs(0) - 1 - tile
    start_m = tile * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, len_q, k_start, len_k, shift = sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, seq_q, seq_k)
    desc_b = b
    if CU_SEQLENS_Q is not None:
        if start_m >= len_q:
            return
        desc_b = 0
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = h64 // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < len_q
    tile_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + q_start * stride_qm + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=tile_mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + q_start * stride_dom
                 + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=tile_mask, other=0.0)
    row_base = b64 * stride_lb + h64 * stride_lh + q_start
    lse2 = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # as in _dkdv_tiles
    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    if USE_TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b64 * stride_kb + hk64 * stride_kh + k_start * stride_kn
        v_src = V + b64 * stride_vb + hk64 * stride_vh + k_start * stride_vn
    kv_h = h // group
    k_row0 = k_start.to(tl.int32)
    slope = None
    if ALIBI_SLOPES is not None:
        slope = tl.load(ALIBI_SLOPES + b64 * stride_alibi_b + h64).to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    c_lo, c_hi = visible_offsets(shift, window_left, window_right, CAUSAL)  # as in the forward kernel
    last_m = tl.minimum(start_m + BLOCK_M, len_q) - 1
    lo, lo_full, hi_full, hi = tile_range(start_m, last_m, len_k, c_lo, c_hi, BLOCK_N)
    if window_left is not None:
        dq = _dq_tiles(dq, q, do, lse2, delta, k_src, v_src, desc_b, kv_h, k_row0, stride_kn, stride_kd,
                       stride_vn, stride_vd, offs_m, offs_d, d_ok, len_q, len_k, shift, c_lo, c_hi,
                       qk_scale, softcap, slope, window_left, lo, lo_full,
                       True, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_src, v_src, desc_b, kv_h, k_row0, stride_kn, stride_kd,
                   stride_vn, stride_vd, offs_m, offs_d, d_ok, len_q, len_k, shift, c_lo, c_hi,
                   qk_scale, softcap, slope, window_left, lo_full, hi_full,
                   False, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_src, v_src, desc_b, kv_h, k_row0, stride_kn, stride_kd,
                   stride_vn, stride_vd, offs_m, offs_d, d_ok, len_q, len_k, shift, c_lo, c_hi,
                   qk_scale, softcap, slope, window_left, hi_full, hi,
                   True, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)

    dq = dq * softmax_scale
    tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + q_start * stride_dqm + offs_m[:, None] * stride_dqm
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
                       dot_precision: str, *, window: Optional[tuple[int, int]] = None,
                       softcap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                       cu_seqlens_q: Optional[torch.Tensor] = None,
                       cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
                       max_seqlen_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (in the dtypes and layouts of q, k, v) from the output gradient `do`, the
    natural-log LSE's gradient `dlse` (None when the LSE was not used) and what the forward kept:
    its inputs, output and float32 base-2 LSE `lse2`. The options and packed sequences as in
    attention_forward."""
    packed = cu_seqlens_q is not None
    rows_q, rows_k = (max_seqlen_q, max_seqlen_k) if packed else (q.shape[2], k.shape[2])
    do, q, o = (int32_addressable(t, rows_q) for t in (do, q, o))
    k, v = (int32_addressable(t, rows_k) for t in (k, v))
    heads, seq_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    batch = cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_d = cfg.block_d(head_dim)
    fixed = {name: cfg.fixed_launch(name, q, block_d) for name in ("delta", "dkdv", "dq")}
    # The delta kernel runs on whole (batch, head) slices: packed tokens are one batch entry there.
    delta = torch.empty_like(lse2)
    delta_args = (o, do, delta, *strides(o), *strides(do), *lse_strides(delta), seq_q)
    if fixed["delta"]:
        blocks = fixed["delta"]
        attention_delta_kernel[(triton.cdiv(seq_q, blocks["BLOCK_M"]), heads, q.shape[0])](
            *delta_args, HEAD_DIM=head_dim, BLOCK_D=block_d, **blocks)
    else:
        _delta_tuned[lambda m: (triton.cdiv(seq_q, m["BLOCK_M"]), heads, q.shape[0])](
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
    qk_scale, cap, slopes, stride_alibi_b, left, right = score_args(scale, window, softcap, alibi_slopes)
    options = (cu_seqlens_q, cu_seqlens_k, slopes)
    tail = (seq_q, seq_k, scale, qk_scale, cap, left, right, stride_alibi_b, cfg.bucket(rows_q),
            cfg.bucket(rows_k), variant(packed, window, softcap, alibi_slopes))
    dkdv_args = (dkdv_q, k, v, dkdv_do, lse2, delta, dk, dv, *options, *strides(q, packed),
                 *strides(k, packed), *strides(v, packed), *strides(do, packed), *strides(dk, packed),
                 *strides(dv, packed), *lse_strides(lse2, packed), kv_heads, group, *tail)
    dq_args = (q, dq_k, dq_v, do, lse2, delta, dq, *options, *strides(q, packed), *strides(k, packed),
               *strides(v, packed), *strides(do, packed), *strides(dq, packed), *lse_strides(lse2, packed),
               heads, group, *tail)
    if fixed["dkdv"]:
        blocks = fixed["dkdv"]
        attention_dkdv_kernel[(triton.cdiv(rows_k, blocks["BLOCK_N"]), kv_heads, batch)](*dkdv_args, **meta,
                                                                                        **blocks)
    else:
        _dkdv_tuned[lambda m: (triton.cdiv(rows_k, m["BLOCK_N"]), kv_heads, batch)](*dkdv_args, **meta)
    if fixed["dq"]:
        blocks = fixed["dq"]
        attention_dq_kernel[(triton.cdiv(rows_q, blocks["BLOCK_M"]), heads, batch)](*dq_args, **meta,
                                                                                   **blocks)
    else:
        _dq_tuned[lambda m: (triton.cdiv(rows_q, m["BLOCK_M"]), heads, batch)](*dq_args, **meta)
    return dq, dk, dv
