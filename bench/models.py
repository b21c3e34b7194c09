"""Small pre-norm transformer models shared by the benchmarks and the tests (batch-first, causal),
and how they are split across ranks: tensor-parallel plans, pipeline schedules' stage layouts.

The views size themselves from the tensors (``view(b, s, -1, head_dim)``), so the same code runs
dense and tensor-parallel (each rank holding 1/N of the heads and of the MLP), with or without
sequence parallelism (the projections then see the whole sequence while the block's input is
a slice of it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v and output projections."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must divide by heads={heads}")
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.))."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LanguageModel(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and an untied output head."""

    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# Tensor-parallel plans (braid.comm.tp.parallelize) for the models above: heads and the MLP's
# hidden features split by columns, the projections back by rows.
BLOCK_PLAN = {"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise",
              "mlp.up": "colwise", "mlp.down": "rowwise"}
BLOCK_SEQUENCE_PLAN = {**BLOCK_PLAN, "norm1": "sequence", "norm2": "sequence"}


def lm_plan(sequence_parallel: bool) -> dict:
    """The plan of :class:`LanguageModel`: vocabulary-parallel embedding, every block as
    BLOCK_PLAN, column-parallel head gathered back to whole logits."""
    block = BLOCK_SEQUENCE_PLAN if sequence_parallel else BLOCK_PLAN
    plan: dict = {"embed": "vocab", "head": ("colwise", {"gather_output": True})}
    plan.update({f"blocks.*.{name}": style for name, style in block.items()})
    if sequence_parallel:
        plan["norm"] = "sequence"
    return plan


# Pipeline schedules of torch.distributed.pipelining by class name: stages per rank (what its
# paper assumes).
SCHEDULE_STAGES = {
    "ScheduleGPipe": 1,
    "Schedule1F1B": 1,
    "ScheduleInterleaved1F1B": 2,
    "ScheduleLoopedBFS": 2,
    "ScheduleInterleavedZeroBubble": 2,
}


def available_schedules() -> list[str]:
    """The schedules of SCHEDULE_STAGES that the installed torch has."""
    from torch.distributed import pipelining

    return [name for name in SCHEDULE_STAGES if hasattr(pipelining, name)]


def local_stage_indices(rank: int, ranks: int, per_rank: int) -> list[int]:
    """Stages of ``rank`` in the looped layout: r, r + P, r + 2P, ..."""
    return [rank + k * ranks for k in range(per_rank)]
