"""Launch configurations of the attention kernels: autotuned on a GPU, one fixed set in the interpreter."""
from __future__ import annotations

import os

import torch
import triton

try:  # host-side tensor descriptors (TMA on sm_90); absent from older Triton releases
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter: TRITON_INTERPRET=1, which Triton reads
    when the kernels are defined, so it must be set before braid's kernel modules are imported."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def tensor_descriptors_requested() -> bool:
    """BRAID_ATTENTION_TMA=1 asks the kernels to stream their tiles (K and V in the forward and dQ
    kernels, Q and dO in the dK/dV kernel) through tensor descriptors, the Tensor Memory
    Accelerator on sm_90, instead of pointer arithmetic. Off by default: its speed has not been
    measured yet."""
    return os.environ.get("BRAID_ATTENTION_TMA", "").strip().lower() in ("1", "true", "yes", "on")


def autotuning() -> bool:
    """BRAID_ATTENTION_AUTOTUNE=0 launches each kernel with one fixed configuration (FIXED_* below,
    or the first of its search space that fits when that one does not) instead of searching: no
    compile of every candidate at the first call of each key, at the price of tiles not tuned to
    the shape. On by default."""
    return os.environ.get("BRAID_ATTENTION_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


def descriptor_usable(t: torch.Tensor) -> bool:
    """Whether a (B, H, S, D) tensor meets the TMA rules: 16-byte aligned base and row strides,
    contiguous last dim, half-precision elements (the only ones the descriptor path is built for)."""
    if TensorDescriptor is None or t.dtype not in (torch.float16, torch.bfloat16):
        return False
    if t.is_cuda and torch.cuda.get_device_capability(t.device) < (9, 0):
        return False
    elem = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and s * elem % 16 == 0 for s in t.stride()[:-1]))


