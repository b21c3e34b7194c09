"""The CPU compression kernels against the pure-torch references (tests/helpers/compression_reference.py).

Quantization is compared bit for bit (payload bytes, residual, decoded values) for float32,
bfloat16 and float16 inputs at sizes that are not multiples of the block, in the plain and the
chunked (all-reduce) layout. Top-k is checked by its defining property, stochastic rounding by
its mean, error feedback by telescoping.
"""

import pickle

import pytest
import torch
from braid import comm
from braid.comm import _C
from helpers import compression_reference as ref

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (0, 1, 7, 127, 129, 256, 1000, 4099)


def _input(count: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(count, generator=g) * torch.rand(count, generator=g).mul(8).exp2()
    )  # blocks of varied scale
    if count > 3:
        x[count // 2 : count // 2 + 3] = 0  # exact zeros, and an all-zero tail block when small
    return x.to(dtype)


@pytest.mark.parametrize("bits,block", [(8, 256), (8, 64), (4, 128), (4, 6)])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_matches_reference(bits, block, dtype, stochastic):
    for count in SIZES:
        x = _input(count, dtype, seed=count)
        for with_residual in (False, True):
            res = torch.randn(count) * 0.01 if with_residual else None
            expected, expected_res = ref.quantize(x, res, bits, block, stochastic, seed=1234 + count)
            mine = res.clone() if res is not None else None
            got = _C.quantize(x, mine, bits, block, stochastic, 1234 + count)
            what = f"count {count} residual {with_residual}"
            assert torch.equal(got, expected), what
            if res is not None:
                assert torch.equal(mine, expected_res), what
            out = torch.full((count,), 99.0, dtype=dtype)
            _C.dequantize(got, bits, block, out)
            assert torch.equal(out, ref.dequantize(expected, count, bits, block, dtype)), what


@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128)])
@pytest.mark.parametrize("nchunks", [1, 3, 4])
def test_chunked_layout_matches_reference(bits, block, nchunks):
    """The all-reduce layout: one padded chunk per rank, elements numbered globally for the RNG."""
    for count in (1, 500, 1001, 3000):
        per_chunk = (count + nchunks - 1) // nchunks
        chunk = max(block, (per_chunk + block - 1) // block * block)
        x = _input(count, torch.float32, seed=count)
        res = torch.randn(count) * 0.01
        expected, expected_res = ref.quantize(x, res, bits, block, True, 7, chunk, nchunks)
        mine = res.clone()
        got = _C.quantize(x, mine, bits, block, True, 7, 0, chunk, nchunks)
        assert torch.equal(got, expected)
        assert torch.equal(mine, expected_res)
        assert got.numel() == nchunks * _C.quantized_bytes(chunk, bits, block)
        out = torch.empty(count)
        _C.dequantize(got, bits, block, out, chunk)
        assert torch.equal(out, ref.dequantize(expected, count, bits, block, torch.float32, chunk))


@pytest.mark.parametrize("bits,block", [(8, 5), (8, 63), (4, 6), (4, 128)])
def test_stochastic_streams_at_odd_and_wrapping_indices(bits, block):
    """Blocks that open on an odd element index (odd blocks, odd index bases) and pair indices that
    cross 2^32 draw the same dithers as the reference, with and without error feedback."""
    for index_base in (1, 3, (1 << 33) - 7, (1 << 33) - 6):
        for count in (1, 2, 9, 130, 515):
            x = _input(count, torch.float32, seed=count)
            res = torch.randn(count) * 0.01
            expected, expected_res = ref.quantize(x, res, bits, block, True, 11, index_base=index_base)
            mine = res.clone()
            got = _C.quantize(x, mine, bits, block, True, 11, index_base)
            what = f"index_base {index_base} count {count}"
            assert torch.equal(got, expected), what
            assert torch.equal(mine, expected_res), what


def test_dequantize_accumulate_adds_in_float32():
    x = _input(1000, torch.float32)
    q = _C.quantize(x, None, 8, 100, False, 0)
    acc = torch.randn(1000)
    expected = acc + ref.dequantize(q, 1000, 8, 100, torch.float32)
    _C.dequantize_accumulate(q, 8, 100, acc)
    assert torch.equal(acc, expected)


def test_wire_size_is_the_format():
    """values (1 byte or half a byte each) padded to 4 bytes, then 4 bytes of scale per block."""
    for count in (0, 1, 255, 256, 257, 1001):
        assert _C.quantized_bytes(count, 8, 256) == -(-count // 4) * 4 + 4 * -(-count // 256)
        assert _C.quantized_bytes(count, 4, 128) == -(-((count + 1) // 2) // 4) * 4 + 4 * -(-count // 128)
        assert _C.quantize(torch.randn(count), None, 4, 128, True, 0).numel() == _C.quantized_bytes(
            count, 4, 128
        )
    big = 1 << 20
    assert 4 * big / _C.quantized_bytes(big, 8, 256) >= 3.9
    assert 4 * big / _C.quantized_bytes(big, 4, 128) >= 7.5


def test_stochastic_rounding_is_reproducible_and_seeded():
    x = _input(3000, torch.float32)
    a = _C.quantize(x, None, 8, 256, True, 42)
    assert torch.equal(a, _C.quantize(x, None, 8, 256, True, 42))
    assert not torch.equal(a, _C.quantize(x, None, 8, 256, True, 43))
    # Element i draws from (seed, index_base + i): a shifted index base is another stream.
    assert not torch.equal(a, _C.quantize(x, None, 8, 256, True, 42, 1 << 33))


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    """Mean decoded value over many seeds tends to the input; round-to-nearest does not.

    Each element's stochastic error lies within one quantization step s and has a standard
    deviation of at most s / 2, so the mean over T seeds deviates by more than 6 s / (2 sqrt(T))
    with probability below 1e-8 per element.
    """
    block, trials = 64, 400
    g = torch.Generator().manual_seed(5)
    x = torch.rand(4096, generator=g) * 2 - 1
    x.view(-1, block)[:, 0] = 1.0  # every block has absmax 1: step s = 1 / qmax everywhere
    step = 1.0 / (127 if bits == 8 else 7)
    total = torch.zeros(4096, dtype=torch.float64)
    out = torch.empty(4096)
    for seed in range(trials):
        _C.dequantize(_C.quantize(x, None, bits, block, True, seed), bits, block, out)
        total += out
    bias = (total / trials - x).abs().max().item()
    assert bias < 6 * step / (2 * trials**0.5)
    _C.dequantize(_C.quantize(x, None, bits, block, False, 0), bits, block, out)
    assert (out - x).abs().max().item() > 0.3 * step  # nearest rounding keeps its error


def test_error_feedback_telescopes_through_quantization():
    """sum of decoded payloads + final residual == sum of inputs (float32 rounding only)."""
    g = torch.Generator().manual_seed(3)
    res = torch.zeros(5000)
    sent_total = torch.zeros(5000, dtype=torch.float64)
    grad_total = torch.zeros(5000, dtype=torch.float64)
    out = torch.empty(5000)
    for step in range(30):
        grad = torch.randn(5000, generator=g)
        grad_total += grad
        q = _C.quantize(grad, res, 4, 128, True, step)
        _C.dequantize(q, 4, 128, out)
        sent_total += out
    err = (sent_total + res - grad_total).abs().max().item()
    assert err < 1e-4  # 30 steps of float32 rounding of values of order 10
    assert res.abs().max().item() < 1.0  # the residual stays bounded instead of growing


def test_error_feedback_kernel_matches_reference():
    for dtype in FLOATS:
        x = _input(1001, dtype)
        res = torch.randn(1001)
        sent = torch.randn(1001)
        sent[:3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
        x[3] = float("inf")
        expected = (x.float() + res) - sent
        expected[:4] = 0  # non-finite residual entries are kept as 0
        _C.error_feedback(x, res, sent)
        assert torch.equal(res, expected)
        expected = x.float() + res
        _C.error_feedback(x, res, None)
        assert torch.equal(res, expected)


@pytest.mark.parametrize("out_dtype", (torch.bfloat16, torch.float16))
def test_cast_kernel_matches_reference(out_dtype):
    """sent = round(x + residual) and residual = (x + residual) - sent, bit for bit as torch
    computes them, including values that overflow float16, subnormals, infinities and NaN (whose
    residual entries are kept as 0)."""
    for dtype in FLOATS:
        for count in SIZES:
            x = _input(count, dtype, seed=count)
            if count >= 8:
                x[:6] = torch.tensor([7e4, -1e-6, 3e-8, float("inf"), float("nan"), -0.0]).to(dtype)
            res = torch.randn(count) * 0.01
            res[:6] = 0  # the special values reach the rounding as they are
            full = x.float() + res
            expected = full.to(out_dtype)
            sent = torch.empty(count, dtype=out_dtype)
            _C.cast(x, res, sent)
            exact = dict(rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(sent, expected, **exact)
            kept = full - expected.float()
            kept = torch.where(torch.isfinite(kept), kept, torch.zeros_like(kept))  # non-finite: 0
            torch.testing.assert_close(res, kept, **exact)
            plain = torch.empty(count, dtype=out_dtype)
            _C.cast(x, None, plain)
            torch.testing.assert_close(plain, x.float().to(out_dtype), **exact)


def _check_top_k(x: torch.Tensor, k: int, values, indices) -> None:
    k = min(k, x.numel())
    assert values.numel() == indices.numel() == k
    idx = indices.long()
    assert torch.all(idx[1:] > idx[:-1]), "indices ascending and distinct"
    assert torch.equal(values, x.float()[idx])
    if 0 < k < x.numel():
        mask = torch.ones(x.numel(), dtype=torch.bool)
        mask[idx] = False
        assert values.abs().min() >= x.float()[mask].abs().max()


@pytest.mark.parametrize("dtype", FLOATS)
def test_top_k_selects_largest_magnitudes(dtype):
    for count, k in ((0, 3), (1, 1), (100, 7), (100, 200), (50000, 500), (100003, 1000), (100003, 5001)):
        x = torch.randn(count, generator=torch.Generator().manual_seed(count)).to(dtype)
        values, indices, _ = _C.top_k(x, k)
        _check_top_k(x, k, values, indices)


def test_top_k_paths():
    """A typical gradient takes the sampled threshold; one whose winners the sample misses (300
    nonzeros for k = 1000: the sampled threshold is 0 and keeps everything) falls back to exact
    selection, with the same contract (ties at 0 go to the lowest indices)."""
    x = torch.randn(200000, generator=torch.Generator().manual_seed(1))
    values, indices, exact = _C.top_k(x, 2000)
    assert not exact
    _check_top_k(x, 2000, values, indices)
    sparse = torch.zeros(200000)
    pos = torch.randperm(200000, generator=torch.Generator().manual_seed(2))[:300]
    sparse[pos] = torch.randn(300, generator=torch.Generator().manual_seed(3))
    values, indices, exact = _C.top_k(sparse, 1000)
    assert exact
    _check_top_k(sparse, 1000, values, indices)
    assert torch.equal(indices[values == 0].long(), torch.nonzero(sparse == 0).flatten()[:700])
    # A sampled threshold of 0 (80% zeros, k = 30%) keeps every element of a tensor whose last
    # block ends in a partial group (100003 = 390 * 256 + 163).
    tail = torch.randn(100003, generator=torch.Generator().manual_seed(5))
    tail[torch.rand(100003, generator=torch.Generator().manual_seed(6)) < 0.8] = 0
    values, indices, exact = _C.top_k(tail, 30000)
    assert not exact
    _check_top_k(tail, 30000, values, indices)
    assert int(indices.max()) < 100003


def test_nan_spoils_only_its_quantization_block():
    """The absmax over bit patterns makes a NaN the block's maximum: the block's scale is NaN and
    every value of that block decodes to NaN, so the NaN reaches the result; other blocks keep
    their values."""
    x = torch.randn(1000)
    x[70] = float("nan")
    for bits, block in ((8, 32), (4, 32), (8, 256)):
        out = torch.empty(1000)
        _C.dequantize(_C.quantize(x, None, bits, block, True, 3), bits, block, out)
        first = 70 // block * block
        spoiled = torch.zeros(1000, dtype=torch.bool)
        spoiled[first:first + block] = True
        assert torch.equal(out.isnan(), spoiled)


def test_top_k_counts_nan_as_largest():
    """NaNs rank above every number on both paths (as torch.topk ranks them): a gradient with a
    few NaNs selects them first whether the sampled threshold or the exact selection runs."""
    for count, k in ((200000, 2000), (5000, 100)):  # sampled path, exact path
        x = torch.randn(count, generator=torch.Generator().manual_seed(count))
        nan_at = torch.randperm(count, generator=torch.Generator().manual_seed(7))[:30]
        x[nan_at] = float("nan")
        values, indices, exact = _C.top_k(x, k)
        assert exact == (count == 5000)
        expected = torch.topk(x.abs(), k).indices.sort().values
        assert torch.equal(indices.long(), expected)
        assert int(values.isnan().sum()) == 30


def test_scatter_add_matches_index_add():
    acc = torch.randn(1000)
    idx = torch.tensor([5, 999, 0, 5, 17], dtype=torch.int32)
    val = torch.tensor([1.0, -2.0, 3.5, 0.25, 8.0])
    expected = acc.clone().index_add_(0, idx.long(), val)
    _C.scatter_add(acc, idx, val)
    assert torch.equal(acc, expected)
    with pytest.raises(ValueError, match="indices"):
        _C.scatter_add(acc, torch.tensor([1000], dtype=torch.int32), torch.tensor([1.0]))


def test_top_k_error_feedback_telescopes():
    """residual += grad; send the top k; residual -= sent: nothing is lost, only delayed."""
    g = torch.Generator().manual_seed(4)
    res = torch.zeros(20000)
    sent_total = torch.zeros(20000)
    grad_total = torch.zeros(20000)
    for _ in range(20):
        grad = torch.randn(20000, generator=g)
        grad_total += grad
        _C.error_feedback(grad, res, None)
        values, indices, _ = _C.top_k(res, 200)
        _C.scatter_add(res, indices, values.neg())
        _C.scatter_add(sent_total, indices, values)
        assert torch.all(res[indices.long()] == 0)
    # float32 totals of 20 standard normals (up to about 20): each step rounds the residual and both
    # totals by an ulp (2e-6 at 20); a lost or doubled element is off by O(1).
    assert torch.allclose(sent_total + res, grad_total, atol=1e-4)


def test_bad_kernel_arguments_named():
    x = torch.randn(10)
    cases = [
        (lambda: _C.quantize(x, None, 3, 256, True, 0), ValueError, "bits"),
        (lambda: _C.quantize(x, None, 4, 7, True, 0), ValueError, "block"),
        (lambda: _C.quantize(x, None, 8, 0, True, 0), ValueError, "block"),
        (lambda: _C.quantize(x.double(), None, 8, 256, True, 0), TypeError, "input"),
        (lambda: _C.quantize(x, torch.zeros(9), 8, 256, True, 0), ValueError, "residual"),
        (
            lambda: _C.quantize(x, torch.zeros(10, dtype=torch.float16), 8, 256, True, 0),
            TypeError,
            "residual",
        ),
        (lambda: _C.quantize(x[::2], None, 8, 256, True, 0), ValueError, "contiguous"),
        (lambda: _C.quantize(x, None, 8, 256, True, 0, 0, 100, 1), ValueError, "chunk"),
        (lambda: _C.quantize(x, None, 8, 4, True, 0, 0, 4, 2), ValueError, "nchunks"),
        (lambda: _C.dequantize(torch.zeros(3, dtype=torch.uint8), 8, 256, x), ValueError, "payload"),
        # Payload sizes past 2^63 bytes (they once wrapped around to a few bytes, and the kernels
        # wrote and read far past the buffer).
        (lambda: _C.quantize(x, None, 8, 1, False, 0, 0, 3689348814741910324, 1), ValueError, "too large"),
        (lambda: _C.quantize(x, None, 8, 4, False, 0, 0, 16, 2**60 + 1), ValueError, "too large"),
        (lambda: _C.quantize(x, None, 8, 4, False, 0, 0, 4, 2**62), ValueError, "nchunks"),
        (lambda: _C.dequantize(torch.zeros(4, dtype=torch.uint8), 8, 1, x, 3689348814741910324),
         ValueError, "too large"),
        (lambda: _C.quantized_bytes(2**63 - 1, 8, 256), ValueError, "too large"),
        (lambda: _C.top_k(x, -1), ValueError, "k"),
        (lambda: _C.error_feedback(x, torch.zeros(10), torch.zeros(3)), ValueError, "sent"),
        (lambda: _C.cast(x, None, torch.empty(10)), TypeError, "out"),
        (lambda: _C.cast(x, torch.zeros(9), torch.empty(10, dtype=torch.bfloat16)), ValueError, "residual"),
        (lambda: _C.cast(x, None, torch.empty(9, dtype=torch.float16)), ValueError, "out"),
        (lambda: _C.cast(x, None, x.view(torch.bfloat16)[:10]), ValueError, "overlap"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn()


def test_compressor_arguments_validated():
    with pytest.raises(ValueError, match="warmup_steps"):
        comm.Int8Quantizer(warmup_steps=1)
    with pytest.raises(ValueError, match="block"):
        comm.Int4Quantizer(block=9)
    with pytest.raises(ValueError, match="ratio"):
        comm.TopK(0)
    with pytest.raises(ValueError, match="dtype"):
        comm.Cast(torch.float32)
    with pytest.raises(TypeError, match="stochastic must be a bool"):
        comm.Int8Quantizer(stochastic="no")
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        comm.TopK(0.01, error_feedback="no")
    c = comm.Communicator(torch.distributed.HashStore(), 0, 1, timeout=5.0)
    with pytest.raises(TypeError, match="compression must be a braid.comm compressor .* got 'int8'"):
        c.all_reduce(torch.ones(4), compression="int8")
    with pytest.raises(TypeError, match="a class: pass an instance"):
        c.all_reduce(torch.ones(4), compression=comm.Int8Quantizer)
    c.close()


@pytest.mark.parametrize("bits", (8, 4))
def test_block_too_small_for_its_inverse_scale_is_sent_as_zeros(bits):
    """A block whose absmax is below qmax / FLT_MAX (~1e-37): qmax / absmax overflows, and its
    zeros once came back as -absmax. It is sent as zeros with scale 0; the residual keeps it."""
    x = torch.tensor([1, 0.5, 0.25, 0, -0.1, 0, 0, 0]) * 1e-38  # int4: qmax / amax = 7e38 overflows too
    x = torch.cat([x, torch.randn(8)])  # a normal block after it
    res = torch.zeros(16)
    payload = _C.quantize(x, res, bits, 8, False, 0)
    out = torch.empty(16)
    _C.dequantize(payload, bits, 8, out)
    assert torch.equal(out[:8], torch.zeros(8))
    assert torch.equal(res[:8], x[:8])
    expected_payload, expected_res = ref.quantize(x, torch.zeros(16), bits, 8, False, 0)
    assert torch.equal(payload, expected_payload) and torch.equal(res, expected_res)


def test_top_k_refuses_more_elements_than_int32_indices_before_touching_its_state():
    """TopK sends int32 indices: a larger tensor raises before the residual or the call count
    changes (the residual once absorbed the refused gradient, so a retry counted it twice)."""
    c = comm.Communicator(torch.distributed.HashStore(), 0, 1, timeout=5.0)
    top = comm.TopK(0.01)
    huge = torch.zeros(1, dtype=torch.bfloat16).expand(2**31)  # no memory behind it
    with pytest.raises(ValueError, match="int32"):
        c.all_reduce(huge, compression=top)
    state = top.state_dict()
    assert state["residuals"] == {} and state["calls"] == {}
    c.close()


def test_compressor_state_round_trips():
    q = comm.Int8Quantizer(block=128, seed=9)
    q.residual_for("a", 100).normal_()
    q._calls["a"] = 5
    clone = pickle.loads(pickle.dumps(q))
    assert clone.block == 128 and clone.seed == 9 and clone._calls == {"a": 5}
    assert torch.equal(clone.residual("a"), q.residual("a"))
    fresh = comm.Int8Quantizer(block=128, seed=9)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh.residual("a"), q.residual("a"))
    with pytest.raises(ValueError, match="config"):
        comm.Int8Quantizer(block=64, seed=9).load_state_dict(q.state_dict())
    with pytest.raises(ValueError, match="TopK"):
        comm.TopK(0.1).load_state_dict(q.state_dict())


def test_residuals_are_the_held_tensors():
    """residuals() hands out the residual tensors themselves (a memory count sees their storage),
    every key's, and none after they were taken."""
    q = comm.Int8Quantizer()
    assert q.residuals() == []
    a, b = q.residual_for("a", 10), q.residual_for("b", 20)
    assert len(q.residuals()) == 2 and {id(t) for t in q.residuals()} == {id(a), id(b)}
    q.take_residual("a")
    assert [id(t) for t in q.residuals()] == [id(b)]


def _fp8_reference(x: torch.Tensor, block: int, chunk: int) -> torch.Tensor:
    """FP8Quantizer's decoded values in plain torch: each chunk of ``chunk`` elements (zero padded)
    cut in blocks, scale = block absmax / 448, values rounded to float8 e4m3 (nearest even)."""
    n = -(-x.numel() // chunk)
    padded = torch.zeros(n * chunk)
    padded[:x.numel()] = x.float().reshape(-1)
    out = torch.empty_like(padded)
    for c in range(n):
        for lo in range(c * chunk, (c + 1) * chunk, block):
            hi = min(lo + block, (c + 1) * chunk)
            b = padded[lo:hi]
            scale = b.abs().max() / 448
            q = b / scale if scale > 0 else b
            out[lo:hi] = q.clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return out[:x.numel()]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("numel,block,chunk,nchunks", ((100, 32, 100, 1), (1000, 64, 256, 4), (96, 32, 96, 1),
                                                       (5, 256, 8, 1)))
def test_fp8_format_matches_reference(dtype, numel, block, chunk, nchunks):
    """FP8Quantizer: payload size is the int8 format's (values, padding to 4, float32 scales per
    block), decoded values are the torch reference's bit for bit (partial blocks and a zero block
    included), the residual keeps exactly what the rounding dropped, decode-accumulate adds it."""
    q = comm.FP8Quantizer(block=block)
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 5).to(dtype)
    x[: min(block, numel)] = 0  # a zero block: scale 0, values 0
    numel = min(numel, chunk * nchunks)
    x = x[:numel]
    residual = torch.zeros(numel)
    payload = q.encode(x, residual, 0, 0, chunk, nchunks)
    assert payload.numel() == nchunks * q.wire_bytes(chunk) == nchunks * _C.quantized_bytes(chunk, 8, block)
    decoded = torch.empty(numel)
    q.decode(payload, decoded, chunk)
    expected = _fp8_reference(x, block, chunk)
    assert torch.equal(decoded, expected)
    assert torch.equal(residual, x.float() - expected)
    acc = torch.ones(chunk)
    q.decode_accumulate(payload[: q.wire_bytes(chunk)], acc)
    assert torch.equal(acc[: min(chunk, numel)], 1 + expected[: min(chunk, numel)])
    # float8 e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (half a step), or half a
    # subnormal step (2^-10 of the scale) near zero; 1e-6 for the float32 products around it.
    xf = x.float()
    tol = xf.abs() * (1 / 16 + 1e-6) + xf.abs().max() / 448 * 2.0**-10
    assert bool(((decoded - xf).abs() <= tol).all())


def _carrier(kind, size):
    """A GroupCarrier or HostGroups of ``size`` ranks, for the choice alone (nothing is sent)."""
    from braid.comm.core.group_carrier import GroupCarrier, HostGroups

    carrier = object.__new__(GroupCarrier if kind == "group" else HostGroups)
    carrier.size = size
    return carrier


def test_one_function_chooses_the_compressed_algorithm():
    """choose_path, the one place a compressed all-reduce's algorithm is chosen: the warm-up and a
    group of one exact; over a process group's carrier flat, over HostGroups exact in the host;
    on braid's communicator the fused call between hosts where every host holds the same number
    (> 1) of ranks, the quantized pipeline where every rank has a host of its own (block
    quantizers only), else flat; top-k dense wherever its pairs would weigh more than the tensor.
    Every codec names how its payloads combine, and braid's communicator has a call for each path
    the choice can give it."""
    import types

    from braid.comm.compression.driver import (BETWEEN_HOSTS, DENSE, EXACT, FLAT, GATHER, HOSTS, NATIVE,
                                               ON_BRAID, PIPELINED, REQUANTIZE, choose_path)

    def braid(world, hosts, uniform=True):
        return types.SimpleNamespace(world_size=world, num_hosts=hosts, local_world_size=world // hosts,
                                     uniform_hosts=uniform)

    int8, topk, cast = comm.Int8Quantizer(), comm.TopK(0.01), comm.Cast(torch.bfloat16)
    for q in (int8, topk, cast):
        assert choose_path(q, braid(4, 2), 1000, 0) == EXACT  # warm-up
        assert choose_path(q, braid(1, 1), 1000, 5) == EXACT  # a group of one
        assert choose_path(q, braid(4, 2), 1000, 5) == BETWEEN_HOSTS
        assert choose_path(q, braid(4, 1), 1000, 5) == FLAT  # one host
        assert choose_path(q, braid(6, 2, uniform=False), 1000, 5) == FLAT
        assert choose_path(q, _carrier("group", 4), 1000, 5) == FLAT
        assert choose_path(q, _carrier("group", 4), 0, 5) == EXACT  # nothing to compress
        assert choose_path(q, _carrier("group", 4), 1000, 1) == EXACT
        assert choose_path(q, _carrier("hosts", 4), 1000, 5) == HOSTS
    assert choose_path(int8, braid(3, 3), 1000, 5) == PIPELINED
    assert choose_path(topk, braid(3, 3), 1000, 5) == FLAT
    assert choose_path(cast, braid(3, 3), 1000, 5) == FLAT
    # top-k at 1%: 10 pairs of 8 bytes from each of 4 ranks weigh less than 1,000 float32 values;
    # from 64 ranks (5,120 bytes) they weigh more, and in bfloat16 (2,000 bytes) from 32 ranks too
    assert choose_path(topk, _carrier("group", 64), 1000, 5) == DENSE
    assert choose_path(topk, braid(64, 1), 1000, 5) == DENSE
    assert choose_path(topk, _carrier("group", 32), 1000, 5, elem_size=2) == DENSE
    assert choose_path(topk, _carrier("group", 32), 1000, 5, elem_size=4) == FLAT
    for q in (int8, cast):  # the other formats never fall back
        assert choose_path(q, _carrier("group", 64), 1000, 5) == FLAT
    assert (comm.Int8Quantizer.reduction, comm.FP8Quantizer.reduction, topk.reduction, cast.reduction) == (
        REQUANTIZE, REQUANTIZE, GATHER, NATIVE)
    for q in (int8, topk, cast):
        for world, hosts in ((4, 2), (4, 1), (3, 3)):
            path = choose_path(q, braid(world, hosts), 1000, 5)
            assert (q.reduction, path) in ON_BRAID, (q, path)
