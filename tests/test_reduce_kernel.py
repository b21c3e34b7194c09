"""braid's CPU reduction kernel (braid.comm._C.reduce_tensors) against pure-torch references.

The kernel is what every collective runs: inputs combined left to right in list order, half types
accumulated in float32 and rounded once, avg divided by world_size at the end. It works in blocks
of 512 elements, so sizes straddle multiples of 512. Comparisons are bitwise (NaN payloads aside).
"""
import pytest
import torch
from braid.comm import _C
from helpers import (
    BITWISE_OPS,
    DTYPES,
    HALF_DTYPES,
    OPS,
    make_input,
    mismatch_summary,
    reduce_reference,
    same_bits,
)

BLOCK = 512  # the kernel's accumulator block (csrc/core/reduce.cc)
SIZES = (0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 13)
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def reduce(inputs, op: str, world_size: int = 1) -> torch.Tensor:
    return _C.reduce_tensors(list(inputs), _C.REDUCE_OPS[op], world_size)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert same_bits(actual, expected), f"{what}: {mismatch_summary(actual, expected)}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, op):
    """Every dtype x op, 1-5 inputs, sizes around the 512-element block: bitwise equal to the ordered
    reference; avg divides by world_size (here also different from the number of inputs)."""
    for size in SIZES:
        for ninputs in (1, 2, 3, 5):
            inputs = [make_input(size, r, size, dtype) for r in range(ninputs)]
            for world_size in {ninputs, 3}:
                assert_same_bits(reduce(inputs, op, world_size), reduce_reference(inputs, op, world_size),
                                 f"size {size}, {ninputs} inputs, world_size {world_size}")


@pytest.mark.parametrize("op", BITWISE_OPS)
@pytest.mark.parametrize("dtype", (torch.int32, torch.int64, torch.uint8), ids=str)
def test_bitwise_ops_match_reference(dtype, op):
    """band / bor / bxor on integers (full-range values, negative ones included), every size class;
    refused for a floating-point dtype."""
    info = torch.iinfo(dtype)
    for size in SIZES:
        for ninputs in (1, 2, 3, 5):
            g = torch.Generator().manual_seed(size * 10 + ninputs)
            inputs = [torch.randint(info.min, info.max, (size,), generator=g, dtype=torch.int64).to(dtype)
                      for _ in range(ninputs)]
            assert_same_bits(reduce(inputs, op), reduce_reference(inputs, op, 1),
                             f"size {size}, {ninputs} inputs")
    with pytest.raises(ValueError, match="needs an integer tensor"):
        reduce([torch.ones(4), torch.ones(4)], op)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("op", ("max", "min", "sum"))
def test_nan_propagates(dtype, op):
    """A NaN in any input, first or later, in front of larger or smaller values, makes the result NaN
    (as torch.maximum/minimum, not as fmax); inf meets NaN as NaN too."""
    nan, inf = float("nan"), float("inf")
    columns = [  # one element per column, one input per row
        (nan, 1.0, -1.0), (1.0, nan, -1.0), (-1.0, 1.0, nan), (nan, nan, 0.0),
        (inf, nan, 0.0), (nan, -inf, 0.0), (2.0, 3.0, -4.0),
    ]
    inputs = [torch.tensor(row, dtype=dtype) for row in zip(*columns)]
    # Repeat past one block so the NaNs also land in a second block at other lanes.
    inputs = [torch.cat([x] * 80)[:BLOCK + 37] for x in inputs]
    actual = reduce(inputs, op)
    assert_same_bits(actual, reduce_reference(inputs, op, 1))
    assert torch.isnan(actual).tolist()[:len(columns)] == [True] * 6 + [False]


