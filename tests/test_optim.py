"""braid.optim: the C++ optimizer steps bit for bit against their documented float32 sequence
(core/optim/step.h, written here in torch), against torch's optimizers to rounding, checkpoints
both ways, and bad arguments named."""
import copy
import math

import numpy as np
import pytest
import torch
from braid import optim
from braid.comm import _C

F32 = torch.float32


def f(x: float) -> torch.Tensor:
    """A Python number rounded once to float32, as the kernels round their constants."""
    return torch.tensor(x, dtype=F32)


def sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (numpy's: torch's CPU sqrt is off by an ulp at
    times, its vector path being an approximation)."""
    return torch.from_numpy(np.sqrt(t.numpy()))


def reference_adam(p, g, m, v, vmax, step, lr, b1, b2, eps, wd, decoupled, maximize):
    """core/optim/step.h's Adam sequence, one float32 operation at a time."""
    g = g.to(F32)
    if maximize:
        g = -g
    if wd != 0:
        if decoupled:
            p = p * f(1 - lr * wd)
        else:
            g = g + f(wd) * p
    m = m + f(1 - b1) * (g - m)
    v = v * f(b2) + (f(1 - b2) * g) * g
    u = v
    if vmax is not None:
        vmax = torch.where(v > vmax, v, vmax)
        u = vmax
    inv_bc2 = f(1.0) / f(math.sqrt(1 - b2 ** step))  # float32 division of two float32 scalars
    p = p + f(-(lr / (1 - b1 ** step))) * (m / (sqrt(u) * inv_bc2 + f(eps)))
    return p, m, v, vmax


def reference_sgd(p, g, buf, lr, mu, damp, wd, nesterov, maximize, first):
    g = g.to(F32)
    if maximize:
        g = -g
    if wd != 0:
        g = g + f(wd) * p
    if mu != 0:
        buf = g.clone() if first else buf * f(mu) + f(1 - damp) * g
        g = g + f(mu) * buf if nesterov else buf
    return p + f(-lr) * g, buf


def _offset(t: torch.Tensor, shift: int) -> torch.Tensor:
    """``t`` copied into a buffer ``shift`` elements in: a misaligned start."""
    out = torch.empty(t.numel() + shift, dtype=t.dtype)[shift:]
    out.copy_(t)
    return out


# Sizes: one element, less than a block, odd, past one thread's share (65536) at two threads.
SIZES = (1, 7, 513, 200_003)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("variant", ["adamw", "adam-l2", "adamw-amsgrad-maximize", "adam-no-wd"])
def test_adam_kernel_is_the_documented_sequence_bit_for_bit(n, grad_dtype, variant):
    torch.manual_seed(n)
    decoupled = variant.startswith("adamw")
    amsgrad, maximize = "amsgrad" in variant, "maximize" in variant
    wd = 0.0 if "no-wd" in variant else 0.1
    lr, b1, b2, eps = 3e-3, 0.9, 0.95, 1e-6
    shift = n % 3
    p = _offset(torch.randn(n), shift)
    m, v = torch.zeros(n), torch.zeros(n)
    vmax = torch.zeros(n) if amsgrad else None
    rp, rm, rv, rvmax = p.clone(), m.clone(), v.clone(), None if vmax is None else vmax.clone()
    copy = torch.empty(n, dtype=torch.bfloat16)
    torch.set_num_threads(2)
    for step in (1, 2, 3):
        g = _offset((torch.randn(n) * 10 ** torch.randint(-3, 3, (n,))).to(grad_dtype), 1)
        optim.adam_step(p, g, m, v, vmax, step=step, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                        decoupled=decoupled, maximize=maximize, param_copy=copy)
        rp, rm, rv, rvmax = reference_adam(rp, g, rm, rv, rvmax, step, lr, b1, b2, eps, wd, decoupled,
                                           maximize)
        assert torch.equal(p, rp), f"param differs at step {step}"
        assert torch.equal(m, rm) and torch.equal(v, rv), f"moments differ at step {step}"
        if amsgrad:
            assert torch.equal(vmax, rvmax)
        assert torch.equal(copy, rp.to(torch.bfloat16)), "the bfloat16 copy is not the parameter rounded"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("variant", ["plain", "momentum", "nesterov-wd", "dampening-maximize"])
def test_sgd_kernel_is_the_documented_sequence_bit_for_bit(n, variant):
    torch.manual_seed(n + 1)
    mu = 0.0 if variant == "plain" else 0.9
    nesterov = variant.startswith("nesterov")
    wd = 1e-2 if "wd" in variant else 0.0
    damp = 0.25 if "dampening" in variant else 0.0
    maximize = "maximize" in variant
    p = _offset(torch.randn(n), 2)
    buf = torch.full((n,), 123.0) if mu else None  # garbage: the first step must ignore it
    rp, rbuf = p.clone(), None
    copy = torch.empty(n, dtype=torch.float16)
    for step in range(3):
        g = torch.randn(n).to(torch.bfloat16 if step == 1 else torch.float32)
        optim.sgd_step(p, g, buf, lr=0.05, momentum=mu, dampening=damp, weight_decay=wd, nesterov=nesterov,
                       maximize=maximize, first=step == 0, param_copy=copy)
        rp, rbuf = reference_sgd(rp, g, rbuf, 0.05, mu, damp, wd, nesterov, maximize, step == 0)
        assert torch.equal(p, rp), f"param differs at step {step}"
        if mu:
            assert torch.equal(buf, rbuf)
        assert torch.equal(copy, rp.to(torch.float16))


