"""Optimizer steps in host memory: braid's C++ Adam, AdamW and SGD (``braid.optim``).

The step of each parameter is one pass over its memory (core/optim/step.h): the float32 parameter,
its gradient (float32, bfloat16 or float16) and the optimizer state are read once and written
once, vectorized by the compiler for the build machine's instruction set and split over torch's
intra-op threads (``torch.set_num_threads``). The classes are drop-ins for torch's on CPU
parameters: same arguments, same ``state_dict`` layout (a checkpoint of one loads into the
other), results equal to torch's up to rounding::

    opt = braid.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

The functions are the step itself on flat tensors, for code that keeps float32 master weights
apart from the parameters the model computes with (ZeRO-Offload): they read a low-precision
gradient and write the low-precision copy of the parameter in the same pass::

    braid.optim.adam_step(master, grad_bf16, exp_avg, exp_avg_sq, step=t, lr=1e-4,
                          weight_decay=0.01, param_copy=param_bf16)

FSDP2's parameters (DTensors) step shard by shard, each rank its local shard, the state kept as
DTensors like torch's optimizers keep it: with ``CPUOffloadPolicy`` the shards, their gradients
and the state live in host memory, and braid's step replaces torch's there.

The arithmetic, per element, is spelled out in core/optim/step.h; tests/test_optim.py checks the
kernels bit for bit against that sequence written in torch, and against torch's optimizers to
rounding.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple, Union

import torch

import braid.comm._C as _C  # the extension module

__all__ = ["Adam", "AdamW", "ParamStepper", "SGD", "adam_step", "sgd_step"]

_STEP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:  # FSDP2's parameters (fully_shard): each rank steps its local shard
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = ()


def _local(t: torch.Tensor) -> torch.Tensor:
    """What a step reads and writes of ``t``: a DTensor's local shard (FSDP2's parameters, their
    gradients, and the state made like them, which stays a DTensor for distributed checkpoints),
    else ``t`` itself. Optimizer steps are elementwise, so each rank's shard steps alone."""
    return t._local_tensor if isinstance(t, _DTensor) else t


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              max_exp_avg_sq: Optional[torch.Tensor] = None, *, step: int, lr: float = 1e-3,
              betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
              decoupled: bool = True, maximize: bool = False,
              param_copy: Optional[torch.Tensor] = None) -> None:
    """One Adam step in place on contiguous CPU tensors of equal element count.

    Args:
        param, exp_avg, exp_avg_sq: float32; ``max_exp_avg_sq`` too, given exactly for AMSGrad.
        grad: float32, bfloat16 or float16.
        step: this step's number, 1 for the first (the bias corrections use it).
        decoupled: AdamW's weight decay (the parameter shrinks by ``lr * weight_decay``) when
            True, Adam's L2 term (``weight_decay * param`` added to the gradient) when False.
        param_copy: float32, bfloat16 or float16; receives the updated parameter, rounded to
            nearest even, in the same pass.
    """
    beta1, beta2 = _betas(betas)
    _C.adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step=int(step), lr=_number(lr, "lr"),
                 beta1=beta1, beta2=beta2, eps=_number(eps, "eps"),
                 weight_decay=_number(weight_decay, "weight_decay"), decoupled=bool(decoupled),
                 amsgrad=max_exp_avg_sq is not None, maximize=bool(maximize), param_copy=param_copy)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor] = None, *,
             lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
             nesterov: bool = False, maximize: bool = False, first: bool = False,
             param_copy: Optional[torch.Tensor] = None) -> None:
    """One SGD step in place on contiguous CPU tensors of equal element count: ``param`` (and
    ``momentum_buffer``, given exactly when ``momentum != 0``) float32, ``grad`` and ``param_copy``
    float32, bfloat16 or float16. ``first``: the momentum buffer starts as this step's gradient
    (torch's first step), its old contents ignored."""
    _C.sgd_step(param, grad, momentum_buffer, lr=_number(lr, "lr"), momentum=_number(momentum, "momentum"),
                dampening=_number(dampening, "dampening"), weight_decay=_number(weight_decay, "weight_decay"),
                nesterov=bool(nesterov), maximize=bool(maximize), first=bool(first), param_copy=param_copy)


