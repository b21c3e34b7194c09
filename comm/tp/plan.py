"""Applying a tensor-parallel plan to an existing model: named submodules replaced by braid layers."""
from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch import nn

from ..core.group import as_group, renamed_args
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .regions import all_reduce

Style = Union[str, tuple]
_LAYERS = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear, "vocab": VocabParallelEmbedding}
_STYLES = (*_LAYERS, "sequence")


def _parse_style(pattern: str, style: Style) -> tuple[str, dict]:
    options: Any = {}
    if isinstance(style, tuple) and len(style) == 2:
        style, options = style
    if style not in _STYLES or not isinstance(options, Mapping):
        raise ValueError(f"plan[{pattern!r}] must be one of {', '.join(map(repr, _STYLES))}, or a "
                         f"(style, options dict) pair; got {style!r}")
    return style, dict(options)


@renamed_args(communicator="group")
def mark_sequence_parallel(module: nn.Module, group: Any, *, src: Optional[int] = 0) -> nn.Module:
    """Marks ``module`` (typically a LayerNorm/RMSNorm) as running on sequence slices: each rank
    sees its part of the sequence, so the gradient of every parameter is summed over the ranks
    (through a hook on each parameter). With ``src`` the parameters are first broadcast from that
    rank. Returns ``module``; marking it twice is a no-op."""
    group = as_group(group, "group", "mark_sequence_parallel")
    if getattr(module, "_braid_sequence_parallel", None) is not None:
        return module
    params = [p for p in module.parameters() if p.requires_grad]
    if src is not None and group.world_size > 1:
        with torch.no_grad():
            for p in module.parameters():
                buf = p.detach().clone(memory_format=torch.contiguous_format)
                group.broadcast(buf, src)
                p.copy_(buf)
    # The hook gets a gradient autograd may share with other consumers: sum a copy.
    handles = [p.register_hook(lambda g: all_reduce(g.clone(memory_format=torch.contiguous_format),
                                                    group)) for p in params]
    module._braid_sequence_parallel = handles
    return module


@renamed_args(communicator="group")
def parallelize(module: nn.Module, group: Any, plan: Mapping[str, Style], *,
                sequence_parallel: bool = False, src: Optional[int] = 0) -> nn.Module:
    """Shards the submodules of ``module`` named in ``plan`` with braid's tensor-parallel layers,
    in place, and returns ``module``. Every rank calls it with the same plan.

    ``plan`` maps submodule names (``fnmatch`` patterns such as ``"layers.*.mlp.up"``) to a style:

    - ``"colwise"``: an ``nn.Linear`` becomes a :class:`ColumnParallelLinear`;
    - ``"rowwise"``: an ``nn.Linear`` becomes a :class:`RowParallelLinear` (input already split);
    - ``"vocab"``: an ``nn.Embedding`` becomes a :class:`VocabParallelEmbedding`;
    - ``"sequence"``: a module on sequence slices (norms, with ``sequence_parallel=True``): its
      parameter gradients are summed over ranks (see :func:`mark_sequence_parallel`);

    or a ``(style, options)`` pair whose options go to the layer (``{"gather_output": True}``).
    With ``sequence_parallel=True`` the layers run sequence-parallel (the activations between
    them split along ``sequence_dim``, default 1). Weights come from rank ``src`` (broadcast),
    or from each rank's own copy with ``src=None``. The model's code must size its views from
    the tensors (e.g. ``x.view(b, s, -1, head_dim)``), since each rank holds 1/N of the heads.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize: plan must be a mapping of submodule names to styles, "
                        f"got {type(plan).__name__}")
    group = as_group(group, "group", "parallelize")
    names = [name for name, _ in module.named_modules() if name]
    for pattern, style in plan.items():
        kind, options = _parse_style(pattern, style)
        matches = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            raise ValueError(f"parallelize: plan entry {pattern!r} matches no submodule of "
                             f"{type(module).__name__}")
        for name in matches:
            sub = module.get_submodule(name)
            if kind == "sequence":
                if not sequence_parallel:
                    raise ValueError(f"parallelize: plan[{pattern!r}] is 'sequence' but "
                                     "sequence_parallel=False")
                mark_sequence_parallel(sub, group, src=src)
                continue
            layer = _LAYERS[kind]
            dense = nn.Embedding if kind == "vocab" else nn.Linear
            if type(sub) is not dense:
                raise TypeError(f"parallelize: plan[{pattern!r}] is {kind!r}, which shards an "
                                f"{dense.__name__}, but {name!r} is a {type(sub).__name__}")
            kwargs = {"sequence_parallel": sequence_parallel, **options}
            parent_name, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent_name), child,
                    layer.from_dense(sub, group, src=src, **kwargs))
    return module
