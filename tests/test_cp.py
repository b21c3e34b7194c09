"""Context-parallel (ring) attention against full attention on the gathered sequence.

Every rank builds the same whole-sequence q, k, v and output gradient from a seed, computes the
reference (float64 SDPA on the whole sequence, K/V heads repeated for GQA) and runs ring attention
on its shard; the shards' outputs and gradients, gathered back, must equal the reference.

Tolerances (absolute and relative, against the float64 reference): float64 inputs 1e-12. The
ring merges per-block softmaxes through their LSE instead of taking one softmax, a few more
roundings of 1e-16 per element; the measured worst case over these cases at 2-4 ranks is 1.7e-15.
float32 inputs 1e-5: the blocks are computed in float32, whose dot products over D <= 20 and sums
over at most 24 keys round at about 6e-8 relative each; the measured worst case is 8e-7. Both
leave margin and still catch a wrong block, mask or merge (errors of 1e-2 and more).
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from braid.comm import cp
from braid.comm.core.group import as_group
from helpers.ranks import make_comm, new_store_path, process_group, run_ranks

# Against the float64 reference; the reasons and the measured worst cases are in the module docstring.
TOL = {torch.float64: {"atol": 1e-12, "rtol": 1e-12}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}


def _inputs(batch, heads, kv_heads, seq, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=torch.float64)
    do = torch.randn(batch, heads, seq, dim, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, do)]


def _reference(q, k, v, do, causal, scale=None):
    """Output and dq, dk, dv of full attention in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(group, 1),
                                         leaves[2].repeat_interleave(group, 1), is_causal=causal, scale=scale)
    out.backward(do.double())
    return [out.detach()] + [t.grad for t in leaves]


def _ring(q, k, v, do, communicator, causal, balanced, scale=None):
    """Ring attention on this rank's shards; the output and gradients gathered back whole."""
    layout = causal if balanced is None else balanced
    leaves = [cp.shard(t, communicator, balanced=layout).requires_grad_() for t in (q, k, v)]
    out = cp.ring_attention(*leaves, communicator, causal=causal, scale=scale, balanced=balanced)
    assert out.dtype == q.dtype and out.shape == leaves[0].shape
    out.backward(cp.shard(do, communicator, balanced=layout))
    return [cp.unshard(t, communicator, balanced=layout) for t in [out.detach()] + [x.grad for x in leaves]]


def _check_cases(communicator, cases):
    n = as_group(communicator).world_size
    for dtype, causal, balanced, shape in cases:
        batch, heads, kv_heads, per_rank, dim = shape
        q, k, v, do = _inputs(batch, heads, kv_heads, per_rank * n, dim, dtype, seed=len(shape) + per_rank)
        want = _reference(q, k, v, do, causal)
        got = _ring(q, k, v, do, communicator, causal, balanced)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert g.dtype == dtype, name
            what = f"{name} {dtype} causal={causal} balanced={balanced} {shape}"
            torch.testing.assert_close(g.double(), w, **TOL[dtype], msg=lambda m, what=what: f"{what}: {m}")


# (dtype, causal, balanced, (batch, heads, kv_heads, local length, head dim)): GQA with 2 query
# heads per K/V head, MQA, head dims that are not powers of two.
CASES = [(dtype, causal, balanced, shape)
         for dtype in (torch.float64, torch.float32)
         for causal, balanced in ((False, False), (False, True), (True, None), (True, False))
         for shape in ((2, 4, 2, 4, 12),)] + [
    (torch.float64, True, None, (1, 3, 1, 6, 20)),
    (torch.float64, False, None, (1, 2, 2, 3, 5)),
]


def _instrument(communicator, events):
    """Records, in order, the ring's transfers being posted and waited for and the blocks computed."""
    forward, backward = cp._block_forward, cp._block_backward
    post, post_pair = communicator.batch_isend_irecv, communicator.send_recv

    class Recorded:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def batch_isend_irecv(ops):
        events.append("post")
        return [Recorded(w) for w in post(ops)]

    def send_recv(*args):  # a Communicator's send_recv posts straight to the core
        events.append("post")
        return Recorded(post_pair(*args))

    def block_forward(*args):
        events.append("compute")
        return forward(*args)

    def block_backward(*args):
        events.append("compute")
        return backward(*args)

    communicator.batch_isend_irecv = batch_isend_irecv
    communicator.send_recv = send_recv
    cp._block_forward, cp._block_backward = block_forward, block_backward
    return lambda: setattr(cp, "_block_forward", forward) or setattr(cp, "_block_backward", backward)


