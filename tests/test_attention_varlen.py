"""flash_attention_varlen (packed sequences) against float64 references built per sequence.

Sequences of lengths 0, 1 and up to a few hundred, causal (aligned bottom-right) and not, windows,
soft cap, ALiBi and GQA: output, LSE and the three gradients. Also: packed equals the dense kernel
run on each sequence alone, bitwise repeatable results, rows that see no key, the descriptor
path, the fallback to torch and the errors for bad arguments. The reference is test_attention's
textbook attention, given each sequence's alignment (query row i at key position i + Sk - Sq).

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on small
head dims in float16 and float32; with one, the same cases run on the GPU, and the tests marked
gpu add bfloat16 and real sizes.
"""
from __future__ import annotations

import functools

import pytest
import torch
from braid.kernels import attention_configs, flash_attention, flash_attention_varlen
from test_attention import DEVICE, alibi_slopes, check_close, key_mass, needs_cuda, reference, run


def cumulative(lengths: list[int]) -> torch.Tensor:
    """int32 cu_seqlens of `lengths`."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=DEVICE)


def make_packed(lens_q, lens_k, heads, kv_heads, head_dim, dtype, seed=0):
    """Packed q (Tq, H, D), k, v (Tk, Hkv, D) of `dtype`, float64 upstream gradients for the output
    (Tq, H, D) and the LSE (H, Tq), and the two cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)

    def tensor(*shape, dtype=dtype):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=DEVICE, dtype=dtype)

    total_q, total_k = sum(lens_q), sum(lens_k)
    q = tensor(total_q, heads, head_dim)
    k, v = tensor(total_k, kv_heads, head_dim), tensor(total_k, kv_heads, head_dim)
    do = tensor(total_q, heads, head_dim, dtype=torch.float64)
    dlse = tensor(heads, total_q, dtype=torch.float64)
    return q, k, v, do, dlse, cumulative(lens_q), cumulative(lens_k)