def descriptor(t: torch.Tensor, block_rows: int, head_dim_block: int):
    """A 4-D descriptor over a (B, H, S, D) tensor, read one (1, 1, block_rows, head_dim_block) box
    at a time; boxes past the sequence or the head dim read zeros, which stand in for the pointer
    path's masks."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_rows, head_dim_block])


def _descriptor_boxes(names: tuple[str, ...], rows: str):
    """An autotuner pre-hook: the boxes of the descriptors passed as `names` follow the
    configuration's `rows` block size (the tiles they stream)."""
    def set_boxes(nargs: dict) -> None:
        for name in names:
            if TensorDescriptor is not None and isinstance(nargs[name], TensorDescriptor):
                nargs[name].block_shape = [1, 1, nargs[rows], nargs["BLOCK_D"]]
    return set_boxes


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two (tl.arange needs one); the kernels mask the rest."""
    return max(16, triton.next_power_of_2(head_dim))


def bucket(seq_len: int) -> int:
    """Autotuning key of a sequence length: its power-of-two ceiling, so that a training run with
    varying lengths tunes a handful of times, not once per length."""
    return triton.next_power_of_2(seq_len)


# In the interpreter every program runs as numpy code on one core: a single small configuration
# keeps the tests fast, and BLOCK_M != BLOCK_N makes them cover tiles that are not square (the
# causal diagonal then crosses tiles at different offsets in the two loops of each kernel).
INTERPRETER_FORWARD = {"BLOCK_M": 32, "BLOCK_N": 16}
INTERPRETER_DQ = {"BLOCK_M": 32, "BLOCK_N": 16}
INTERPRETER_DKDV = {"BLOCK_M": 16, "BLOCK_N": 32}
INTERPRETER_DELTA = {"BLOCK_M": 32}


def _configs(blocks_m: tuple[int, ...], blocks_n: tuple[int, ...], warps: tuple[int, ...],
             stages: tuple[int, ...], pre_hook=None) -> list[triton.Config]:
    # num_stages > 1 lets Triton software-pipeline the K/V (or Q/dO) loads of the next tile under
    # the dot products of this one (asynchronous copies, or TMA loads with tensor descriptors).
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=pre_hook)
            for m in blocks_m for n in blocks_n for w in warps for s in stages]


# The search spaces below are the usual ones for flash attention on sm_80/sm_90 (tiles of 16 to
# 128 rows, 4 or 8 warps, 2 or 3 pipeline stages), widened towards narrow tiles after compiling
# every candidate for sm_90 with Triton 3.9 and reading ptxas' report (bf16, d = 128, 2 stages):
# only narrow key tiles stay free of register spills there (forward 128 x 64 or 64 x 32 with
# 8 warps, dQ 64 x 32, dK/dV 16..64 x 32), while the wider ones spill hundreds of bytes per
# thread. The autotuner picks among them at the first call for each key, which compiles each
# candidate once (on an H200 machine, the attention benchmark at one head dim and causal flag, two
# lengths, took 93 s, compiles included); its choices there are in docs/results/2026-11-26-h200.md.
FORWARD_CONFIGS = _configs((64, 128), (32, 64, 128), (4, 8), (2, 3),
                           pre_hook=_descriptor_boxes(("K", "V"), "BLOCK_N"))
DQ_CONFIGS = _configs((64, 128), (32, 64), (4, 8), (2, 3), pre_hook=_descriptor_boxes(("K", "V"), "BLOCK_N"))
DKDV_CONFIGS = _configs((16, 32, 64), (32, 64, 128), (4, 8), (2,),
                        pre_hook=_descriptor_boxes(("Q", "DO"), "BLOCK_M"))
DELTA_CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w) for m in (64, 128) for w in (4, 8)]

# Shared memory per SM on sm_90 is 228 KiB (227 usable by one block); a config whose tiles cannot
# fit is dropped before benchmarking instead of being compiled only to fail.
_SMEM_BYTES = 227 * 1024


def _tile_bytes(config: triton.Config, block_d: int, elem_bytes: int, resident: tuple[str, int],
                streamed: tuple[str, int]) -> int:
    """Shared memory of a configuration's tiles: `resident` is (block name, tile count) of the tiles
    a program keeps, `streamed` those it loads per loop step, once per pipeline stage."""
    stages = max(config.num_stages, 1)
    rows = resident[1] * config.kwargs[resident[0]] + streamed[1] * config.kwargs[streamed[0]] * stages
    return rows * block_d * elem_bytes


def _pruner(resident: tuple[str, int], streamed: tuple[str, int]):
    """An early_config_prune that keeps the configurations whose tiles fit in shared memory."""
    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        q = named_args["Q"]
        if TensorDescriptor is not None and isinstance(q, TensorDescriptor):
            q = q.base
        elem = q.element_size()

        def size(c: triton.Config) -> int:
            return _tile_bytes(c, d, elem, resident, streamed)

        kept = [c for c in configs if size(c) <= _SMEM_BYTES
                # A tile larger than 128 x 128 halves (128-row tiles at d = 256, or float32 at
                # d = 128) is expected to spill the accumulators out of registers.
                and max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) * d * elem <= 128 * 128 * 2]
        return kept or [min(configs, key=size)]
    return prune


# Forward and dQ: a resident Q tile (dQ: and dO), K and V tiles streamed. dK/dV: resident K and V
# tiles, Q and dO tiles streamed.
PRUNE_FORWARD = {"early_config_prune": _pruner(("BLOCK_M", 1), ("BLOCK_N", 2))}
PRUNE_DQ = {"early_config_prune": _pruner(("BLOCK_M", 2), ("BLOCK_N", 2))}
PRUNE_DKDV = {"early_config_prune": _pruner(("BLOCK_N", 2), ("BLOCK_M", 2))}

# Without the search (BRAID_ATTENTION_AUTOTUNE=0): what the autotuner chose on an H200 for bf16,
# head dim 128, causal, 8192 positions (docs/results/2026-11-26-h200.md), each tried first and,
# where its tiles do not fit the head dim and dtype, followed by its search space in order.
FIXED_FORWARD = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)
FIXED_DQ = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)
FIXED_DKDV = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
FIXED_DELTA = triton.Config({"BLOCK_M": 64}, num_warps=8)
_FIXED = {"forward": ([FIXED_FORWARD, *FORWARD_CONFIGS], PRUNE_FORWARD["early_config_prune"],
                      INTERPRETER_FORWARD),
          "dq": ([FIXED_DQ, *DQ_CONFIGS], PRUNE_DQ["early_config_prune"], INTERPRETER_DQ),
          "dkdv": ([FIXED_DKDV, *DKDV_CONFIGS], PRUNE_DKDV["early_config_prune"], INTERPRETER_DKDV),
          "delta": ([FIXED_DELTA], None, INTERPRETER_DELTA)}


def fixed_launch(kernel: str, q: torch.Tensor, block_d: int) -> dict | None:
    """The launch arguments (block sizes, and on a GPU num_warps and num_stages) of ``kernel``
    ("forward", "dq", "dkdv", "delta") when it runs without the autotuner: in the interpreter, or
    with BRAID_ATTENTION_AUTOTUNE=0; None when the autotuner chooses. ``q`` (the queries) and
    ``block_d`` decide which tiles fit in shared memory."""
    configs, prune, interpreter = _FIXED[kernel]
    if interpreting():
        return dict(interpreter)
    if autotuning():
        return None
    if prune is not None:
        configs = prune(configs, {"Q": q}, BLOCK_D=block_d)
    chosen = configs[0]
    return {**chosen.kwargs, "num_warps": chosen.num_warps, "num_stages": chosen.num_stages}


# Autotuning keys: a new configuration is chosen per head dim, causal flag, length bucket (of the
# longest sequence when packed), load path and VARIANT, the options that are on (packed sequences,
# window, soft cap, ALiBi: each changes the work per tile). Tensor dtypes are part of Triton's key
# already.
TUNING_KEY = ["BUCKET_Q", "BUCKET_K", "HEAD_DIM", "CAUSAL", "USE_TMA", "VARIANT"]