def _squeeze(events):
    return [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]


def _check_overlap(c):
    """The next block's transfer is posted before the current block is computed, and waited for
    only after: forward (post, compute, wait) per step; backward per step: post K/V, compute, wait
    for the arriving dK/dV (from step 1), post dK/dV on, wait for K/V; the last dK/dV at the end."""
    n = c.world_size
    q, k, v, do = _inputs(1, 2, 2, 4 * n, 8, torch.float64)
    leaves = [cp.shard(t, c, balanced=False).requires_grad_() for t in (q, k, v)]
    events: list = []
    restore = _instrument(c, events)
    try:
        out = cp.ring_attention(*leaves, c, causal=False)
        forward = _squeeze(events)
        events.clear()
        out.backward(cp.shard(do, c, balanced=False))
        backward = _squeeze(events)
    finally:
        restore()
        del c.batch_isend_irecv
    assert forward == ["post", "compute", "wait"] * (n - 1) + ["compute"], forward
    expect = ["post", "compute", "post", "wait"]
    for _ in range(n - 2):
        expect += ["post", "compute", "wait", "post", "wait"]
    expect += ["compute", "wait", "post", "wait"]
    assert backward == expect, backward


def _run_ring_attention(rank, world_size, store_path, overlap):
    torch.manual_seed(0)
    with make_comm(rank, world_size, store_path) as c:
        _check_cases(c, CASES)
        if overlap:
            _check_overlap(c)
    return True


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_ring_attention_equals_full_attention(world_size):
    """Output, dq, dk, dv of every case equal full attention; at 3 ranks also the order of the
    ring's transfers against the block computations (communication overlapped with compute)."""
    assert run_ranks(_run_ring_attention, world_size, world_size == 3) == [True] * world_size


def _run_through_process_group(rank, world_size, store_path):
    with process_group(rank, world_size, store_path, backend="braid"):
        group = dist.group.WORLD
        assert dist.get_backend(group) == "braid"
        _check_cases(group, [(torch.float64, True, None, (1, 4, 2, 4, 12)),
                             (torch.float32, False, False, (2, 2, 1, 3, 8))])
        # The same ring through gloo: the torch ProcessGroup path is not tied to braid's backend.
        gloo = dist.new_group(backend="gloo")
        _check_cases(gloo, [(torch.float64, True, True, (1, 2, 2, 2, 8))])
        _check_cases(None, [(torch.float64, True, False, (1, 2, 2, 3, 6))])  # None: the default group
    return True


@pytest.mark.parametrize("world_size", (2, 3))
def test_ring_attention_through_the_braid_backend(world_size):
    """The same results with the ring on torch.distributed's point-to-point (braid's backend, gloo,
    and None: the default group)."""
    assert run_ranks(_run_through_process_group, world_size) == [True] * world_size


