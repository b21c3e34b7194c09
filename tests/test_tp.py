"""Tensor-parallel layers and regions on 1-4 ranks against the same dense model run locally.

Each rank builds the dense model from one seed, shards a copy with braid.comm.tp, runs both on the
same inputs and compares outputs and gradients (its shard against the matching slice of the dense
gradient). Tolerance 1e-5 (float32, values of order 1): the sharded model sums the same products
in a different order (partial matmuls then an all-reduce), which moves results by a few ulps per
layer, far below 1e-5; a wrong shard, a missing or doubled reduction is off by O(1).
"""
import copy
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from braid.bench.models import BLOCK_PLAN, BLOCK_SEQUENCE_PLAN, Block, LanguageModel, lm_plan
from braid.comm import tp
from helpers import MatmulRecorder
from braid.comm.core.group import as_group
from helpers.ranks import CARRIERS, carrier, make_comm, run_ranks
from torch import nn

# float32 of order 1: partial matmuls and an all-reduce round in another order than the dense
# model, a few ulps (1.2e-7 relative each) per layer; a wrong shard or reduction is off by O(1).
TOL = {"atol": 1e-5, "rtol": 1e-5}
VOCAB, DIM, HEADS, HIDDEN, BATCH, SEQ = 48, 24, 12, 48, 2, 12  # all divide by 2, 3 and 4


# -- helpers run in the ranks --------------------------------------------------------------------
def _shard_of(dense: torch.Tensor, dim: int, c) -> torch.Tensor:
    g = as_group(c)
    return dense.chunk(g.world_size, dim)[g.rank]


def _with_carrier(rank, world_size, store_path, kind, fn, *args):
    """Runs ``fn(c, rank, world_size, *args)`` with ``c`` the group of carrier ``kind``."""
    with carrier(kind, rank, world_size, store_path) as c:
        return fn(c, rank, world_size, *args)


def on_communicator(rank, world_size, store_path, name, *args):
    """The rank function ``name`` of this file on a braid Communicator (test_multihost.py runs it
    across simulated hosts, naming it)."""
    return _with_carrier(rank, world_size, store_path, "communicator", globals()[name], *args)


def _check_grads(model: nn.Module, dense: nn.Module, c) -> int:
    """Compares every parameter's gradient with the matching slice of the dense model's gradient;
    returns how many tensors were compared."""
    checked = 0
    dense_modules = dict(dense.named_modules())
    for name, module in model.named_modules():
        ref = dense_modules[name]
        if isinstance(module, tp.ColumnParallelLinear):
            pairs = [(module.weight, ref.weight, 0), (module.bias, ref.bias, 0)]
        elif isinstance(module, tp.RowParallelLinear):
            pairs = [(module.weight, ref.weight, 1), (module.bias, ref.bias, None)]
        elif isinstance(module, tp.VocabParallelEmbedding):
            pairs = [(module.weight, ref.weight, 0)]
        else:
            pairs = [(p, getattr(ref, n), None) for n, p in module.named_parameters(recurse=False)]
        for mine, theirs, dim in pairs:
            if mine is None:
                continue
            expected = theirs.grad if dim is None else _shard_of(theirs.grad, dim, c)
            torch.testing.assert_close(mine.grad, expected, **TOL, msg=lambda m, name=name: f"{name}: {m}")
            checked += 1
    return checked


