"""The CUDA compression kernels against the CPU kernels, bit for bit (GPU builds only).

Both sides use the same formats, random streams and explicitly rounded float32 arithmetic, so a
payload, a residual or a top-k selection must come out identical on either device.
"""

import pytest
import torch
from braid.comm import _C
from braid.comm.core.build_info import is_cuda_build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not is_cuda_build(),
        reason="needs a CUDA device and a CUDA build of braid",
    ),
]
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128), (4, 6)])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_and_dequantize_match_cpu(bits, block, dtype, stochastic):
    for count, chunk, nchunks in (
        (1, 0, 1),
        (1000, 0, 1),
        (4099, 0, 1),
        (3001, 1024 if block != 6 else 1002, 3),
    ):
        x = (torch.randn(count) * 3).to(dtype)
        res = torch.randn(count) * 0.01
        cpu_res, gpu_res = res.clone(), res.cuda()
        cpu = _C.quantize(x, cpu_res, bits, block, stochastic, 77, 5, chunk, nchunks)
        gpu = _C.cuda_quantize(x.cuda(), gpu_res, bits, block, stochastic, 77, 5, chunk, nchunks)
        assert torch.equal(gpu.cpu(), cpu)
        assert torch.equal(gpu_res.cpu(), cpu_res)
        out_cpu = torch.empty(count, dtype=dtype)
        out_gpu = torch.empty(count, dtype=dtype, device="cuda")
        _C.dequantize(cpu, bits, block, out_cpu, chunk)
        _C.cuda_dequantize(gpu, bits, block, out_gpu, chunk)
        assert torch.equal(out_gpu.cpu(), out_cpu)


def test_nan_spoils_its_block_on_both_devices():
    """A NaN makes its block's scale NaN on either device (both take the absmax over bit
    patterns), so it shows up in the result instead of being encoded as a number."""
    x = torch.randn(1000)
    x[70] = float("nan")
    for bits, block in ((8, 32), (4, 32)):
        out_cpu, out_gpu = torch.empty(1000), torch.empty(1000, device="cuda")
        _C.dequantize(_C.quantize(x, None, bits, block, True, 3), bits, block, out_cpu)
        _C.cuda_dequantize(_C.cuda_quantize(x.cuda(), None, bits, block, True, 3), bits, block, out_gpu)
        for out in (out_cpu, out_gpu.cpu()):
            assert out[64:96].isnan().all() and not out[:64].isnan().any() and not out[96:].isnan().any()


def test_dequantize_accumulate_and_error_feedback_match_cpu():
    x = torch.randn(5000)
    q = _C.quantize(x, None, 8, 256, True, 3)
    acc = torch.randn(5000)
    acc_gpu = acc.cuda()
    _C.dequantize_accumulate(q, 8, 256, acc)
    _C.cuda_dequantize_accumulate(q.cuda(), 8, 256, acc_gpu)
    assert torch.equal(acc_gpu.cpu(), acc)
    for dtype in FLOATS:
        inp, res, sent = torch.randn(5000).to(dtype), torch.randn(5000), torch.randn(5000)
        res_gpu = res.cuda()
        _C.error_feedback(inp, res, sent)
        _C.cuda_error_feedback(inp.cuda(), res_gpu, sent.cuda())
        assert torch.equal(res_gpu.cpu(), res)


@pytest.mark.parametrize("dtype", FLOATS)
def test_top_k_selects_as_cpu(dtype):
    for count, k in ((100, 7), (200000, 2000), (1 << 20, 10000)):
        x = torch.randn(count).to(dtype)
        v_cpu, i_cpu, exact_cpu = _C.top_k(x, k)
        v_gpu, i_gpu, exact_gpu = _C.cuda_top_k(x.cuda(), k)
        assert exact_gpu == exact_cpu
        assert torch.equal(i_gpu.cpu(), i_cpu)
        assert torch.equal(v_gpu.cpu(), v_cpu)
        acc_cpu, acc_gpu = torch.zeros(count), torch.zeros(count, device="cuda")
        _C.scatter_add(acc_cpu, i_cpu, v_cpu)
        _C.cuda_scatter_add(acc_gpu, i_gpu, v_gpu)
        assert torch.equal(acc_gpu.cpu(), acc_cpu)