def sequences(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """(b, q rows, k rows) of each packed sequence, as slices."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return [(b, slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])) for b in range(len(bq) - 1)]


def packed_reference(q, k, v, cu_q, cu_k, causal, scale=None, dtype=None, alibi_slopes=None, **options):
    """The reference on each sequence, (1, H, S, D) with bottom-right alignment, packed back into
    (Tq, H, D) outputs and an (H, Tq) LSE."""
    outs, lses = [], []
    for b, rows, keys in sequences(cu_q, cu_k):
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        q_b, k_b, v_b = (t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys)))
        shift = (keys.stop - keys.start) - (rows.stop - rows.start)
        out, lse = reference(q_b, k_b, v_b, causal, scale, dtype, alibi_slopes=slopes, shift=shift, **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def packed_key_mass(q, k, cu_q, cu_k, causal, scale=None, alibi_slopes=None, **options) -> float:
    """test_attention.key_mass, the largest over the sequences."""
    masses = [1.0]
    for b, rows, keys in sequences(cu_q, cu_k):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue  # no probabilities
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        shift = (keys.stop - keys.start) - (rows.stop - rows.start)
        masses.append(key_mass(q[rows].transpose(0, 1)[None], k[keys].transpose(0, 1)[None], causal, scale,
                               alibi_slopes=slopes, shift=shift, **options))
    return max(masses)


def varlen(cu_q, cu_k, lens_q, lens_k, **kwargs):
    """flash_attention_varlen(q, k, v) with the rest bound, returning (out, lse)."""
    return functools.partial(flash_attention_varlen, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), return_lse=True, **kwargs)


def check_packed(lens_q, lens_k, heads, kv_heads, head_dim, dtype, causal, truth_dtype=torch.float64,
                 **options):
    """Output, LSE and dq/dk/dv of flash_attention_varlen against the reference in `truth_dtype`,
    with the reference in `dtype` as the yardstick (test_attention.check_close's rule)."""
    q, k, v, do, dlse, cu_q, cu_k = make_packed(lens_q, lens_k, heads, kv_heads, head_dim, dtype)
    got = run(varlen(cu_q, cu_k, lens_q, lens_k, causal=causal, **options), q, k, v, do, dlse)
    truth = run(lambda *t: packed_reference(*t, cu_q, cu_k, causal, None, truth_dtype, **options),
                q, k, v, do, dlse)
    same = run(lambda *t: packed_reference(*t, cu_q, cu_k, causal, **options), q, k, v, do, dlse)
    same_lse = packed_reference(q, k, v, cu_q, cu_k, causal, None, torch.float32, **options)[1]
    assert got[0].dtype == dtype and got[0].shape == q.shape
    assert got[1].dtype == torch.float32 and got[1].shape == (heads, q.shape[0])
    mass = packed_key_mass(q, k, cu_q, cu_k, causal, **options)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert got[i].shape == truth[i].shape, name
        check_close(name, got[i], same_lse if name == "lse" else same[i], truth[i].double(),
                    torch.float32 if name == "lse" else dtype, mass)


# Lengths: every sequence alone in its tiles; 0 and 1 among them, 130 spanning several tiles of the
# interpreter's 32 x 16 (forward, dQ) and 16 x 32 (dK/dV) and ending ragged. SELF has Sq == Sk per
# sequence; CROSS has Sq > Sk (3 > 0, 20 > 0, 50 > 33: with causal the first rows see no key) and
# Sq < Sk, where the bottom-right alignment differs from the top-left one.
SELF = ([0, 1, 37, 5, 130, 1, 16],) * 2
CROSS = ([3, 0, 20, 1, 50, 7], [10, 4, 0, 1, 33, 7])
# (lengths, heads, kv heads, head dim, dtype, causal, options)
CASES = [
    (SELF, 2, 2, 32, torch.float32, False, {}),
    (SELF, 2, 1, 16, torch.float16, True, {}),
    (CROSS, 2, 1, 32, torch.float32, True, {}),
    (CROSS, 2, 2, 64, torch.float16, False, {}),
    (SELF, 2, 1, 32, torch.float32, True, {"window": (8, -1)}),
    (CROSS, 2, 2, 32, torch.float32, False, {"window": (4, 7)}),
    (SELF, 2, 2, 16, torch.float32, True, {"softcap": 2.0}),
    (CROSS, 2, 2, 32, torch.float32, False, {"alibi_slopes": (6, 2)}),
    (CROSS, 4, 1, 32, torch.float16, True, {"window": (20, 0), "softcap": 3.0, "alibi_slopes": (4,)}),
    (([300, 0, 45], [300, 0, 45]), 1, 1, 16, torch.float32, True, {"window": (70, -1)}),
]


def _case_id(case) -> str:
    (lens_q, _), heads, kv_heads, head_dim, dtype, causal, options = case
    name = "self" if case[0] is SELF else "cross" if case[0] is CROSS else f"max{max(lens_q)}"
    parts = [name, f"h{heads}x{kv_heads}", f"d{head_dim}", str(dtype).replace("torch.float", "fp"),
             "causal" if causal else "full"]
    return "-".join(parts + [f"{k}{v}".replace(" ", "") for k, v in options.items()])


def _options(options: dict) -> dict:
    """The case's options with ALiBi slopes made from their shape."""
    return {k: alibi_slopes(*v) if k == "alibi_slopes" else v for k, v in options.items()}


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_varlen_matches_float64(case):
    """Output, LSE and all three gradients (through the output and the LSE) of packed sequences."""
    (lens_q, lens_k), heads, kv_heads, head_dim, dtype, causal, options = case
    check_packed(lens_q, lens_k, heads, kv_heads, head_dim, dtype, causal, **_options(options))


@pytest.mark.parametrize("lengths, causal, options", [
    (([17, 1, 64, 0, 33],) * 2, True, {"window": (12, 3), "softcap": 4.0, "alibi_slopes": (2,)}),
    (([9, 40, 1], [31, 2, 0]), False, {}),
], ids=["causal-window-softcap-alibi", "cross-full"])
def test_varlen_equals_dense_per_sequence(lengths, causal, options):
    """Each packed sequence gets what the dense kernel computes for it alone (forward, LSE and
    gradients): the tiles start at each sequence's first row in both. Alignments agree when Sq == Sk
    (the causal case) or nothing depends on them (no mask, no bias). Bitwise in the interpreter; a
    GPU compiles the two variants apart, so there one rounding of the result is allowed."""
    lens_q, lens_k = lengths
    options = _options(options)
    q, k, v, do, dlse, cu_q, cu_k = make_packed(lens_q, lens_k, 2, 1, 32, torch.float16)
    packed = run(varlen(cu_q, cu_k, lens_q, lens_k, causal=causal, **options), q, k, v, do, dlse)
    for b, rows, keys in sequences(cu_q, cu_k):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue  # the dense kernels take no empty sequences
        dense = run(lambda *t: flash_attention(*(x.transpose(0, 1)[None] for x in t), causal=causal,
                                               return_lse=True, **options),
                    q[rows], k[keys], v[keys], do[rows].transpose(0, 1)[None], dlse[:, rows][None])
        mine = [packed[0][rows], packed[1][:, rows], packed[2][rows], packed[3][keys], packed[4][keys]]
        theirs = [dense[0][0].transpose(0, 1), dense[1][0], dense[2], dense[3], dense[4]]
        for name, a, c in zip(("out", "lse", "dq", "dk", "dv"), mine, theirs):
            if DEVICE == "cpu":
                assert torch.equal(a, c), f"sequence {b}: {name}"
            else:
                atol = torch.finfo(a.dtype).eps * c.abs().max().item()
                torch.testing.assert_close(a, c, rtol=0, atol=atol, msg=f"sequence {b}: {name}")


def test_rows_and_keys_that_see_nothing():
    """A query row that sees no key gets output 0, LSE -inf and dq 0; a key no row sees gets dk and
    dv 0; nothing is NaN. Sequence 0 (rows 0..3) has no keys. Sequence 1 (rows 4..6, 2 keys) is
    aligned bottom-right: its row 0 stands at key position -1, before every key, under the causal
    mask and under the window (0, 0) alike. In sequence 2 (2 rows, 6 keys) the window (0, 0) shows
    each row only the key at its own position, 4 + i: keys 0..3 are seen by nobody."""
    lens_q, lens_k = [4, 3, 2], [0, 2, 6]
    q, k, v, do, dlse, cu_q, cu_k = make_packed(lens_q, lens_k, 2, 2, 16, torch.float32)
    causal = run(varlen(cu_q, cu_k, lens_q, lens_k, causal=True), q, k, v, do, dlse)
    windowed = run(varlen(cu_q, cu_k, lens_q, lens_k, window=(0, 0)), q, k, v, do, dlse)
    no_key = [0, 1, 2, 3, 4]
    for out, lse, dq, dk, dv in (causal, windowed):
        assert all(not t.isnan().any() for t in (out, lse, dq, dk, dv))
        assert (out[no_key] == 0).all() and (dq[no_key] == 0).all()
        assert (lse[:, no_key] == float("-inf")).all() and torch.isfinite(lse[:, 5:]).all()
    _, _, _, dk, dv = windowed
    unseen = [2, 3, 4, 5]  # keys 0..3 of sequence 2
    assert (dk[unseen] == 0).all() and (dv[unseen] == 0).all() and (dk[6:] != 0).all(dim=-1).any()


def test_varlen_deterministic():
    """Forward and backward are bitwise reproducible: every output element is written by one
    program in a fixed order, no atomics (the GPU test below does it at real sizes)."""
    (lens_q, lens_k), heads, kv_heads, head_dim = CROSS, 2, 1, 32
    q, k, v, do, dlse, cu_q, cu_k = make_packed(lens_q, lens_k, heads, kv_heads, head_dim, torch.float16)
    fn = varlen(cu_q, cu_k, lens_q, lens_k, causal=True, window=(9, -1), alibi_slopes=alibi_slopes(heads))
    first, second = run(fn, q, k, v, do, dlse), run(fn, q, k, v, do, dlse)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_tensor_descriptors_on_packed_tokens(monkeypatch):
    """BRAID_ATTENTION_TMA=1 on packed tokens: the descriptors cover all tokens, so the tiles at a
    sequence's end read the next sequence's rows, which the masks must hide. Same results as the
    pointer path (the interpreter does the same arithmetic on both)."""
    calls = []
    monkeypatch.setattr(attention_configs, "descriptor",
                        lambda *a, make=attention_configs.descriptor: calls.append(a) or make(*a))
    (lens_q, lens_k), heads, kv_heads, head_dim = CROSS, 2, 1, 32
    q, k, v, do, dlse, cu_q, cu_k = make_packed(lens_q, lens_k, heads, kv_heads, head_dim, torch.float16)
    fn = varlen(cu_q, cu_k, lens_q, lens_k, causal=True, window=(6, 2))
    monkeypatch.setenv("BRAID_ATTENTION_TMA", "0")
    plain = run(fn, q, k, v, do, dlse)
    monkeypatch.setenv("BRAID_ATTENTION_TMA", "1")
    with_tma = run(fn, q, k, v, do, dlse)
    has_tma = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (9, 0)
    assert len(calls) == (6 if has_tma else 0)
    if DEVICE == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(plain, with_tma))
    else:
        check_packed(lens_q, lens_k, heads, kv_heads, head_dim, torch.float16, True, window=(6, 2))


def test_fallback_to_torch_matches_float64():
    """Inputs the kernels do not take (float64 here, on any device) are computed with torch one
    sequence at a time, with the same alignment, options and empty sequences."""
    (lens_q, lens_k), options = CROSS, {"window": (5, 1), "softcap": 2.5, "alibi_slopes": alibi_slopes(6, 2)}
    check_packed(lens_q, lens_k, 2, 1, 8, torch.float64, True, **options)


def test_lse_is_natural_log_per_head_and_token():
    """return_lse gives log(sum(exp(scale * q.k))) over each row's keys, shape (heads, total_q)
    float32, as FlashAttention returns it."""
    lens = [5, 40, 12]
    q, k, v, _, _, cu_q, cu_k = make_packed(lens, lens, 3, 3, 32, torch.float32)
    _, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, softmax_scale=0.5, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (3, sum(lens))
    scores = [torch.einsum("qhd,khd->hqk", q[r].double(), k[c].double()) * 0.5
              for _, r, c in sequences(cu_q, cu_k)]
    expected = torch.cat([torch.logsumexp(s, -1) for s in scores], dim=1)
    # LSEs of about 10 in float32 (an ulp: 1e-6), a few roundings per row in the online softmax;
    # a wrong scale, base, sequence or maximum is off by O(1).
    torch.testing.assert_close(lse.double(), expected, rtol=0, atol=1e-5)


# -- bad arguments ------------------------------------------------------------------------------
def _bad_arguments(case: str) -> tuple[tuple, dict]:
    """flash_attention_varlen's arguments for one bad case: a valid call with one thing broken."""
    lens = [3, 0, 5]
    q, k, v, _, _, cu_q, cu_k = make_packed(lens, lens, 4, 2, 32, torch.float32)
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 5,
            "max_seqlen_k": 5}
    broken = {
        "cu_seqlens_int64": {"cu_seqlens_q": cu_q.long()},
        "cu_seqlens_2d": {"cu_seqlens_k": cu_k[None]},
        "cu_seqlens_lengths_differ": {"cu_seqlens_k": cu_k[:3]},
        "cu_seqlens_decreasing": {"cu_seqlens_q": torch.tensor([0, 5, 3, 8], dtype=torch.int32).to(DEVICE)},
        "cu_seqlens_not_from_0": {"cu_seqlens_k": cu_k + 1},
        "cu_seqlens_end_not_total": {"cu_seqlens_q": cumulative([3, 0, 4])},
        "max_seqlen_too_small": {"max_seqlen_q": 4},
        "max_seqlen_negative": {"max_seqlen_k": -1},
        "qk_head_dims_differ": {"k": k[..., :16], "v": v[..., :16]},
        "kv_heads_do_not_divide": {"k": k[:, :1].expand(-1, 3, -1), "v": v[:, :1].expand(-1, 3, -1)},
        "v_shape_differs": {"v": v[:, :1]},
        "dtype_differs": {"k": k.half()},
        "q_not_3d": {"q": q[None]},
        "window_below_minus_1": {"window": (-2, 0)},
        "window_not_a_pair": {"window": 3},
        "softcap_negative": {"softcap": -1.0},
        "alibi_wrong_shape": {"alibi_slopes": alibi_slopes(2)},
        "alibi_float64": {"alibi_slopes": alibi_slopes(4).double()},
    }[case]
    return args, broken