def _number(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _betas(betas: Any) -> Tuple[float, float]:
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise TypeError(f"betas must be a pair of numbers, got {betas!r}") from None
    return _number(beta1, "betas[0]"), _number(beta2, "betas[1]")


def _check_param(p: torch.Tensor, where: str) -> None:
    if p.device.type != "cpu":
        raise ValueError(f"{where}: braid.optim steps CPU parameters, got one on {p.device}")
    if p.dtype != torch.float32:
        raise TypeError(f"{where}: braid.optim steps float32 parameters (keep float32 master weights), "
                        f"got {p.dtype}")
    if not _local(p).is_contiguous():
        raise ValueError(f"{where}: the parameter must be contiguous")
    if p.grad is not None and (p.grad.is_sparse or p.grad.dtype not in _STEP_DTYPES):
        raise TypeError(f"{where}: the gradient must be dense float32, bfloat16 or float16, got "
                        f"{'a sparse tensor' if p.grad.is_sparse else p.grad.dtype}")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return _local(t).contiguous().view(-1)


def _group_of(opt: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    """The param group holding ``param`` (checked as step() checks it); ValueError if none does.
    An index by identity, rebuilt when a parameter is not in it (add_param_group)."""
    index = getattr(opt, "_braid_groups", None)
    if index is None or id(param) not in index or index[id(param)][0] is not param:
        index = {}
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                index[id(p)] = (p, group, f"param_groups[{gi}]['params'][{pi}]")
        opt._braid_groups = index
    entry = index.get(id(param))
    if entry is None or entry[0] is not param:
        raise ValueError("step_param: the parameter is not one of this optimizer's")
    _check_param(param, entry[2])
    return entry[1]


class ParamStepper(torch.optim.Optimizer):
    """What braid's optimizers share: ``step()`` over every parameter with a gradient, and
    ``step_param(param, grad)`` for one parameter, which the DDP hook's ``optimizer=`` and the
    ZeRO wrapper's ``step_in_backward`` call as each bucket is reduced. While one of them steps
    this optimizer, ``stepped_by`` names it and ``step()`` raises (it would step twice)."""

    stepped_by: Optional[str] = None

    def _step_one(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of every parameter that has a gradient; returns the closure's loss, if any."""
        if self.stepped_by is not None:
            raise RuntimeError(f"this optimizer is stepped by {self.stepped_by} as each gradient bucket is "
                               "reduced: calling step() would step twice")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    _check_param(p, f"param_groups[{gi}]['params'][{pi}]")
                    self._step_one(group, p, p.grad)
        return loss

    @torch.no_grad()
    def step_param(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """One step of ``param`` alone, with ``grad`` for its gradient (which may be a view of a
        gradient bucket)."""
        self._step_one(_group_of(self, param), param, grad)


class Adam(ParamStepper):
    """torch.optim.Adam's algorithm on CPU float32 parameters, each step one pass in C++.

    Arguments as torch's (``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``,
    ``maximize``); ``state_dict`` as torch's: ``step`` (a float32 scalar tensor), ``exp_avg``,
    ``exp_avg_sq`` and, with AMSGrad, ``max_exp_avg_sq``.
    """

    _decoupled = False

    def __init__(self, params: Iterable, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, maximize: bool = False):
        lr = _number(lr, "lr")
        beta1, beta2 = _betas(betas)
        for name, value, lo, hi in (("lr", lr, 0.0, None), ("betas[0]", beta1, 0.0, 1.0),
                                    ("betas[1]", beta2, 0.0, 1.0), ("eps", _number(eps, "eps"), 0.0, None),
                                    ("weight_decay", _number(weight_decay, "weight_decay"), 0.0, None)):
            if not (value >= lo and (hi is None or value < hi)):
                top = "inf" if hi is None else f"{hi:g}"
                raise ValueError(f"{name} must be in [{lo:g}, {top}), got {value!r}")
        defaults = dict(lr=lr, betas=(beta1, beta2), eps=float(eps), weight_decay=float(weight_decay),
                        amsgrad=bool(amsgrad), maximize=bool(maximize))
        super().__init__(params, defaults)

    def _step_one(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["step"] += 1
        adam_step(_local(p).view(-1), _flat(grad), _local(state["exp_avg"]).view(-1),
                  _local(state["exp_avg_sq"]).view(-1),
                  _local(state["max_exp_avg_sq"]).view(-1) if group["amsgrad"] else None,
                  step=int(state["step"].item()), lr=group["lr"], betas=group["betas"], eps=group["eps"],
                  weight_decay=group["weight_decay"], decoupled=self._decoupled, maximize=group["maximize"])


class AdamW(Adam):
    """torch.optim.AdamW's algorithm (decoupled weight decay, default 0.01) on CPU float32
    parameters, each step one pass in C++; otherwise as :class:`Adam`."""

    _decoupled = True

    def __init__(self, params: Iterable, lr: Union[float, torch.Tensor] = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)


class SGD(ParamStepper):
    """torch.optim.SGD's algorithm (momentum, dampening, Nesterov, weight decay, maximize) on
    CPU float32 parameters, each step one pass in C++; ``state_dict`` as torch's
    (``momentum_buffer``)."""

    def __init__(self, params: Iterable, lr: Union[float, torch.Tensor] = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False):
        lr, momentum = _number(lr, "lr"), _number(momentum, "momentum")
        weight_decay = _number(weight_decay, "weight_decay")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        dampening = _number(dampening, "dampening")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov momentum needs momentum > 0 and dampening = 0")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov), maximize=bool(maximize))
        super().__init__(params, defaults)

    def _step_one(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        buf = None
        first = False
        if group["momentum"] != 0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = torch.empty_like(p, memory_format=torch.contiguous_format)
                state["momentum_buffer"] = buf
                first = True
            buf = _local(buf).view(-1)
        sgd_step(_local(p).view(-1), _flat(grad), buf, lr=group["lr"], momentum=group["momentum"],
                 dampening=group["dampening"], weight_decay=group["weight_decay"],
                 nesterov=group["nesterov"], maximize=group["maximize"], first=first)
