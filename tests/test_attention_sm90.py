"""The attention kernels compile for sm_90 (Hopper) without a GPU, with Triton's bundled ptxas.

The interpreter tests run the kernels' arithmetic but not Triton's GPU compiler: a construct the
interpreter accepts and the compiler rejects would only show on a GPU. This test compiles each
kernel for sm_90 ahead of time, as CI compile-checks the CUDA sources with nvcc, and checks that
the dot products became Hopper tensor-core instructions (wgmma) and that the tensor-descriptor
variant of the forward really loads through TMA. It runs the compiler in a child process because
conftest put this one in interpreter mode, where triton.jit builds interpreter functions instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# The optional inputs of the forward and gradient kernels: None compiles them out (the plain
# kernel); "on" types them as present (packed sequences, ALiBi, soft cap and window at once).
OPTIONAL = {"CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32", "ALIBI_SLOPES": "*fp32", "softcap": "fp32",
            "window_left": "i32", "window_right": "i32"}

# (kernel, dtype, head dim, causal, BLOCK_M, BLOCK_N, num_warps, num_stages, tensor descriptors[,
# "options": every optional input present])
CASES = [
    ("attention_forward_kernel", "bf16", 128, True, 128, 64, 8, 3, False),
    ("attention_forward_kernel", "bf16", 128, False, 128, 64, 8, 3, True),
    ("attention_forward_kernel", "fp16", 96, False, 64, 64, 4, 2, False),
    ("attention_forward_kernel", "fp32", 64, True, 64, 32, 4, 2, False),
    ("attention_dq_kernel", "bf16", 128, True, 64, 64, 4, 2, False),
    ("attention_dq_kernel", "bf16", 128, True, 64, 32, 8, 2, True),
    ("attention_dkdv_kernel", "bf16", 64, True, 32, 128, 4, 2, False),
    ("attention_dkdv_kernel", "fp16", 128, False, 32, 64, 8, 2, True),
    ("attention_delta_kernel", "bf16", 128, False, 64, None, 4, 1, False),
    ("attention_forward_kernel", "bf16", 128, True, 128, 64, 8, 3, False, "options"),
    ("attention_dkdv_kernel", "bf16", 64, True, 32, 128, 4, 2, True, "options"),
]
# What each kernel streams through descriptors with USE_TMA, and which block is their box's rows.
DESCRIPTORS = {"attention_forward_kernel": (("K", "V"), "BLOCK_N"),
               "attention_dq_kernel": (("K", "V"), "BLOCK_N"),
               "attention_dkdv_kernel": (("Q", "DO"), "BLOCK_M")}


def _signature(fn, dtype: str, constexprs: dict, tma: bool) -> dict:
    """Triton types of a kernel's arguments, from the naming convention of braid's attention
    kernels: upper-case names are tensors (float32 for LSE and DELTA) or, with tma, descriptors;
    the scales are float32, the optional inputs as OPTIONAL says, the rest int32 (sizes and
    strides)."""
    names, rows = DESCRIPTORS.get(fn.__name__, ((), None))
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in OPTIONAL:
            sig[name] = OPTIONAL[name]
        elif tma and name in names:
            sig[name] = f"tensordesc<{dtype}[1,1,{constexprs[rows]},{constexprs['BLOCK_D']}]>"
        elif name[0].isupper():
            sig[name] = "*fp32" if name in ("LSE", "DELTA") else f"*{dtype}"
        elif name in ("qk_scale", "softmax_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_cases() -> list[dict]:
    """Compiles CASES for sm_90; returns per case what the PTX contains (child process only)."""
    import triton
    from braid.kernels import attention_backward, attention_forward
    from triton.backends.compiler import GPUTarget

    kernels = {"attention_forward_kernel": attention_forward.attention_forward_kernel,
               "attention_dq_kernel": attention_backward.attention_dq_kernel,
               "attention_dkdv_kernel": attention_backward.attention_dkdv_kernel,
               "attention_delta_kernel": attention_backward.attention_delta_kernel}
    results = []
    for name, dtype, head_dim, causal, block_m, block_n, warps, stages, tma, *options in CASES:
        fn = kernels[name]
        meta = {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "CAUSAL": causal,
                "DOT_PRECISION": "tf32" if dtype == "fp32" else "ieee", "USE_TMA": tma,
                "BLOCK_M": block_m, "BLOCK_N": block_n}
        if not options:  # the plain kernel: the optional inputs compiled out
            meta.update(dict.fromkeys(OPTIONAL))
        constexprs = {k: v for k, v in meta.items() if k in fn.arg_names}
        source = triton.compiler.ASTSource(fn=fn, signature=_signature(fn, dtype, constexprs, tma),
                                           constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 64),
                                options={"num_warps": warps, "num_stages": stages})
        ptx = kernel.asm["ptx"]
        results.append({"case": [name, dtype, head_dim, causal, *options], "wgmma": "wgmma" in ptx,
                        "tma": "cp.async.bulk.tensor" in ptx, "cubin_bytes": len(kernel.asm["cubin"])})
    return results


def _nvidia_backend_missing() -> str | None:
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError as e:
        return f"Triton has no NVIDIA backend here ({e})"
    return None


@pytest.mark.skipif(_nvidia_backend_missing() is not None, reason=str(_nvidia_backend_missing()))
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(CASES)
    for case, result in zip(CASES, results):
        name, dtype, *_, tma = case[:9]
        assert result["cubin_bytes"] > 0, case
        if name != "attention_delta_kernel":  # the delta kernel has no matrix product
            # float32 goes through TF32 wgmma as well when TF32 is allowed.
            assert result["wgmma"], f"{case}: no wgmma in the PTX"
        if tma:
            assert result["tma"], f"{case}: no TMA loads (cp.async.bulk.tensor) in the PTX"


if __name__ == "__main__":
    print(json.dumps(compile_cases()))
