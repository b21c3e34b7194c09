"""The sharding tests' model and training loop (test_zero.py: braid's ZeRO wrapper; test_fsdp2.py: FSDP2
with braid's collectives): a small language model, its batches and loss, the steps both runs of a
comparison take, and the groups braid's layers run on per carrier.

Tolerance 1e-5 (float32, values of order 1): the two runs compute the same gradients and average
them in a different order (DDP divides before a gloo sum, braid sums in rank order then divides),
a few ulps per step; a missing, doubled or misplaced reduction is off by O(1e-2) or more.
SGD with momentum, not Adam: Adam divides by the gradient's magnitude, which turns rounding noise
in near-zero gradients into O(lr) parameter differences.
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from braid.bench.models import LanguageModel

from helpers.ranks import STORE_TIMEOUT, make_comm

# float32 of order 1: the same gradients averaged in another order, a few ulps (1.2e-7 relative
# each) per step; a missing, doubled or misplaced reduction is off by O(1e-2) or more.
TOL = {"atol": 1e-5, "rtol": 1e-5}
VOCAB, DIM, HEADS, HIDDEN, LAYERS, BATCH, SEQ = 40, 24, 4, 40, 2, 2, 10


# Small enough that each block splits into several buckets and some parameters straddle shards.
BUCKET_CAP_MB = 4096 / 2**20


def lm_model(seed=0):
    torch.manual_seed(seed)
    return LanguageModel(VOCAB, DIM, HEADS, HIDDEN, LAYERS)


def small_lm(seed: int = 0) -> nn.Module:
    """A smaller language model of plain layers (embedding, MLP, LayerNorm, head) for tests that
    train it many times: the ZeRO wrapper's optimizer placements (step_in_backward, offload)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 24), nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24),
                         nn.LayerNorm(24), nn.Linear(24, 50))


def small_lm_loss(model: nn.Module, rank: int, step: int, micro: int) -> torch.Tensor:
    """``small_lm``'s next-token loss (in float32 whatever the compute dtype) on the batch of
    (rank, step, micro-batch)."""
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    ids = torch.randint(0, 50, (4, 9), generator=g)
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 50).float(), ids[:, 1:].reshape(-1))


def lm_batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def lm_loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def train_steps(model, opt, rank, steps, micro_batches, no_sync, clip=None):
    """``steps`` optimizer steps; each accumulates ``micro_batches`` backward passes, all but the
    last inside ``no_sync`` (when given), then ``clip()`` (when given) before the step. Returns
    the loss of every step's first micro-batch, and the gradient norms ``clip`` returned."""
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            # The same batches every step: the loss must fall, so the run checks that training happens.
            ids = lm_batch(rank, 0, micro)
            last = micro == micro_batches - 1
            with (no_sync() if no_sync is not None and not last else contextlib.nullcontext()):
                loss = lm_loss(model, ids) / micro_batches
                loss.backward()
            if micro == 0:
                losses.append(loss.item())
        if clip is not None:
            norms.append(float(clip()))
        opt.step()
    return (losses, norms) if clip is not None else losses


def assert_same_params(actual: dict, expected: dict):
    assert list(actual) == list(expected)
    for k, v in expected.items():
        torch.testing.assert_close(actual[k], v, **TOL, msg=lambda m, k=k: f"{k}: {m}")


def carrier_in(kind, rank, world_size, store_path):
    """Inside a gloo default group: the group braid's layers run on for carrier ``kind``: a
    Communicator, the gloo group itself, or a new group of braid's c10d backend."""
    if kind == "communicator":
        return make_comm(rank, world_size, store_path)
    if kind == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="braid", timeout=STORE_TIMEOUT)


def assert_exact(actual: dict, expected: dict):
    """The same keys in the same order, every tensor bitwise equal."""
    assert list(actual) == list(expected)
    for k in expected:
        assert torch.equal(actual[k], expected[k]), k
