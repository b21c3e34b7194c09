"""Fused attention against float64 references: forward, LSE and all gradients, fallbacks to torch.

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on tiny
shapes in float16 and float32; with one, the same cases run on the GPU, and the tests marked gpu
add bfloat16 and real sizes.
"""
from __future__ import annotations

import functools
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from braid.kernels import attention, attention_configs, flash_attention, scaled_dot_product_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def probabilities(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None = None, *,
                  window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None, shift: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities and natural-log LSE of textbook attention scores, in q's dtype; k's heads
    are repeated for GQA as torch's enable_gqa does. Query row i stands at key position i + shift
    (0: top-left, as torch aligns is_causal). The logits: scale * q.k, then softcap * tanh(s /
    softcap), then -slope * |i + shift - j| (slopes (H,) or (B, H)), then the causal mask and the
    window (left, right; -1 an open side) hide keys. A row that sees no key gets probabilities 0
    (with zero gradients) and LSE -inf."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    distance = (torch.arange(q.shape[-2], device=q.device)[:, None] + shift
                - torch.arange(k.shape[-2], device=q.device)[None, :])  # (i + shift) - j
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(q.dtype).reshape(-1, q.shape[1], 1, 1) * distance.abs().to(q.dtype)
    hidden = torch.zeros_like(distance, dtype=torch.bool)
    if causal:
        hidden |= distance < 0
    left, right = window
    if left >= 0:
        hidden |= distance > left
    if right >= 0:
        hidden |= distance < -right
    scores = scores.masked_fill(hidden, float("-inf"))
    # Rows that see no key: softmax over zeros instead of -inf (no NaN), then zeroed.
    empty = hidden.all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return probs, torch.logsumexp(scores, dim=-1)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None,
              dtype: torch.dtype | None = None, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook attention and the natural-log LSE of each row, computed in `dtype` (default: the
    inputs'); `options` (window, softcap, alibi_slopes, shift) as in `probabilities`."""
    dtype = dtype or q.dtype
    probs, lse = probabilities(q.to(dtype), k.to(dtype), causal, scale, **options)
    return probs @ v.to(dtype).repeat_interleave(q.shape[1] // k.shape[1], 1), lse


def run(fn, q, k, v, do, dlse):
    """fn(q, k, v) -> (out, lse) with fresh leaves; returns out, lse, dq, dk, dv for the loss
    sum(out * do) + sum(lse * dlse), so that the LSE's gradient is checked along with the output's
    (over the rows that see some key: the LSE of the others is -inf)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    loss = (out.double() * do).sum() + (lse.double().masked_fill(torch.isinf(lse), 0.0) * dlse).sum()
    loss.backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def make_inputs(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, transposed=False, seed=0):
    """q, k, v of `dtype` (as (B, S, H, D) memory viewed as (B, H, S, D) when transposed), and float64
    upstream gradients for the output and the LSE."""
    gen = torch.Generator().manual_seed(seed)

    def tensor(h, s):
        shape = (batch, s, h, head_dim) if transposed else (batch, h, s, head_dim)
        t = torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)
        return t.transpose(1, 2) if transposed else t

    q, k, v = tensor(heads, seq_q), tensor(kv_heads, seq_k), tensor(kv_heads, seq_k)
    do = torch.randn(batch, heads, seq_q, head_dim, generator=gen, dtype=torch.float64).to(DEVICE)
    dlse = torch.randn(batch, heads, seq_q, generator=gen, dtype=torch.float64).to(DEVICE)
    return q, k, v, do, dlse


# The flash-attention convention: braid's error against the float64 truth may be at most twice
# that of torch computing the same thing in the same dtype, plus a floor for the cases where
# torch's error happens to be near zero (one visible key: the output is v itself, and torch's
# softmax gradient cancels exactly) while braid still pays two things, FLOOR_ULPS ulps each:
# - the single rounding of its float32 result to the output dtype, at the size of the largest
#   reference value (torch rounds in other places, so the two need not land on the same side);
# - its float32 arithmetic in dS = P * (dP - delta), which subtracts two length-D dot products of
#   unit-normal data (size about sqrt(D)); that cancellation keeps their float32 rounding error
#   even when the gradient itself is near zero. torch's softmax backward takes its delta from the
#   same dP values, so their rounding partly cancels; a flash backward takes delta from O and dO,
#   so it does not. A row of dQ sums these errors weighted by the row's probabilities (total 1);
#   a key's row of dK (and of dV, through P's own rounding) sums them over every query row of its
#   group that sees it, weighted by the probability that key collects: `mass`, the largest such
#   sum (key_mass), which reaches 9 in the strided float32 case here.
FLOOR_ULPS = 4


def key_mass(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None, **options) -> float:
    """The largest probability a key collects over the query rows of its kv group (float64), at
    least 1: how much dS's per-element error can add up in one row of dK or dV."""
    probs, _ = probabilities(q.double(), k.double(), causal, scale, **options)
    return max(1.0, probs.unflatten(1, (k.shape[1], -1)).sum(dim=(2, 3)).max().item())


def check_close(name, got, same_dtype, truth, dtype, mass=1.0):
    # Rows that see no key: an LSE of -inf wherever the truth has one, compared apart.
    no_key = torch.isinf(truth)
    assert torch.equal(torch.isinf(got), no_key) and (got[no_key] == truth[no_key]).all(), \
        f"{name}: infinities differ from the truth's"
    got, same_dtype, truth = (t.masked_fill(no_key, 0.0) for t in (got, same_dtype, truth))
    err = (got.double() - truth).abs().max().item()
    ref_err = (same_dtype.double() - truth).abs().max().item()
    head_dim = got.shape[-1] if name != "lse" else 1
    spread = mass if name in ("dk", "dv") else 1.0
    floor = FLOOR_ULPS * (torch.finfo(dtype).eps * truth.abs().max().item()
                          + torch.finfo(torch.float32).eps * math.sqrt(head_dim) * spread)
    assert err <= 2 * ref_err + floor, \
        f"{name}: error {err:.3g} > 2 * {ref_err:.3g} (torch, same dtype) + {floor:.3g}"


def check_against_references(fn, shape, dtype, causal, transposed=False, scale=None, **options):
    """Forward, LSE and dq/dk/dv of fn against float64, with torch in `dtype` as the yardstick;
    `options` (window, softcap, alibi_slopes) as in `probabilities`."""
    q, k, v, do, dlse = make_inputs(*shape, dtype=dtype, transposed=transposed)
    got = run(fn, q, k, v, do, dlse)
    truth = run(lambda *t: reference(*t, causal, scale, torch.float64, **options), q, k, v, do, dlse)
    same = run(lambda *t: reference(*t, causal, scale, **options), q, k, v, do, dlse)
    # The LSE is float32 whatever the inputs: its yardstick is torch computing it in float32.
    same_lse = reference(q, k, v, causal, scale, torch.float32, **options)[1]
    assert got[0].dtype == dtype and got[0].shape == q.shape
    assert got[1].dtype == torch.float32 and got[1].shape == q.shape[:3]
    mass = key_mass(q, k, causal, scale, **options)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert got[i].shape == truth[i].shape, name
        check_close(name, got[i], same_lse if name == "lse" else same[i], truth[i],
                    torch.float32 if name == "lse" else dtype, mass)


# (batch, q heads, kv heads, Sq, Sk, head dim): lengths 1, 17, 77, 130, Sq > Sk and Sq < Sk, GQA
# and MQA, head dims 16, 32, 64, 96, 128, 256. The interpreter tiles are 32 x 16 (forward, dQ) and
# 16 x 32 (dK/dV), so 17, 77 and 130 leave ragged tiles and 130 spans several.
SHAPES = [
    (1, 2, 2, 1, 1, 32),
    (1, 2, 2, 17, 17, 64),
    (2, 2, 2, 77, 77, 32),
    (1, 1, 1, 130, 130, 128),
    (1, 2, 2, 77, 17, 64),     # Sq > Sk: causal rows past Sk see every key
    (1, 2, 2, 17, 130, 32),    # Sq < Sk: causal keys past Sq are seen by no row
    (1, 3, 3, 1, 77, 64),
    (1, 4, 2, 33, 47, 64),     # GQA
    (2, 4, 1, 77, 30, 32),     # MQA
    (1, 2, 1, 45, 61, 96),     # head dim padded to 128 inside the kernels
    (1, 2, 2, 9, 21, 16),      # the smallest head dim
    (1, 1, 1, 20, 20, 256),    # the largest
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_flash_attention_matches_float64(shape, causal, dtype):
    """Output, LSE and all three gradients (through the output and the LSE) on small shapes."""
    check_against_references(functools.partial(flash_attention, causal=causal, return_lse=True),
                             shape, dtype, causal)


def alibi_slopes(*shape: int) -> torch.Tensor:
    """float32 ALiBi slopes of `shape` ((H,) or (B, H)), spread over 0.05 .. 0.6: biases from 0
    to tens of logits over these lengths, so that a wrong distance or alignment shows."""
    n = math.prod(shape)
    return torch.linspace(0.05, 0.6, n, dtype=torch.float32).reshape(shape).to(DEVICE)


# (shape as in SHAPES, causal, options): windows on both sides; a causal window with Sq > Sk, where
# the rows past Sk + left see no key (output 0, LSE -inf); the soft cap (2: scores of unit-normal
# data are capped hard); ALiBi per head without a mask (keys on both sides of the row, where the
# bias takes |i - j|) and per (batch, head); everything at once, with GQA.
OPTION_CASES = [
    ((1, 2, 2, 45, 61, 32), False, {"window": (7, 3)}),
    ((1, 2, 1, 70, 40, 32), True, {"window": (5, -1)}),
    ((2, 2, 2, 33, 47, 64), False, {"softcap": 2.0}),
    ((2, 4, 2, 40, 50, 32), False, {"alibi_slopes": (4,)}),
    ((2, 2, 1, 50, 37, 16), True, {"window": (9, 20), "softcap": 3.0, "alibi_slopes": (2, 2)}),
]


def _option_id(case) -> str:
    _, causal, options = case
    return "-".join([f"{k}{v}".replace(" ", "") for k, v in options.items()] + (["causal"] if causal else []))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("shape, causal, options", OPTION_CASES, ids=[_option_id(c) for c in OPTION_CASES])
def test_flash_attention_options_match_float64(shape, causal, options, dtype):
    """Window, soft cap and ALiBi (top-left aligned, as the causal mask): output, LSE and the three
    gradients against the float64 reference, also where rows see no key."""
    options = {k: alibi_slopes(*v) if k == "alibi_slopes" else v for k, v in options.items()}
    check_against_references(functools.partial(flash_attention, causal=causal, return_lse=True, **options),
                             shape, dtype, causal, **options)


def test_slices_beyond_32_bit_offsets_are_copied(monkeypatch):
    """A layout whose (batch, head) slices 32-bit offsets cannot span is copied to a contiguous
    one first (the limit is lowered here: real cases need tensors of more than 2**31 elements)."""
    from braid.kernels import attention_forward

    monkeypatch.setattr(attention_forward, "INT32_SPAN_LIMIT", 1000)
    check_against_references(functools.partial(flash_attention, causal=True, return_lse=True),
                             (1, 2, 1, 33, 40, 32), torch.float16, causal=True, transposed=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_strided_inputs_and_scale(dtype):
    """(B, S, H, D) memory viewed as (B, H, S, D): the kernels read the strides instead of copying,
    and the gradients come back in the inputs' layout. Also a non-default softmax scale."""
    shape = (2, 4, 2, 40, 70, 64)
    fn = functools.partial(flash_attention, causal=True, softmax_scale=0.3, return_lse=True)
    check_against_references(fn, shape, dtype, causal=True, transposed=True, scale=0.3)
    q, k, v, _, _ = make_inputs(*shape, dtype=dtype, transposed=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves).sum().backward()
    for t in leaves:
        assert t.grad.stride() == t.stride()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_runs_the_kernels(causal):
    """scaled_dot_product_attention with enable_gqa computes what flash_attention does, bit for bit
    (forward and gradients), and agrees with torch's SDPA within float16 accuracy."""
    q, k, v, do, _ = make_inputs(1, 4, 2, 30, 50, 32, torch.float16)
    no_lse = torch.zeros(q.shape[:3], dtype=torch.float64, device=DEVICE)
    mine = run(lambda *t: (scaled_dot_product_attention(*t, is_causal=causal, enable_gqa=True), no_lse),
               q, k, v, do, no_lse)
    flash = run(lambda *t: (flash_attention(*t, causal=causal), no_lse), q, k, v, do, no_lse)
    for a, b in zip(mine, flash):
        assert torch.equal(a, b)
    torch_out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                               enable_gqa=True)
    assert (mine[0].float() - torch_out).abs().max().item() < 4e-3  # a few fp16 ulps at |out| < 2


@pytest.mark.parametrize("shape", [(1, 4, 2, 30, 77, 96), (2, 2, 1, 40, 16, 64)], ids=["gqa-d96", "mqa-d64"])
def test_tensor_descriptors(monkeypatch, shape):
    """BRAID_ATTENTION_TMA=1 streams the tiles through tensor descriptors (K, V in the forward and
    dQ kernels, Q, dO in the dK/dV kernel): same results as the pointer path (boxes out of range
    read zeros where the pointer path masks), the same accuracy; a layout the descriptors cannot
    describe takes the pointer path."""
    calls = []
    monkeypatch.setattr(attention_configs, "descriptor",
                        lambda *a, make=attention_configs.descriptor: calls.append(a) or make(*a))
    q, k, v, do, dlse = make_inputs(*shape, dtype=torch.float16)
    fn = functools.partial(flash_attention, causal=True, return_lse=True)
    monkeypatch.setenv("BRAID_ATTENTION_TMA", "0")
    plain = run(fn, q, k, v, do, dlse)
    assert calls == []
    monkeypatch.setenv("BRAID_ATTENTION_TMA", "1")
    with_tma = run(fn, q, k, v, do, dlse)
    # Two descriptors in the forward, four in the backward; GPUs older than sm_90 have no TMA.
    has_tma = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (9, 0)
    assert len(calls) == (6 if has_tma else 0)
    if DEVICE == "cpu":  # the interpreter does the same arithmetic on both paths
        assert all(torch.equal(a, b) for a, b in zip(plain, with_tma))
    check_against_references(fn, shape, torch.float16, causal=True)
    calls.clear()
    k_strided, v_strided = (torch.stack((t, t), dim=-1)[..., 0] for t in (k, v))  # head dim stride 2
    assert torch.equal(flash_attention(q, k_strided, v_strided, causal=True), plain[0])
    assert calls == []


def test_autocast_casts_like_torch():
    """Under autocast torch runs SDPA in the autocast dtype: so does braid (in the kernels), and
    the gradients reach the float32 leaves as float32."""
    q, k, v, _, _ = make_inputs(1, 2, 2, 20, 33, 32, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast(DEVICE, dtype=torch.float16):
        mine = scaled_dot_product_attention(*leaves, is_causal=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert mine.dtype == theirs.dtype == torch.float16
    assert (mine.float() - theirs.float()).abs().max().item() < 4e-3  # a few fp16 ulps at |out| < 2
    mine.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in leaves)


def test_lse_is_float32_logsumexp_of_scaled_scores():
    """return_lse gives log(sum(exp(scale * q.k))) per row, natural log, in float32."""
    q, k, v, _, _ = make_inputs(1, 2, 2, 20, 35, 32, torch.float32)
    _, lse = flash_attention(q, k, v, softmax_scale=0.5, return_lse=True)
    scores = (q.double() @ k.double().transpose(-2, -1)) * 0.5
    assert lse.dtype == torch.float32
    # LSEs of about 10 in float32 (an ulp: 1e-6), a few roundings per row in the online softmax;
    # a wrong scale, base or maximum is off by O(1).
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=0, atol=1e-5)


# -- fallbacks to torch -------------------------------------------------------------------------
def _both(fn_braid, fn_torch):
    """Calls both; returns their results, or their exceptions' (type, message) when they raise."""
    out = []
    for fn in (fn_braid, fn_torch):
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 -- compared with torch's error below
            out.append((type(e), str(e)))
    return out


def test_attn_mask_and_dropout_fall_back_to_torch():
    """What the kernels do not implement gives torch's result exactly, and torch's RNG stream."""
    q, k, v, _, _ = make_inputs(2, 2, 2, 9, 13, 32, torch.float32)
    mask = torch.rand(9, 13, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
    assert torch.equal(scaled_dot_product_attention(q, k, v, attn_mask=mask),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    bias = torch.randn(9, 13).to(DEVICE)
    assert torch.equal(scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.2),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.2))
    torch.manual_seed(5)
    mine = scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
    torch.manual_seed(5)
    assert torch.equal(mine, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True))


@pytest.mark.parametrize("case", ["head_dim_8", "head_dim_320", "float64", "bfloat16", "3d",
                                  "broadcast_batch", "v_head_dim_differs"])
def test_unsupported_inputs_fall_back_to_torch(case):
    """Inputs outside the kernels' range give torch's result (bitwise: it is torch's call)."""
    shapes = {"head_dim_8": ((1, 2, 5, 8),) * 3, "head_dim_320": ((1, 2, 5, 320),) * 3,
              "3d": ((2, 5, 32),) * 3, "broadcast_batch": ((2, 2, 5, 32), (1, 2, 7, 32), (1, 2, 7, 32)),
              "v_head_dim_differs": ((1, 2, 5, 32), (1, 2, 7, 32), (1, 2, 7, 48))}
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(case, torch.float32)
    if case == "bfloat16" and DEVICE == "cuda":
        pytest.skip("bfloat16 runs in the kernels on a GPU")
    gen = torch.Generator().manual_seed(2)
    default = ((1, 2, 5, 32),) * 3
    q, k, v = (torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes.get(case, default))
    mine, theirs = _both(lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
                         lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    if isinstance(theirs, tuple):  # torch rejects the case: braid must raise the same
        assert mine == theirs
    else:
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("batch, heads", [(4, 2), (2, 4)], ids=["batch", "heads"])
def test_grid_limit_falls_back(monkeypatch, batch, heads):
    """More heads (grid axis y) or batch entries (axis z) than the launch grid holds go to torch
    (the limit is lowered here: the real one, 65535, needs large inputs)."""
    monkeypatch.setattr(attention, "_MAX_GRID_YZ", 3)
    q, k, v, _, _ = make_inputs(batch, heads, heads, 9, 13, 32, torch.float16)
    assert torch.equal(scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_cpu_without_interpreter_falls_back(monkeypatch):
    """On CPU tensors the kernels run only under TRITON_INTERPRET=1; otherwise torch computes."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 32, generator=gen) for _ in range(3))
    assert torch.equal(scaled_dot_product_attention(q, k, v, is_causal=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = reference(q, k, v, True, dtype=torch.float64)
    # torch's float32 attention against float64: values of order 1 rounding at 1e-7 per operation
    # over 9 keys and 32 dims; a wrong mask is off by O(0.1).
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["gqa_not_dividing", "heads_differ_without_gqa", "qk_head_dims_differ",
                                  "batch_mismatch", "dtype_mismatch"])
def test_errors_are_torchs(case):
    """Bad arguments raise what torch raises, with torch's message."""
    gen = torch.Generator().manual_seed(4)

    def t(*shape, dtype=torch.float16):
        return torch.randn(shape, generator=gen).to(DEVICE, dtype)

    q, k, v = t(1, 6, 8, 32), t(1, 4, 8, 32), t(1, 4, 8, 32)
    kwargs = {"enable_gqa": True}
    if case == "heads_differ_without_gqa":
        kwargs = {}
    elif case == "qk_head_dims_differ":
        k, v = t(1, 6, 8, 16), t(1, 6, 8, 32)
    elif case == "batch_mismatch":  # batch 1 would broadcast
        q, k, v = t(2, 6, 8, 32), t(3, 6, 8, 32), t(3, 6, 8, 32)
    elif case == "dtype_mismatch":
        k, v = t(1, 6, 8, 32, dtype=torch.float32), t(1, 6, 8, 32)
    mine, theirs = _both(lambda: scaled_dot_product_attention(q, k, v, **kwargs),
                         lambda: F.scaled_dot_product_attention(q, k, v, **kwargs))
    assert isinstance(theirs, tuple), "torch accepted the case: it tests nothing"
    assert mine == theirs


def test_flash_attention_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 6, 8, 32, generator=gen)
    with pytest.raises(ValueError, match="must divide"):
        flash_attention(q, torch.randn(1, 4, 8, 32), torch.randn(1, 4, 8, 32))
    with pytest.raises(ValueError, match="4-D"):
        flash_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="same shape"):
        flash_attention(q, q, q[:, :, :5])


def test_fallback_logged_once_at_debug(monkeypatch, caplog):
    monkeypatch.setattr(attention, "_logged_reasons", set())
    q = torch.randn(1, 2, 4, 32).to(DEVICE)
    mask = torch.zeros(4, 4).to(DEVICE)
    with caplog.at_level(logging.DEBUG, logger="braid.kernels.attention"):
        for _ in range(3):
            scaled_dot_product_attention(q, q, q, attn_mask=mask)
    records = [r for r in caplog.records if r.name == "braid.kernels.attention"]
    assert len(records) == 1
    assert records[0].levelno == logging.DEBUG and "attn_mask" in records[0].getMessage()


# -- GPU only -----------------------------------------------------------------------------------
GPU_SHAPES = [(2, 16, 16, 1024, 1024, 128), (2, 16, 4, 1000, 1536, 64), (1, 8, 1, 2048, 777, 128),
              (4, 8, 8, 511, 511, 256)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["x".join(map(str, s)) for s in GPU_SHAPES])
@pytest.mark.gpu
@needs_cuda
def test_gpu_real_sizes_against_float32(shape, causal, dtype):
    """Real sizes on the GPU; the truth is float32 here (float64 attention would be slow), still
    far more accurate than the half types under test. The yardstick is torch's SDPA in `dtype`."""
    check_real_size(shape, causal, dtype)


@pytest.mark.gpu
@needs_cuda
def test_gpu_autotuned(monkeypatch):
    """The autotuner's choice (every candidate compiled and timed, about a minute and a half; the
    other tests launch one fixed configuration) is as accurate, on a ragged causal length with GQA."""
    monkeypatch.setenv("BRAID_ATTENTION_AUTOTUNE", "1")
    check_real_size((2, 8, 2, 1000, 1000, 64), True, torch.bfloat16)


def test_fixed_launch_without_the_autotuner(monkeypatch):
    """BRAID_ATTENTION_AUTOTUNE=0 takes each kernel's fixed tiles, or the first of its search space
    that fits the head dim; the interpreter always has its own; with the autotuner, none."""
    q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention_configs.fixed_launch("forward", q, 128) == attention_configs.INTERPRETER_FORWARD
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("BRAID_ATTENTION_AUTOTUNE", "1")
    assert attention_configs.fixed_launch("dq", q, 128) is None
    monkeypatch.setenv("BRAID_ATTENTION_AUTOTUNE", "0")
    assert attention_configs.fixed_launch("forward", q, 128) == {"BLOCK_M": 128, "BLOCK_N": 64,
                                                                 "num_warps": 8, "num_stages": 3}
    assert attention_configs.fixed_launch("delta", q, 128) == {"BLOCK_M": 64, "num_warps": 8, "num_stages": 3}
    # At d = 256 a 128-row tile would spill its accumulators: the first of the forward's search
    # space (64 x 32) is taken.
    wide = torch.empty(1, 1, 1, 256, dtype=torch.bfloat16)
    assert attention_configs.fixed_launch("forward", wide, 256) == {"BLOCK_M": 64, "BLOCK_N": 32,
                                                                    "num_warps": 4, "num_stages": 2}


def test_autotuner_choices_name_each_kernel_and_key(monkeypatch):
    """What the attention benchmark prints of the autotuner: one line per kernel and key chosen."""
    from braid.kernels import attention_backward, attention_forward

    for tuner in (*attention_forward.AUTOTUNERS.values(), *attention_backward.AUTOTUNERS.values()):
        monkeypatch.setattr(tuner, "cache", {})
    assert attention.autotuner_choices() == []
    monkeypatch.setattr(attention_forward.AUTOTUNERS["forward"], "cache",
                        {(1024, 128, True): attention_configs.FIXED_FORWARD})
    monkeypatch.setattr(attention_backward.AUTOTUNERS["dq"], "cache", {(64,): attention_configs.FIXED_DQ})
    assert attention.autotuner_choices() == [f"forward (1024, 128, True): {attention_configs.FIXED_FORWARD}",
                                             f"dq (64,): {attention_configs.FIXED_DQ}"]


def check_real_size(shape, causal, dtype):
    """Braid's output, LSE and gradients at ``shape`` against float32 attention, with torch's SDPA
    in ``dtype`` as the yardstick of the rounding."""
    q, k, v, do, _ = make_inputs(*shape, dtype=dtype)
    # torch's SDPA does not return the LSE: the loss has no LSE term here (the small-shape tests
    # cover its gradient), and braid's LSE is compared with the float32 truth directly.
    no_dlse = torch.zeros(q.shape[:3], dtype=torch.float64, device=DEVICE)
    got = run(lambda *t: flash_attention(*t, causal=causal, return_lse=True), q, k, v, do, no_dlse)
    truth = run(lambda *t: reference(*t, causal, None, torch.float32), q, k, v, do, no_dlse)
    same = run(lambda *t: (F.scaled_dot_product_attention(*t, is_causal=causal, enable_gqa=True), no_dlse),
               q, k, v, do, no_dlse)
    mass = key_mass(q, k, causal, None)
    for i, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        check_close(name, got[i], same[i], truth[i].double(), dtype, mass)
    # Both LSEs are float32; braid's differs from the truth by the float32 accumulation order only.
    torch.testing.assert_close(got[1], truth[1], rtol=0, atol=1e-4 * max(1.0, truth[1].abs().max().item()))


@pytest.mark.gpu
@needs_cuda
def test_gpu_deterministic():
    """Forward and backward are bitwise reproducible: every output element is written by one
    program in a fixed order, no atomics."""
    q, k, v, do, dlse = make_inputs(2, 16, 4, 1500, 1500, 128, torch.bfloat16)
    first = run(lambda *t: flash_attention(*t, causal=True, return_lse=True), q, k, v, do, dlse)
    second = run(lambda *t: flash_attention(*t, causal=True, return_lse=True), q, k, v, do, dlse)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
def test_gpu_bfloat16_small_shapes():
    """bfloat16 on the small shapes (the interpreter cannot run bfloat16 dot products)."""
    for shape in SHAPES:
        for causal in (False, True):
            fn = functools.partial(flash_attention, causal=causal, return_lse=True)
            check_against_references(fn, shape, torch.bfloat16, causal)
