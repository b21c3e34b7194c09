"""Forward pass of the fused attention: one Triton program per (query tile, head, batch entry or sequence)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import attention_configs as cfg

LOG2E = 1.4426950408889634  # log2(e): scores are kept in base 2 so that exp2 can be used
LN2 = 0.6931471805599453  # back from base 2 to the natural-log LSE callers see
# A window side that is not bounded: further than any key from any query (sequences are shorter
# than 2**27 rows: the kernels take S * D < 2**31 with D >= 16), and small enough that the index
# arithmetic below stays inside int32 after adding a row index and a shift to it.
UNBOUNDED = 2**30
_UNBOUNDED = tl.constexpr(UNBOUNDED)


@triton.jit
def sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, seq_q, seq_k):
    """Where sequence b lies in the rows of its (batch, head) slices and how it aligns: (q_start,
    len_q, k_start, len_k, shift), the starts as int64. Dense inputs hold one sequence per batch
    entry, all seq_q / seq_k rows, aligned top-left as torch aligns its causal mask (shift 0).
    Packed (varlen) inputs are one batch entry of all tokens, in which sequence b takes the rows
    CU_SEQLENS[b] .. CU_SEQLENS[b + 1] - 1, aligned bottom-right as FlashAttention aligns packed
    sequences (shift len_k - len_q: the last query row stands at the last key). (The conversions
    make any integer type of CU_SEQLENS work; the host passes int32.)"""
    q_start = tl.full([], 0, tl.int64)
    k_start = tl.full([], 0, tl.int64)
    len_q = seq_q
    len_k = seq_k
    shift = 0
    if CU_SEQLENS_Q is not None:
        first_q = tl.load(CU_SEQLENS_Q + b).to(tl.int32)
        first_k = tl.load(CU_SEQLENS_K + b).to(tl.int32)
        len_q = tl.load(CU_SEQLENS_Q + b + 1).to(tl.int32) - first_q
        len_k = tl.load(CU_SEQLENS_K + b + 1).to(tl.int32) - first_k
        q_start = first_q.to(tl.int64)
        k_start = first_k.to(tl.int64)
        shift = len_k - len_q
    return q_start, len_q, k_start, len_k, shift


@triton.jit
def visible_offsets(shift, window_left, window_right, CAUSAL: tl.constexpr):
    """(c_lo, c_hi): the query in row i of its sequence sees the keys j with i + c_lo <= j < i + c_hi
    (and 0 <= j < the sequence's key count). Row i stands at key position i + shift: shift is 0
    for torch's top-left alignment, Sk - Sq for the bottom-right one. The causal mask ends the
    range at the row's own position; a window (window_left None: no window) bounds it on both
    sides, window_left keys before that position and window_right after it."""
    c_lo = -_UNBOUNDED
    c_hi = _UNBOUNDED
    if window_left is not None:
        c_lo = shift - window_left
        c_hi = shift + window_right + 1
        if CAUSAL:
            c_hi = tl.minimum(c_hi, shift + 1)
    elif CAUSAL:
        c_hi = shift + 1
    return c_lo, c_hi


@triton.jit
def tile_range(first, last, count, c_lo, c_hi, BLOCK: tl.constexpr):
    """The tiles of BLOCK indices along the other axis that the indices first..last of a tile
    read, where index a reads the other indices [a + c_lo, a + c_hi) within [0, count), both ends
    non-decreasing in a (query rows reading keys, or key rows read by queries). Returns (lo,
    lo_full, hi_full, hi), multiples of BLOCK from lo on except hi: the tiles in [lo_full, hi_full)
    are read whole by every index of the tile and need no mask; those in [lo, lo_full) and
    [hi_full, hi) hold other indices that some of the tile's indices do not read, or that lie past
    count. Every operand of the divisions is non-negative (Triton divides integers towards zero)."""
    lo_first = tl.minimum(tl.maximum(first + c_lo, 0), count)
    lo_last = tl.minimum(tl.maximum(last + c_lo, 0), count)
    hi_first = tl.minimum(tl.maximum(first + c_hi, 0), count)
    hi_last = tl.minimum(tl.maximum(last + c_hi, 0), count)
    lo = lo_first // BLOCK * BLOCK
    hi = tl.maximum(hi_last, lo)
    lo_full = tl.minimum(lo + tl.cdiv(lo_last - lo, BLOCK) * BLOCK, hi)
    hi_full = tl.maximum(lo + tl.maximum(hi_first - lo, 0) // BLOCK * BLOCK, lo_full)
    return lo, lo_full, hi_full, hi


@triton.jit
def tanh(x):
    """tanh in float32 within 2 ulps, on exp2 (which the interpreter has, unlike tanh): from
    (1 - e) / (1 + e) with e = exp(-2|x|), except below |x| = 0.25, where 1 - e would cancel, from
    its odd Taylor series to x^9 (the first term left out is below 2**-26 relative there)."""
    a = tl.abs(x)
    e = tl.exp2(-2.8853900817779268 * a)  # exp(-2|x|)
    large = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a + a * a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (
        -0.05396825396825397 + a2 * 0.021869488536155203)))
    t = tl.where(a < 0.25, small, large)
    return tl.where(x < 0, -t, t)


@triton.jit
def logits(qk, rows, cols, len_q, len_k, shift, c_lo, c_hi, qk_scale, softcap, slope, window_left,
           MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Base-2 logits of a tile from its dot products q.k, and the tanh of the soft cap (the
    backward's derivative needs it; 0.0 without a cap). rows (query rows) and cols (keys) of the
    sequence broadcast to the tile.

    Without a cap the logit is q.k * scale (qk_scale is scale * log2(e)); with one, softcap *
    tanh(q.k * scale / softcap) (qk_scale is then scale / softcap and `softcap` is the cap times
    log2(e)). ALiBi then adds -slope * |i + shift - j| for query row i and key j (slope times
    log2(e); None: no ALiBi). MASKED tiles set the logits of hidden pairs to -inf: a row or key
    past its sequence, a key outside the row's range [i + c_lo, i + c_hi) (visible_offsets).
    """
    if softcap is not None:
        t = tanh(qk * qk_scale)
        s = t * softcap
    else:
        t = 0.0
        s = qk * qk_scale
    if slope is not None:
        s = s - slope * tl.abs(rows + shift - cols).to(tl.float32)
    if MASKED:
        seen = (rows < len_q) & (cols < len_k)
        if window_left is not None:
            seen = seen & (cols >= rows + c_lo) & (cols < rows + c_hi)
        elif CAUSAL:
            seen = seen & (cols < rows + c_hi)
        s = tl.where(seen, s, float("-inf"))
    return s, t


@triton.jit
def _forward_tiles(acc, l_i, m_i, q, k_src, v_src, desc_b, kv_h, k_row0, stride_kn, stride_kd, stride_vn,
                   stride_vd, offs_m, offs_d, d_ok, len_q, len_k, shift, c_lo, c_hi, qk_scale, softcap, slope,
                   window_left, lo, hi,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Folds the key tiles [lo, hi) into the running softmax state (acc, l_i, m_i) of one query
    tile. MASKED tiles may hold keys past len_k or outside some rows' range (logits); the others
    are seen whole by every row, so they skip the element-wise mask. k_src and v_src are the base
    pointers of the sequence's keys and values, or with USE_TMA the tensor descriptors of the
    whole k and v, read at (desc_b, kv_h, k_row0 + key)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k_t = tl.trans(k_src.load([desc_b, kv_h, k_row0 + start_n, 0]).reshape(BLOCK_N, BLOCK_D))
        elif MASKED:
            k_t = tl.load(k_src + offs_d[:, None] * stride_kd + cols[None, :] * stride_kn,
                          mask=d_ok[:, None] & (cols[None, :] < len_k), other=0.0)
        else:
            k_t = tl.load(k_src + offs_d[:, None] * stride_kd + cols[None, :] * stride_kn, mask=d_ok[:, None],
                          other=0.0)
        qk, _ = logits(tl.dot(q, k_t, input_precision=DOT_PRECISION), offs_m[:, None], cols[None, :], len_q,
                       len_k, shift, c_lo, c_hi, qk_scale, softcap, slope, window_left, MASKED, CAUSAL)
        # Online softmax: raise the running max, rescale what was accumulated under the old one.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED:
            # A row may not have seen any key yet (a window, the bottom-right alignment, the rows
            # past the sequence): exponentiate against 0 there, where -inf - -inf would be NaN.
            # Unmasked tiles give every row a finite maximum.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        # V is loaded only now: loaded with K, it would hold registers through the softmax.
        if USE_TMA:
            v = v_src.load([desc_b, kv_h, k_row0 + start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        elif MASKED:
            v = tl.load(v_src + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=(cols[:, None] < len_k) & d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_src + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=d_ok[None, :],
                        other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_forward_kernel(
        Q, K, V, Out, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, ALIBI_SLOPES,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        stride_lb, stride_lh,
        num_heads, group, seq_q, seq_k, qk_scale, softcap, window_left, window_right, stride_alibi_b,
        BUCKET_Q, BUCKET_K, VARIANT,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """O = softmax(logits) V for one BLOCK_M tile of queries of one head of one sequence, and
    LSE = the base-2 logsumexp of each row's logits (m + log2(l)), in float32; rows that see no key
    get O = 0 and LSE = -inf.

    Program (tile, h, b): b is the batch entry, or with CU_SEQLENS_Q / CU_SEQLENS_K (int32
    cumulative lengths; None for dense inputs) the sequence of the packed tokens, whose tensors
    are then one batch entry (batch strides 0) of seq_q / seq_k rows. Causal and window ranges
    are aligned top-left for dense inputs and bottom-right for packed ones (visible_offsets).
    The logits are in `logits`: qk_scale and softcap (None: no cap) as documented there,
    ALIBI_SLOPES (None: no ALiBi) the base-2 slopes at b * stride_alibi_b + h. window_left and
    window_right (None: no window) are key counts, UNBOUNDED for an open side. The kv head of
    query head h is h // group. BUCKET_Q, BUCKET_K and VARIANT (which options are on) only key
    the autotuner. With USE_TMA, K and V are tensor descriptors (their stride arguments are then
    unused).
    """
    tile = tl.program_id(0)
    if CAUSAL:
        # Causal query tiles further down see more keys: launch those first, so that the short
        # ones fill the gaps at the end instead of a long one running alone.
        tile = tl.num_programs(0) - 1 - tile
    start_m = tile * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, len_q, k_start, len_k, shift = sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, seq_q, seq_k)
    desc_b = b
    if CU_SEQLENS_Q is not None:
        # Packed: the grid covers the longest sequence; this one may end before the tile.
        if start_m >= len_q:
            return
        desc_b = 0
    # 64-bit offsets: batch * stride alone can pass 2**31 elements on large inputs.
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = h64 // group
    q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start * stride_qm
    if USE_TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + b64 * stride_kb + hk64 * stride_kh + k_start * stride_kn
        v_src = V + b64 * stride_vb + hk64 * stride_vh + k_start * stride_vn
    # Descriptor coordinates are 32-bit; batch, head and token indices always fit.
    kv_h = h // group
    k_row0 = k_start.to(tl.int32)
    slope = None
    if ALIBI_SLOPES is not None:
        slope = tl.load(ALIBI_SLOPES + b64 * stride_alibi_b + h64).to(tl.float32)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # the padding of the head dim to BLOCK_D loads as zeros
    row_ok = offs_m < len_q
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    c_lo, c_hi = visible_offsets(shift, window_left, window_right, CAUSAL)
    last_m = tl.minimum(start_m + BLOCK_M, len_q) - 1
    lo, lo_full, hi_full, hi = tile_range(start_m, last_m, len_k, c_lo, c_hi, BLOCK_N)
    if window_left is not None:  # without a window the range starts at key 0 (lo_full == lo == 0)
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_src, v_src, desc_b, kv_h, k_row0, stride_kn,
                                       stride_kd, stride_vn, stride_vd, offs_m, offs_d, d_ok, len_q, len_k,
                                       shift, c_lo, c_hi, qk_scale, softcap, slope, window_left, lo, lo_full,
                                       True, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_src, v_src, desc_b, kv_h, k_row0, stride_kn, stride_kd,
                                   stride_vn, stride_vd, offs_m, offs_d, d_ok, len_q, len_k, shift, c_lo,
                                   c_hi, qk_scale, softcap, slope, window_left, lo_full, hi_full,
                                   False, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_src, v_src, desc_b, kv_h, k_row0, stride_kn, stride_kd,
                                   stride_vn, stride_vd, offs_m, offs_d, d_ok, len_q, len_k, shift, c_lo,
                                   c_hi, qk_scale, softcap, slope, window_left, hi_full, hi,
                                   True, CAUSAL, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_D)

    # A row that saw no key has l = 0 and m = -inf: its LSE is -inf and its output 0.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    lse_base = LSE + b64 * stride_lb + h64 * stride_lh + q_start
    tl.store(lse_base + offs_m, m_i + tl.log2(l_i), mask=row_ok)
    o = acc / l_i[:, None]
    o_base = Out + b64 * stride_ob + h64 * stride_oh + q_start * stride_om
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, o.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


_forward_tuned = triton.autotune(cfg.FORWARD_CONFIGS, key=cfg.TUNING_KEY,
                                 prune_configs_by=cfg.PRUNE_FORWARD)(attention_forward_kernel)
# By kernel name, for attention.autotuner_choices().
AUTOTUNERS = {"forward": _forward_tuned}


def strides(t: torch.Tensor, packed: bool = False) -> tuple[int, ...]:
    """The four strides of a (B, H, S, D) tensor, in elements. A packed (1, H, T, D) view gets batch
    stride 0: the kernels' batch index is then the sequence, found through cu_seqlens."""
    return (0 if packed else t.stride(0), *t.stride()[1:])


def lse_strides(lse: torch.Tensor, packed: bool = False) -> tuple[int, int]:
    """Batch and head strides of a (B, H, S) float32 LSE or delta (rows contiguous)."""
    return 0 if packed else lse.stride(0), lse.stride(1)


# The kernels address a (batch, head) slice from its origin (a 64-bit offset) with 32-bit offsets:
# recomputed per tile from the row index, they are cheap, where 64-bit ones cost registers that
# the sm_90 tiles do not have to spare (measured with ptxas: spills at d = 128).
INT32_SPAN_LIMIT = 2**31


def int32_addressable(t: torch.Tensor, rows: Optional[int] = None) -> torch.Tensor:
    """t when 32-bit offsets reach every element of each of its sequences (`rows` long, default
    the whole slice: S), else a contiguous copy (whose sequences span rows * D elements; callers
    send larger ones to torch)."""
    rows = t.shape[2] if rows is None else rows
    span = (rows - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3)
    return t if span < INT32_SPAN_LIMIT else t.contiguous()


def score_args(scale: float, window: Optional[tuple[int, int]], softcap: Optional[float],
               alibi_slopes: Optional[torch.Tensor]) -> tuple:
    """The kernels' logit arguments (qk_scale, softcap, ALIBI_SLOPES, stride_alibi_b, window_left,
    window_right) for a softmax scale, a (left, right) window (-1: unbounded side; None: no
    window), a soft cap (None: none) and float32 ALiBi slopes of shape (H,) or (B, H) (None: none).
    Options that are off are passed as None, so that Triton compiles their code out."""
    if softcap is None:
        qk_scale, cap = scale * LOG2E, None
    else:
        qk_scale, cap = scale / softcap, softcap * LOG2E
    slopes, stride_b = None, 0
    if alibi_slopes is not None:
        slopes = (alibi_slopes.float() * LOG2E).contiguous()
        stride_b = slopes.shape[1] if slopes.dim() == 2 else 0
    left = right = None
    if window is not None:
        left, right = (UNBOUNDED if w < 0 else w for w in window)
    return qk_scale, cap, slopes, stride_b, left, right


def variant(packed: bool, window: Optional[tuple[int, int]], softcap: Optional[float],
            alibi_slopes: Optional[torch.Tensor]) -> int:
    """The autotuning key of the options that are on (each changes the work per tile)."""
    return packed + 2 * (window is not None) + 4 * (softcap is not None) + 8 * (alibi_slopes is not None)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      dot_precision: str, *, window: Optional[tuple[int, int]] = None,
                      softcap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                      cu_seqlens_q: Optional[torch.Tensor] = None,
                      cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
                      max_seqlen_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the forward kernel on (B, H, S, D) tensors of any strides; k and v may have fewer
    heads (a divisor of q's). With cu_seqlens_q and cu_seqlens_k (int32, (N + 1,)), q, k and v are
    (1, H, T, D) views of packed tokens holding N sequences, the longest max_seqlen_q / max_seqlen_k
    long. window, softcap and alibi_slopes as in score_args. Returns the output (q's dtype and
    layout) and the float32 base-2 LSE (B, H, Sq), or (1, H, Tq) packed: the backward recomputes
    P = exp2(logits - LSE) from it, which is consistent with the forward's own exponents only in
    base 2 (converting to the natural log and back would add a rounding per row, the same for
    every key of the row, that dK accumulates)."""
    packed = cu_seqlens_q is not None
    rows_q, rows_k = (max_seqlen_q, max_seqlen_k) if packed else (q.shape[2], k.shape[2])
    q = int32_addressable(q, rows_q)
    k, v = (int32_addressable(t, rows_k) for t in (k, v))
    heads, seq_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    batch = cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    group = heads // k.shape[1]
    seq_k = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((q.shape[0], heads, seq_q), device=q.device, dtype=torch.float32)
    block_d = cfg.block_d(head_dim)
    fixed = cfg.fixed_launch("forward", q, block_d)
    use_tma = (cfg.tensor_descriptors_requested() and cfg.descriptor_usable(k) and cfg.descriptor_usable(v))
    k_arg, v_arg = k, v
    if use_tma:
        # The box is set per configuration: by the autotuner's pre-hook, or here for a fixed launch.
        block_n = fixed["BLOCK_N"] if fixed else 64
        k_arg, v_arg = cfg.descriptor(k, block_n, block_d), cfg.descriptor(v, block_n, block_d)
    qk_scale, cap, slopes, stride_alibi_b, left, right = score_args(scale, window, softcap, alibi_slopes)
    args = (q, k_arg, v_arg, o, lse, cu_seqlens_q, cu_seqlens_k, slopes,
            *strides(q, packed), *strides(k, packed), *strides(v, packed), *strides(o, packed),
            *lse_strides(lse, packed), heads, group, seq_q, seq_k, qk_scale, cap, left, right, stride_alibi_b,
            cfg.bucket(rows_q), cfg.bucket(rows_k), variant(packed, window, softcap, alibi_slopes))
    meta = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "CAUSAL": causal, "DOT_PRECISION": dot_precision,
            "USE_TMA": use_tma}
    if fixed:
        grid = (triton.cdiv(rows_q, fixed["BLOCK_M"]), heads, batch)
        attention_forward_kernel[grid](*args, **meta, **fixed)
    else:
        _forward_tuned[lambda m: (triton.cdiv(rows_q, m["BLOCK_M"]), heads, batch)](*args, **meta)
    return o, lse