# Each case and the argument its error must name.
BAD_CASES = {
    "cu_seqlens_int64": "cu_seqlens_q", "cu_seqlens_2d": "cu_seqlens_k",
    "cu_seqlens_lengths_differ": "cu_seqlens_k", "cu_seqlens_decreasing": "cu_seqlens_q",
    "cu_seqlens_not_from_0": "cu_seqlens_k",
    "cu_seqlens_end_not_total": "cu_seqlens_q", "max_seqlen_too_small": "max_seqlen_q",
    "max_seqlen_negative": "max_seqlen_k", "qk_head_dims_differ": "k", "kv_heads_do_not_divide": "kv head",
    "v_shape_differs": "v", "dtype_differs": "k", "q_not_3d": "q", "window_below_minus_1": "window",
    "window_not_a_pair": "window", "softcap_negative": "softcap", "alibi_wrong_shape": "alibi_slopes",
    "alibi_float64": "alibi_slopes",
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_arguments_raise_value_error(case):
    """Every bad argument is caught before a kernel runs, as a ValueError that names it."""
    args, broken = _bad_arguments(case)
    with pytest.raises(ValueError, match=rf"flash_attention_varlen: .*\b{BAD_CASES[case]}\b"):
        flash_attention_varlen(**{**args, **broken})


def test_cu_seqlens_written_in_place_are_checked_again():
    """The values of a cu_seqlens pair are read once and the check reused while the same tensors
    come back unchanged; writing into one of them in place makes the next call check it again."""
    args, _ = _bad_arguments("cu_seqlens_int64")
    flash_attention_varlen(**args)
    args["cu_seqlens_k"][-1] += 1
    with pytest.raises(ValueError, match="cu_seqlens_k must end at the token count of k"):
        flash_attention_varlen(**args)


@pytest.mark.parametrize("case, name", [
    ({"window": (3, -5)}, "window"), ({"softcap": float("nan")}, "softcap"),
    ({"alibi_slopes": "slopes"}, "alibi_slopes"), ({"alibi_slopes": (3,)}, "alibi_slopes"),
], ids=["window", "softcap_nan", "alibi_not_a_tensor", "alibi_wrong_heads"])
def test_dense_options_raise_value_error(case, name):
    """flash_attention checks the same options the same way."""
    q = torch.randn(2, 4, 8, 32).to(DEVICE)
    case = {k: alibi_slopes(*v) if k == "alibi_slopes" and isinstance(v, tuple) else v
            for k, v in case.items()}
    with pytest.raises(ValueError, match=rf"flash_attention: .*\b{name}\b"):
        flash_attention(q, q, q, **case)


def test_qk_head_dims_differ_is_a_value_error_for_flash_attention():
    """q with head dim 32 and k, v with 16: a ValueError before anything runs (the SDPA drop-in
    raises torch's own error: test_attention.test_errors_are_torchs)."""
    q, kv = torch.randn(1, 2, 8, 32).to(DEVICE), torch.randn(1, 2, 8, 16).to(DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        flash_attention(q, kv, kv)


# -- GPU only -----------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_gpu_bfloat16_varlen(case):
    """bfloat16 on the small cases (the interpreter cannot run bfloat16 dot products)."""
    (lens_q, lens_k), heads, kv_heads, head_dim, _, causal, options = case
    check_packed(lens_q, lens_k, heads, kv_heads, head_dim, torch.bfloat16, causal, **_options(options))


def long_tailed_lengths(total: int, seed: int) -> list[int]:
    """Document lengths drawn from a long-tailed (log-normal) distribution summing to `total`."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(max(1, int(torch.empty(1).log_normal_(6.0, 1.2, generator=gen).item())))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("options", [{}, {"window": (256, -1)}, {"softcap": 30.0, "alibi_slopes": (16,)}],
                         ids=["causal", "causal-window", "causal-softcap-alibi"])
def test_gpu_real_sizes_against_float32(options):
    """Long-tailed packed documents, 8192 tokens, GQA 16/4, head dim 128, bfloat16; the truth in
    float32 (float64 attention would be slow), the yardstick the reference in bfloat16."""
    lengths = long_tailed_lengths(8192, seed=1)
    check_packed(lengths, lengths, 16, 4, 128, torch.bfloat16, True, truth_dtype=torch.float32,
                 **_options(options))


@pytest.mark.gpu
@needs_cuda
def test_gpu_varlen_deterministic():
    """Two runs at real sizes are bitwise equal, forward and backward."""
    lengths = long_tailed_lengths(16384, seed=2)
    q, k, v, do, dlse, cu_q, cu_k = make_packed(lengths, lengths, 16, 4, 128, torch.bfloat16)
    fn = varlen(cu_q, cu_k, lengths, lengths, causal=True, window=(1024, -1))
    first, second = run(fn, q, k, v, do, dlse), run(fn, q, k, v, do, dlse)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