# braid against torch after a few steps: per step an element differs by an ulp or two (torch fuses
# multiply-adds in lerp and add-with-alpha, and its CPU sqrt is off by an ulp at times); Adam's
# division by sqrt(v) + eps amplifies that for elements with tiny second moments, and 20 steps
# compound it. 1e-4 relative is 10^3 float32 ulps: far below what a wrong formula gives (the
# parameters move by > 1e-3, checked).
TORCH_TOL = {"rtol": 1e-4, "atol": 1e-5}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 7))


def _train(model, opt, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


CASES = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, amsgrad=True)),
    ("Adam", dict(lr=1e-2, weight_decay=1e-3, maximize=True)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    ("SGD", dict(lr=0.1, momentum=0.5, dampening=0.1)),
    ("SGD", dict(lr=0.1)),
]


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_training_matches_torch_to_rounding(name, kwargs):
    """20 steps of a small model with braid's optimizer and with torch's (default single-tensor
    implementation) from the same start: the same parameters to rounding."""
    ours, theirs = _model(1), _model(1)
    _train(ours, getattr(optim, name)(ours.parameters(), **kwargs), 20)
    _train(theirs, getattr(torch.optim, name)(theirs.parameters(), **kwargs, foreach=False), 20)
    for a, b, start in zip(ours.parameters(), theirs.parameters(), _model(1).parameters()):
        torch.testing.assert_close(a, b, **TORCH_TOL)
        assert (a - start).abs().max() > 1e-3, "the parameters did not move"


@pytest.mark.parametrize("name,kwargs", CASES[:4], ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES[:4])])
def test_checkpoints_resume_bitwise_and_load_into_torch(name, kwargs):
    """A braid checkpoint resumes bit for bit; it loads into torch's optimizer (same state layout)
    and torch's into braid's, both going on to rounding."""
    straight = _model(2)
    opt = getattr(optim, name)(straight.parameters(), **kwargs)
    _train(straight, opt, 5, seed=1)
    _train(straight, opt, 5, seed=2)

    first = _model(2)
    opt1 = getattr(optim, name)(first.parameters(), **kwargs)
    _train(first, opt1, 5, seed=1)
    # Copies: a state_dict holds the optimizer's own tensors, which loading does not copy.
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt1.state_dict())

    resumed = _model(3)
    resumed.load_state_dict(saved_model)
    opt2 = getattr(optim, name)(resumed.parameters(), **kwargs)
    opt2.load_state_dict(copy.deepcopy(saved_opt))
    _train(resumed, opt2, 5, seed=2)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)

    into_torch = _model(3)
    into_torch.load_state_dict(saved_model)
    topt = getattr(torch.optim, name)(into_torch.parameters(), **kwargs, foreach=False)
    topt.load_state_dict(copy.deepcopy(saved_opt))
    _train(into_torch, topt, 5, seed=2)
    for a, b in zip(straight.parameters(), into_torch.parameters()):
        torch.testing.assert_close(a, b, **TORCH_TOL)

    torch_run = _model(2)
    topt = getattr(torch.optim, name)(torch_run.parameters(), **kwargs, foreach=False)
    _train(torch_run, topt, 5, seed=1)
    into_braid = _model(3)
    into_braid.load_state_dict(torch_run.state_dict())
    bopt = getattr(optim, name)(into_braid.parameters(), **kwargs)
    bopt.load_state_dict(copy.deepcopy(topt.state_dict()))
    _train(torch_run, topt, 5, seed=2)
    _train(into_braid, bopt, 5, seed=2)
    for a, b in zip(torch_run.parameters(), into_braid.parameters()):
        torch.testing.assert_close(a, b, **TORCH_TOL)


def test_bad_arguments_are_named():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="lr"):
        optim.AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        optim.Adam([p], betas=(0.9, 1.0))
    with pytest.raises(TypeError, match="betas"):
        optim.Adam([p], betas=0.9)
    with pytest.raises(ValueError, match="nesterov"):
        optim.SGD([p], nesterov=True)
    half = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    half.grad = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float32 parameters"):
        optim.AdamW([half]).step()
    z = torch.zeros(8)
    with pytest.raises(ValueError, match="exp_avg must have 8 elements"):
        optim.adam_step(z, torch.zeros(8), torch.zeros(7), torch.zeros(8), step=1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        optim.adam_step(z, torch.zeros(8), torch.zeros(8), torch.zeros(8), step=0)
    with pytest.raises(ValueError, match="param and exp_avg must not share memory"):
        optim.adam_step(z, torch.zeros(8), z, torch.zeros(8), step=1)
    with pytest.raises(TypeError, match="grad must have dtype"):
        optim.adam_step(z, torch.zeros(8, dtype=torch.int32), torch.zeros(8), torch.zeros(8), step=1)
    with pytest.raises(ValueError, match="momentum needs momentum_buffer"):
        optim.sgd_step(z, torch.zeros(8), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="contiguous"):
        optim.adam_step(torch.zeros(8, 2)[:, 0], torch.zeros(8), torch.zeros(8), torch.zeros(8), step=1)
    assert _C.adam_step.__doc__