# (inputs, exact result): ties of float32 -> half rounding, and sums that would round differently if
# the partial sums were rounded to the half type.
HALF_ROUNDING = {
    torch.bfloat16: [  # 8 significant bits: spacing 2^-7 at 1.0
        ([1.0, 2 ** -8], 1.0),                          # tie, 1.0 is even
        ([1.0 + 2 ** -7, 2 ** -8], 1.0 + 2 ** -6),      # tie, rounds up to the even neighbour
        ([-1.0, -(2 ** -8)], -1.0),                     # negative tie
        ([1.0, 2 ** -8, 2 ** -8], 1.0 + 2 ** -7),       # rounded once; pairwise would give 1.0
        ([1.0, 2 ** -9, 2 ** -9, 2 ** -9], 1.0 + 2 ** -7),  # 1 + 3*2^-9 is above the tie: up
        ([3.0e38, 3.0e38], float("inf")),               # overflows float32 and bfloat16
    ],
    torch.float16: [  # 11 significant bits: spacing 2^-10 at 1.0
        ([1.0, 2 ** -11], 1.0),
        ([1.0 + 2 ** -10, 2 ** -11], 1.0 + 2 ** -9),
        ([-1.0, -(2 ** -11)], -1.0),
        ([1.0, 2 ** -11, 2 ** -11], 1.0 + 2 ** -10),
        ([65504.0, 15.0], 65504.0),                     # below the overflow midpoint 65520
        ([65504.0, 16.0], float("inf")),                # at it: rounds to even, i.e. to inf
        ([2 ** -24, 2 ** -24], 2 ** -23),               # subnormals are not flushed
    ],
}


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_half_types_round_once_to_nearest_even(dtype):
    """Half-type sums accumulate in float32 and round once, ties to even, overflow to inf, subnormals
    kept: equal to explicit values (so the reference itself is checked) and to the reference."""
    for values, exact in HALF_ROUNDING[dtype]:
        inputs = [torch.tensor([v] * (BLOCK + 3), dtype=dtype) for v in values]
        expected = torch.full((BLOCK + 3,), exact, dtype=dtype)
        assert_same_bits(reduce_reference(inputs, "sum", 1), expected, f"reference {values}")
        assert_same_bits(reduce(inputs, "sum"), expected, f"kernel {values}")


def test_half_avg_divides_the_float32_sum():
    """avg of half types divides the float32 sum, then rounds once: (1 + 2^-8 + 2^-8) / 2 is exact in
    bfloat16, while partial sums rounded to bfloat16 would drop both 2^-8 terms (giving 0.5)."""
    inputs = [torch.tensor([v], dtype=torch.bfloat16) for v in (1.0, 2 ** -8, 2 ** -8)]
    assert reduce(inputs, "avg", 2).item() == (1.0 + 2 ** -7) / 2


def test_float32_denormals_are_kept():
    """float32 and bfloat16 subnormal sums stay subnormal (the kernel must not flush to zero)."""
    for dtype in (torch.float32, torch.bfloat16):
        tiny = torch.full((BLOCK + 1,), 1e-39, dtype=dtype)
        assert_same_bits(reduce([tiny, tiny], "sum"), reduce_reference([tiny, tiny], "sum", 1), str(dtype))
        assert reduce([tiny, tiny], "sum")[0].item() != 0.0


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64), ids=str)
def test_integers_wrap_and_truncate_like_torch(dtype):
    """Integer sums and products wrap around as in torch; avg truncates toward zero (-7 / 2 = -3)."""
    info = torch.iinfo(dtype)
    a = torch.tensor([info.max, info.min, -7, 7, -1, info.max], dtype=dtype)
    b = torch.tensor([1, -1, 0, 0, 0, info.max], dtype=dtype)
    for op in ("sum", "prod"):
        assert_same_bits(reduce([a, b], op), reduce_reference([a, b], op, 1), op)
    avg = reduce([a, b], "avg", 2)
    assert avg[2:5].tolist() == [-3, 3, 0]
    assert_same_bits(avg, reduce_reference([a, b], "avg", 2))


def test_shapes_and_non_contiguous_inputs():
    """Inputs keep their shape; non-contiguous inputs (transposed, strided) are read in logical order."""
    base = [make_input(3, r, 2 * 15 * 40, torch.float32).view(2 * 15, 40) for r in range(3)]
    inputs = [b[::2].t() for b in base]  # (40, 15), neither row nor column contiguous
    out = reduce(inputs, "sum")
    assert out.shape == (40, 15)
    assert_same_bits(out, reduce_reference(inputs, "sum", 1))


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: _C.reduce_tensors([], 0), ValueError, "empty"),
    (lambda: _C.reduce_tensors([torch.ones(3), torch.ones(4)], 0), ValueError, "shape"),
    (lambda: _C.reduce_tensors([torch.ones(3), torch.ones(3, dtype=torch.float64)], 0), ValueError, "dtype"),
    (lambda: _C.reduce_tensors([torch.ones(3)], 5), ValueError, "op"),
    (lambda: _C.reduce_tensors([torch.ones(3)], -1), ValueError, "op"),
    (lambda: _C.reduce_tensors([torch.ones(3, dtype=torch.complex64)], 0), TypeError, "dtype"),
    (lambda: _C.reduce_tensors([torch.ones(3, device="meta")], 0), ValueError, "CPU"),
], ids=("empty", "shapes", "dtypes", "op_5", "op_negative", "complex", "meta"))
def test_rejects_bad_arguments(call, error, pattern):
    """Malformed kernel calls raise ValueError/TypeError instead of reading out of bounds."""
    with pytest.raises(error, match=pattern):
        call()