def _run_block(c, rank, world_size, sequence_parallel, compiled=False):
    torch.manual_seed(0)
    dense = Block(DIM, HEADS, HIDDEN)
    plan = BLOCK_SEQUENCE_PLAN if sequence_parallel else BLOCK_PLAN
    model = tp.parallelize(copy.deepcopy(dense), c, plan, sequence_parallel=sequence_parallel)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, generator=g)
    weights = torch.randn(BATCH, SEQ, DIM, generator=g) / SEQ  # a loss that weighs every output

    x_dense = x.clone().requires_grad_()
    out_dense = dense(x_dense)
    (out_dense * weights).sum().backward()

    x_tp = x.clone().requires_grad_()
    inp = tp.scatter_to_sequence_region(x_tp, c) if sequence_parallel else x_tp
    # aot_eager: dynamo and AOT autograd around braid's autograd functions, without inductor's
    # C++ compilation.
    out = (torch.compile(model, backend="aot_eager") if compiled else model)(inp)
    if sequence_parallel:
        assert out.shape == (BATCH, SEQ // world_size, DIM)
        out = tp.gather_from_sequence_region(out, c, tensor_parallel_output_grad=False)
    (out * weights).sum().backward()
    torch.testing.assert_close(out, out_dense, **TOL)
    torch.testing.assert_close(x_tp.grad, x_dense.grad, **TOL)
    return _check_grads(model, dense, c)


def _run_embedding(c, rank, world_size, sequence_parallel):
    torch.manual_seed(0)
    dense = nn.Embedding(VOCAB, DIM, padding_idx=VOCAB // 2 + 1)
    emb = tp.VocabParallelEmbedding.from_dense(dense, c, sequence_parallel=sequence_parallel)
    # Every shard boundary, the padding row and both ends of the vocabulary appear.
    per = VOCAB // world_size
    edges = [i for r in range(world_size) for i in (r * per, r * per + per - 1)]
    ids = torch.tensor(edges + [VOCAB // 2 + 1] * 2 + [0, VOCAB - 1] * 3, dtype=torch.int64)
    ids = torch.cat([ids, torch.randint(0, VOCAB, (2 * SEQ - ids.numel() % SEQ,),
                                        generator=torch.Generator().manual_seed(2))])
    ids = ids[: (ids.numel() // SEQ) * SEQ].view(-1, SEQ)
    weights = torch.randn(*ids.shape, DIM, generator=torch.Generator().manual_seed(3))
    out_dense = dense(ids)
    (out_dense * weights).sum().backward()
    out = emb(ids)
    if sequence_parallel:
        out = tp.gather_from_sequence_region(out, c, tensor_parallel_output_grad=False)
    (out * weights).sum().backward()
    torch.testing.assert_close(out, out_dense, **TOL)
    torch.testing.assert_close(emb.weight.grad, _shard_of(dense.weight.grad, 0, c), **TOL)
    assert torch.equal(emb.to_dense().weight, dense.weight)
    return True


def _run_training(c, rank, world_size, sequence_parallel, steps):
    torch.manual_seed(0)
    dense = LanguageModel(VOCAB, DIM, HEADS, HIDDEN, layers=2)
    model = tp.parallelize(copy.deepcopy(dense), c, lm_plan(sequence_parallel),
                           sequence_parallel=sequence_parallel)
    # SGD with momentum, not Adam: Adam divides by the gradient's magnitude, which turns
    # rounding noise in near-zero gradients into O(lr) parameter differences.
    opts = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (dense, model)]
    # One batch over and over: the loss must fall, so the run checks that training happens.
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(steps):
        step_losses = []
        for m, opt in zip((dense, model), opts):
            opt.zero_grad()
            logits = m(ids[:, :-1])  # whole logits on every rank: the head gathers its output
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
    for d_loss, t_loss in losses:
        assert abs(d_loss - t_loss) <= 1e-5, losses
    assert losses[-1][0] < losses[0][0], f"the model did not train: {losses}"
    # Gather the sharded model back and compare every parameter with dense training.
    for name, module in list(model.named_modules()):
        if hasattr(module, "to_dense"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.to_dense())
    ref = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, ref[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    return [t for _, t in losses]


def _run_regions(c, rank, world_size):
    """Each region's forward and backward against sums and concatenations of every rank's tensors
    (integer-valued float64: exact)."""
    n = world_size

    def per_rank(r, *shape, salt=0):
        return torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(100 * salt + r)).double()

    def run(region, x, grad, *args, **kwargs):
        x = x.clone().requires_grad_()
        y = region(x, c, *args, **kwargs)
        y.backward(grad)
        return y.detach(), x.grad

    shape = (2 * n, 3 * n, 4 * n)
    mine = per_rank(rank, *shape)
    every = [per_rank(r, *shape) for r in range(n)]
    same = per_rank(99, *shape)
    total = sum(every)

    y, dx = run(tp.copy_to_region, mine, mine)
    assert torch.equal(y, mine) and torch.equal(dx, total)
    y, dx = run(tp.reduce_from_region, mine, mine)
    assert torch.equal(y, total) and torch.equal(dx, mine)
    for dim in (-1, 0, 1):
        chunk = shape[dim] // n
        part = [per_rank(r, *(s if i != dim % 3 else chunk for i, s in enumerate(shape)), salt=1)
                for r in range(n)]
        whole = torch.cat(part, dim)
        y, dx = run(tp.scatter_to_region, same, part[rank], dim)
        assert torch.equal(y, _shard_of(same, dim, c)) and torch.equal(dx, whole)
        y, dx = run(tp.gather_from_region, part[rank], same, dim)
        assert torch.equal(y, whole) and torch.equal(dx, _shard_of(same, dim, c))
        y, dx = run(tp.gather_from_sequence_region, part[rank], mine, dim)
        assert torch.equal(y, whole) and torch.equal(dx, _shard_of(total, dim, c))
        y, dx = run(tp.gather_from_sequence_region, part[rank], same, dim,
                    tensor_parallel_output_grad=False)
        assert torch.equal(dx, _shard_of(same, dim, c))
        y, dx = run(tp.reduce_scatter_to_sequence_region, mine, part[rank], dim)
        assert torch.equal(y, _shard_of(total, dim, c)) and torch.equal(dx, whole)
        y, dx = run(tp.scatter_to_sequence_region, same, part[rank], dim)
        assert torch.equal(y, _shard_of(same, dim, c)) and torch.equal(dx, whole)
    return True


def _run_2x2(rank, world_size, store_path, kind):
    """Rank r is TP rank r % 2 of replica r // 2 (see test_tp_inside_dp_on_sub_groups_of_a_2x2_layout)."""
    tp_index, dp_index = rank % 2, rank // 2
    if kind == "communicator":  # a Communicator per sub-group, each on its own store prefix
        tp_group = make_comm(tp_index, 2, store_path, prefix=f"tp{dp_index}/")
        dp_group = make_comm(dp_index, 2, store_path, prefix=f"dp{tp_index}/")
        return _tp_inside_dp(tp_group, dp_group, tp_index, dp_index)
    with carrier(kind, rank, world_size, store_path):
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        return _tp_inside_dp(tp_groups[dp_index], dp_groups[tp_index], tp_index, dp_index)


def _tp_inside_dp(tp_group, dp_group, tp_index, dp_index):
    torch.manual_seed(0)
    dense = Block(DIM, HEADS, HIDDEN)
    source = copy.deepcopy(dense)
    if tp_index != 0:  # from_dense must take the weights of the TP sub-group's rank 0
        with torch.no_grad():
            for m in source.modules():
                if isinstance(m, nn.Linear):
                    m.weight.add_(1.0)
    model = tp.parallelize(source, tp_group, BLOCK_PLAN)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(BATCH, SEQ, DIM, generator=g) for _ in range(2)]
    weights = torch.randn(BATCH, SEQ, DIM, generator=g) / SEQ
    (sum((dense(x) * weights).sum() for x in batches) / 2).backward()
    out = model(batches[dp_index])
    with torch.no_grad():
        torch.testing.assert_close(out, dense(batches[dp_index]), **TOL)
    (out * weights).sum().backward()
    dp = as_group(dp_group)
    for p in model.parameters():
        dp.all_reduce(p.grad, "avg")
    return _check_grads(model, dense, tp_group)


class _RecordingComm:
    """Forwards to a communicator and logs each collective (and each async wait) by name."""

    def __init__(self, inner, log):
        self._inner, self.log = inner, log
        self.rank, self.world_size = inner.rank, inner.world_size

    def __getattr__(self, name):
        method = getattr(self._inner, name)

        def call(*args, async_op=False, **kwargs):
            self.log.append(name + (" async" if async_op else ""))
            work = method(*args, async_op=async_op, **kwargs)
            if work is None:
                return None
            log = self.log
            return types.SimpleNamespace(wait=lambda: (log.append("wait"), work.wait())[1])
        return call


def _run_overlap(c, rank, world_size, sequence_parallel):
    """The column layer's backward starts the input-gradient collective before the weight-gradient
    product and waits for it after (and, sequence-parallel, gathers its input around the
    input-gradient product)."""
    log: list = []
    c = _RecordingComm(as_group(c), log)
    layer = tp.ColumnParallelLinear(8, 8, group=c, sequence_parallel=sequence_parallel)
    x = torch.randn(2, 4, 8, requires_grad=True)
    y = layer(x)
    del log[:]
    with MatmulRecorder(log):
        y.sum().backward()
    return log


# -- tests ---------------------------------------------------------------------------------------
# Every test runs over each carrier: braid's Communicator, a gloo ProcessGroup and a ProcessGroup of
# braid's c10d backend (helpers.ranks.CARRIERS). The Communicator runs every world size; the process
# groups run a share of them, enough to see each path at 2, 3 and 4 ranks.
def _cases(world_sizes, group_world_sizes):
    return [(kind, n) for kind in CARRIERS
            for n in (world_sizes if kind == "communicator" else group_world_sizes)]


@pytest.mark.parametrize("kind,world_size", _cases((2, 3, 4), (2, 3, 4)))
def test_regions_forward_and_backward(kind, world_size):
    assert run_ranks(_with_carrier, world_size, kind, _run_regions) == [True] * world_size


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
@pytest.mark.parametrize("kind,world_size", _cases((1, 2, 3, 4), (2, 4)))
def test_transformer_block_matches_dense(kind, world_size, sequence_parallel):
    """Attention heads split by columns, output projection by rows, MLP column then row: outputs,
    input gradient and every parameter gradient equal the dense block's."""
    checked = run_ranks(_with_carrier, world_size, kind, _run_block, sequence_parallel)
    assert checked == [checked[0]] * world_size and checked[0] == 16  # 8 linear, 2 norms: all params


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
@pytest.mark.slow
def test_transformer_block_under_torch_compile_matches_dense(sequence_parallel):
    """The same block compiled (torch.compile around braid's autograd functions): outputs and
    every gradient still equal the dense block's."""
    assert run_ranks(_with_carrier, 2, "communicator", _run_block, sequence_parallel, True) == [16, 16]


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
@pytest.mark.parametrize("kind,world_size", _cases((2, 3, 4), (3,)))
def test_vocab_parallel_embedding_matches_dense(kind, world_size, sequence_parallel):
    results = run_ranks(_with_carrier, world_size, kind, _run_embedding, sequence_parallel)
    assert results == [True] * world_size


@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
@pytest.mark.parametrize("kind,world_size", _cases((2, 3, 4), (2, 3, 4)))
def test_training_matches_dense(kind, world_size, sequence_parallel):
    """A two-block language model trained for several steps with TP ends with the dense model's
    parameters, and every rank saw the dense loss."""
    losses = run_ranks(_with_carrier, world_size, kind, _run_training, sequence_parallel, 5)
    assert all(run == losses[0] for run in losses)


@pytest.mark.parametrize("kind", ("communicator", "gloo"))
@pytest.mark.parametrize("sequence_parallel", (False, True), ids=("tp", "tp+sp"))
def test_column_backward_overlaps_input_gradient_collective(sequence_parallel, kind):
    log = run_ranks(_with_carrier, 2, kind, _run_overlap, sequence_parallel)[0]
    if sequence_parallel:
        assert log == ["all_gather async", "mm", "wait", "reduce_scatter async", "mm", "wait"], log
    else:
        assert log == ["mm", "all_reduce async", "mm", "wait"], log


@pytest.mark.parametrize("kind", CARRIERS)
def test_tp_inside_dp_on_sub_groups_of_a_2x2_layout(kind):
    """Four ranks as 2 data-parallel replicas of 2 tensor-parallel ranks: TP layers on each TP
    sub-group (ranks {0, 1} and {2, 3}), gradients averaged over each DP sub-group ({0, 2},
    {1, 3}). from_dense takes the weights of the sub-group's rank 0 (global 0 or 2), outputs equal
    the dense block's on the replica's batch, and the averaged gradients equal the dense block's
    gradient of the mean loss over both batches."""
    assert run_ranks(_run_2x2, 4, kind) == [16] * 4


# -- single process ------------------------------------------------------------------------------
def _fake_comm(world_size: int, rank: int = 0):
    """Shape checks happen before any collective: a stand-in with the communicator's attributes."""
    def never(*args, **kwargs):
        raise AssertionError("no collective expected")
    return types.SimpleNamespace(rank=rank, world_size=world_size, all_reduce=never, all_gather=never,
                                 reduce_scatter=never, broadcast=never)


def test_indivisible_dimensions_raise_value_error_naming_them():
    c = _fake_comm(3)
    with pytest.raises(ValueError, match="out_features=8 does not divide evenly by the world size 3"):
        tp.ColumnParallelLinear(6, 8, group=c)
    with pytest.raises(ValueError, match="in_features=10 does not divide"):
        tp.RowParallelLinear(10, 6, group=c)
    with pytest.raises(ValueError, match="num_embeddings=10 does not divide"):
        tp.VocabParallelEmbedding(10, 6, group=c)
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        tp.ColumnParallelLinear(6, 0, group=c)
    with pytest.raises(ValueError, match="sequence_parallel requires input_is_parallel"):
        tp.RowParallelLinear(6, 6, group=c, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(TypeError, match="group must be a braid.comm.Communicator"):
        tp.ColumnParallelLinear(6, 6, group=object())
    with pytest.raises(TypeError, match="sequence_dim must be an int, got 'x'"):
        tp.ColumnParallelLinear(6, 6, group=c, sequence_parallel=True, sequence_dim="x")
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        tp.RowParallelLinear(6, 6, group=c, sequence_parallel="yes")
    with pytest.raises(TypeError, match="dim must be an int, got 1.5"):
        tp.gather_from_region(torch.ones(2, 2), c, dim=1.5)


def test_plan_errors_name_the_entry():
    c = _fake_comm(1)
    model = Block(DIM, HEADS, HIDDEN)
    with pytest.raises(ValueError, match="'attn.nope' matches no submodule"):
        tp.parallelize(model, c, {"attn.nope": "colwise"})
    with pytest.raises(TypeError, match="'norm1' is a LayerNorm"):
        tp.parallelize(model, c, {"norm1": "colwise"})
    with pytest.raises(ValueError, match=r"plan\['attn.wq'\] must be one of"):
        tp.parallelize(model, c, {"attn.wq": "diagonal"})
    with pytest.raises(ValueError, match="'sequence' but sequence_parallel=False"):
        tp.parallelize(model, c, {"norm1": "sequence"})
    with pytest.raises(ValueError, match="max_norm=1.0 is not supported"):
        tp.VocabParallelEmbedding.from_dense(nn.Embedding(4, 2, max_norm=1.0), c)


def test_sequence_length_must_divide():
    c = _fake_comm(2)
    layer = tp.RowParallelLinear(4, 4, group=c, sequence_parallel=True, sequence_dim=1)
    with pytest.raises(ValueError, match=r"dimension 1 of size 3 \(shape \(2, 3, 4\)\) does not divide"):
        layer(torch.randn(2, 3, 2))


def test_embedding_rejects_out_of_range_ids():
    emb = tp.VocabParallelEmbedding(8, 2, group=_fake_comm(1))
    with pytest.raises(IndexError, match=r"ids must be in \[0, 8\)"):
        emb(torch.tensor([0, 8]))


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_init_matches_dense_layers_from_the_same_seed(world_size):
    """Without from_dense, ranks seeded alike hold the slices of the nn.Linear / nn.Embedding that
    seed builds, so a model's initialization does not depend on the world size."""
    for rank in range(world_size):
        c = _fake_comm(world_size, rank)
        torch.manual_seed(5)
        col, row = tp.ColumnParallelLinear(8, 12, group=c), tp.RowParallelLinear(12, 8, group=c)
        emb = tp.VocabParallelEmbedding(16, 4, group=c, padding_idx=3)
        torch.manual_seed(5)
        dcol, drow, demb = nn.Linear(8, 12), nn.Linear(12, 8), nn.Embedding(16, 4, padding_idx=3)
        assert torch.equal(col.weight, _shard_of(dcol.weight, 0, c))
        assert torch.equal(col.bias, _shard_of(dcol.bias, 0, c))
        assert torch.equal(row.weight, _shard_of(drow.weight, 1, c))
        assert torch.equal(row.bias, drow.bias)
        assert torch.equal(emb.weight, _shard_of(demb.weight, 0, c))


def _run_round_trip(c, rank, world_size):
    torch.manual_seed(rank)  # ranks differ: from_dense must take rank 0's weights
    layers = [nn.Linear(12, 24), nn.Linear(24, 12, bias=False), nn.Embedding(36, 8)]
    kinds = [tp.ColumnParallelLinear, tp.RowParallelLinear, tp.VocabParallelEmbedding]
    layers[1].weight.requires_grad_(False)
    for layer, kind in zip(layers, kinds):
        back = kind.from_dense(layer, c).to_dense()
        assert type(back) is type(layer)
        for name, p in layer.named_parameters():
            q = getattr(back, name)
            assert q.requires_grad == p.requires_grad
            buf = p.detach().clone()
            as_group(c).broadcast(buf, 0)
            assert torch.equal(q, buf), name
        if rank == 0:
            assert all(torch.equal(getattr(back, n), p) for n, p in layer.named_parameters())
    # src=None keeps each rank's own slice.
    own = tp.ColumnParallelLinear.from_dense(layers[0], c, src=None)
    assert torch.equal(own.weight, _shard_of(layers[0].weight.detach(), 0, c))
    # A copy of a sharded model (an EMA, say) shares the communicator and works.
    twin = copy.deepcopy(own)
    assert twin.communicator is as_group(c) and twin.weight is not own.weight
    x = torch.randn(3, 12)
    torch.testing.assert_close(twin(x), own(x), rtol=0, atol=0)
    return True


@pytest.mark.parametrize("kind,world_size", _cases((2, 3), (3,)))
def test_from_dense_to_dense_round_trip_exactly(kind, world_size):
    assert run_ranks(_with_carrier, world_size, kind, _run_round_trip) == [True] * world_size


def _run_vocab_loss(c, rank, world_size):
    """vocab_parallel_cross_entropy on each rank's vocabulary slice against F.cross_entropy of the
    whole logits: the loss, and the gradient of each rank's slice, for every reduction, with
    ignored targets, and in bfloat16."""
    g = torch.Generator().manual_seed(7)
    vocab = 24
    logits = torch.randn(3, 5, vocab, generator=g) * 4
    target = torch.randint(0, vocab, (3, 5), generator=g)
    target[0, :2] = -100
    per = vocab // world_size
    checked = 0
    for reduction in ("mean", "sum", "none"):
        dense = logits.clone().requires_grad_()
        want = F.cross_entropy(dense.flatten(0, 1), target.flatten(), reduction=reduction)
        want = want.view(3, 5) if reduction == "none" else want
        weights = torch.rand(want.shape, generator=g) if reduction == "none" else torch.tensor(1.0)
        (want * weights).sum().backward()
        mine = logits[..., rank * per:(rank + 1) * per].clone().requires_grad_()
        got = tp.vocab_parallel_cross_entropy(mine, target, c, reduction=reduction)
        (got * weights).sum().backward()
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine.grad, dense.grad[..., rank * per:(rank + 1) * per], rtol=1e-5,
                                   atol=1e-6)
        assert not mine.grad[0, :2].any()  # ignored tokens give no gradient
        checked += 1
    half = logits[..., rank * per:(rank + 1) * per].to(torch.bfloat16).requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(half, target, c)
    loss.backward()
    want = F.cross_entropy(logits.to(torch.bfloat16).float().flatten(0, 1), target.flatten())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert half.grad.dtype == torch.bfloat16
    with pytest.raises(IndexError, match="outside the vocabulary"):
        tp.vocab_parallel_cross_entropy(mine, torch.full((3, 5), vocab), c)
    with pytest.raises(ValueError, match="reduction"):
        tp.vocab_parallel_cross_entropy(mine, target, c, reduction="avg")
    return checked


@pytest.mark.parametrize("kind,world_size", _cases((1, 2, 3, 4), (2, 3)))
def test_vocab_parallel_cross_entropy_matches_dense(kind, world_size):
    assert run_ranks(_with_carrier, world_size, kind, _run_vocab_loss) == [3] * world_size