def _run_model(rank, world_size, store_path):
    """A causal language model with its blocks' attention made context-parallel by a plan, on the
    balanced shards of the token ids, against the same model on the whole sequence: the logits,
    and the parameter gradients summed over ranks (each rank's loss covers its tokens only)."""
    from braid.bench.models import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(vocab=32, dim=16, heads=4, hidden=32, layers=2).double()
    ids = torch.randint(0, 32, (2, 8 * world_size), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    logits.sum().backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    with make_comm(rank, world_size, store_path) as c:
        cp.parallelize(model, c, ["blocks.*.attn"])
        local = model(cp.shard(ids, c, balanced=True, dim=1))
        local.sum().backward()
        # float64: the ring's LSE merges and the sum over ranks round at 1e-16 relative; measured at
        # 2-4 ranks, logits (of order 1) within 7e-16 and gradients (up to 150) within 6e-14. A
        # wrong block, mask or merge is off by 1e-2 or more.
        torch.testing.assert_close(cp.unshard(local.detach(), c, balanced=True, dim=1), logits.detach(),
                                   atol=1e-10, rtol=1e-10)
        for name, p in model.named_parameters():
            grad = p.grad.contiguous()
            c.all_reduce(grad)
            torch.testing.assert_close(grad, want[name], atol=1e-10, rtol=1e-10, msg=name)
        # Outside the planned submodules SDPA is torch's again; the context manager routes it too.
        q, k, v, _ = _inputs(1, 2, 2, 4 * world_size, 8, torch.float64)
        ql, kl, vl = (cp.shard(t, c, balanced=True) for t in (q, k, v))
        plain = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        with cp.context_parallel(c) as attention:
            assert isinstance(attention, cp.RingAttention)
            routed = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        torch.testing.assert_close(routed, cp.ring_attention(ql, kl, vl, c, causal=True), atol=0, rtol=0)
        assert not torch.allclose(plain, routed)
    return True


def test_parallelize_a_model():
    assert run_ranks(_run_model, 2) == [True] * 2


def test_one_rank_and_bad_arguments():
    """One rank: the ring is the local attention. Bad arguments raise naming what is wrong."""
    with make_comm(0, 1, new_store_path()) as c:
        q, k, v, do = _inputs(2, 4, 2, 6, 12, torch.float64)
        for causal in (False, True):
            want = _reference(q, k, v, do, causal, scale=0.3)
            got = _ring(q, k, v, do, c, causal, None, scale=0.3)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
        assert torch.equal(cp.shard_indices(6, c, balanced=True), torch.arange(6))
        x = torch.ones(1, 2, 4, 8)
        bad = [
            (lambda: cp.ring_attention(x, x, x, object()), TypeError, "group must be a braid"),
            (lambda: cp.ring_attention(x[0], x, x, c), ValueError, "q must be 4-D"),
            (lambda: cp.ring_attention(x, x.double(), x, c), ValueError, "share dtype and device"),
            (lambda: cp.ring_attention(x.long(), x.long(), x.long(), c), TypeError, "floating point"),
            (lambda: cp.ring_attention(x, x, x[:, :1], c), ValueError, "k and v must have the same shape"),
            (lambda: cp.ring_attention(x, x[..., :4], x[..., :4], c), ValueError, "head dim"),
            (lambda: cp.ring_attention(x[:, :1], x, x, c), ValueError, "kv head count"),
            (lambda: cp.ring_attention(x, x[:, :, :2], x[:, :, :2], c), ValueError, "same, non-zero local"),
            (lambda: cp.ring_attention(x[:, :, :3], x[:, :, :3], x[:, :, :3], c, causal=True), ValueError,
             "local length must be even"),
            (lambda: cp.ring_attention(x, x, x, c, causal=1), TypeError, "causal must be a bool"),
            (lambda: cp.ring_attention(x, x, x, c, balanced="yes"), TypeError, "balanced must be a bool"),
            (lambda: cp.ring_attention(x, x, x, c, scale=math.nan), TypeError, "scale must be a finite"),
            (lambda: cp.shard_indices(7, c, balanced=True), ValueError, r"seq_len \(7\) must divide into 2"),
            (lambda: cp.shard_indices(-1, c, balanced=False), ValueError, "seq_len must be a non-negative"),
            (lambda: cp.shard(x, c, balanced=None), TypeError, "balanced must be a bool"),
            (lambda: cp.shard(x, c, balanced=False, dim=4), ValueError, r"dim must be an int in \[-4, 4\)"),
            (lambda: cp.unshard([1], c, balanced=False), TypeError, "tensor must be a torch.Tensor"),
            (lambda: cp.RingAttention(c)(x, x, x, attn_mask=x), ValueError, "attn_mask is not supported"),
            (lambda: cp.RingAttention(c)(x, x, x, dropout_p=0.1), ValueError, "dropout_p must be 0"),
            (lambda: cp.RingAttention(c)(x, x[:, :1], x[:, :1]), ValueError, "enable_gqa=True"),
            (lambda: cp.parallelize(torch.nn.Linear(2, 2), c, ["attn"]), ValueError, "matches no submodule"),
            (lambda: cp.parallelize(torch.nn.Linear(2, 2), c, "attn"), TypeError, "plan must be a sequence"),
        ]
        for call, error, message in bad:
            with pytest.raises(error, match=message):
                call()


def test_math_blocks():
    """The matmul blocks (the path for inputs neither the Triton kernels nor torch's CPU attention
    take, e.g. float64 on a GPU), alone: output, LSE and the gradients from the final output and
    LSE, with GQA and causal masks, against autograd through the float64 reference."""
    q, k, v, do = _inputs(2, 6, 2, 7, 9, torch.float64)
    for causal in (False, True):
        out, lse = cp._math_forward(q, k, v, causal, 0.4)
        want = _reference(q, k, v, do, causal, scale=0.4)
        group = q.shape[1] // k.shape[1]
        scores = (q @ k.repeat_interleave(group, 1).transpose(-2, -1)) * 0.4
        if causal:
            scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(out, want[0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-12, rtol=1e-12)
        for g, w in zip(cp._math_backward(do, q, k, v, out, lse, causal, 0.4), want[1:]):
            torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_kernel_blocks(monkeypatch):
    """The blocks through braid's Triton kernels (what GPUs run; here in Triton's interpreter on
    the CPU, float32, tiny shapes): two blocks of keys, one whole and one under the causal mask,
    merged through their LSE, and each block's gradients from the merged output and LSE, against
    float64 attention over both blocks. Tolerance 1e-5: float32 blocks, measured worst 7e-7."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(cp, "_block_path", lambda q, k, v: "kernels")
    q, k, v, do = (t.to(device) for t in _inputs(1, 4, 2, 16, 16, torch.float32))
    k2, v2, _, _ = (t.to(device) for t in _inputs(1, 2, 2, 16, 16, torch.float32, seed=1))
    out, lse = cp._block_forward(q, k2, v2, False, 0.25)
    own_out, own_lse = cp._block_forward(q, k, v, True, 0.25)
    cp._merge(out, lse, own_out, own_lse)
    out = out.to(q.dtype)
    grads = [cp._block_backward(do, q, k2, v2, out, lse, False, 0.25),
             cp._block_backward(do, q, k, v, out, lse, True, 0.25)]
    leaves = [t.double().requires_grad_() for t in (q, torch.cat([k2, k], 2), torch.cat([v2, v], 2))]
    visible = torch.ones(16, 32, dtype=torch.bool, device=device)
    visible[:, 16:] = visible[:, 16:].tril()
    want = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(2, 1),
                                          leaves[2].repeat_interleave(2, 1), attn_mask=visible, scale=0.25)
    want.backward(do.double())
    tol = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close((grads[0][0] + grads[1][0]).double(), leaves[0].grad, **tol)
    for i in (1, 2):
        torch.testing.assert_close(torch.cat([grads[0][i], grads[1][i]], 2).double(), leaves[i].grad, **tol)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tcp", (False, True))
@pytest.mark.slow
def test_benchmark_runs(tmp_path, tcp):
    """``python -m braid.bench cp`` on tiny lengths, over shared memory and over TCP: a record per
    length with every implementation timed and the ring's result checked against one rank's."""
    out = tmp_path / "cp.json"
    argv = ["--seqs", "64", "128", "--rounds", "1", "--warmup", "1", "--json", str(out)]
    argv += ["--tcp"] if tcp else []
    proc = subprocess.run([sys.executable, "-m", "braid.bench", "cp", *argv], capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "cp" and doc["config"]["tcp"] is tcp and doc["config"]["world_size"] == 2
    assert [r["seq"] for r in doc["records"]] == [64, 128]
    for r in doc["records"]:
        assert all(r[f"{impl}_ms"] > 0 for impl in ("ring", "compute", "comm", "single", "sdpa")), r
        assert r["err"] < 1e-4 and r["exposed_ms"] >= 0 and 0 <= r["hidden"] <= 1, r
    assert "hidden" in proc.stdout


def _run_on_gpu(rank, world_size, store_path):
    """Two ranks sharing the GPU, the ring through a braid communicator (blocks staged through
    host memory): the Triton kernels' blocks against torch SDPA on the whole sequence."""
    torch.cuda.set_device(0)
    with make_comm(rank, world_size, store_path) as c:
        for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
            for causal in (False, True):
                q, k, v, do = (t.cuda() for t in _inputs(2, 8, 2, 256 * world_size, 64, dtype))
                want = _reference(q, k, v, do, causal)
                got = _ring(q, k, v, do, c, causal, None)
                for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                    # Half-precision blocks: the error grows with the values' scale.
                    what = f"{name} {dtype} causal={causal}"
                    torch.testing.assert_close(g.double(), w, atol=tol * max(1.0, w.abs().max().item()),
                                               rtol=tol, msg=lambda m, what=what: f"{what}: {m}")
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ring_attention_on_gpu():
    # The first calls autotune the kernels (several configurations each) in both processes.
    assert run_ranks(_run_on_gpu, 2, deadline_s=540) == [True] * 2
