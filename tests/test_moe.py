"""Expert parallelism (braid.comm.moe) against a dense float64 MoE written here, on 1-4 ranks.

Every rank builds the dense model (router and E experts) from one seed and regenerates every rank's
tokens, so it can compute the dense result of the whole job; the expert-parallel layer holds only
its rank's experts and sees only its rank's tokens. Compared: each rank's output and input
gradient, the router's gradient summed over the ranks (each rank's router sees its own tokens),
and every local expert's parameter gradients (the dispatch brings every rank's tokens to it).

Tolerance in float64, rtol 1e-9 / atol 1e-12: the layer sums the same products in other orders
(an expert's weight gradient over all ranks' tokens in one product, the reference rank by rank),
which moves results by a few ulps (~1e-16 relative); a token routed to the wrong expert, lost,
doubled or weighted wrongly is off by O(1).

The dense reference routes with its own code (softmax, top-k, the capacity rule written as loops
over experts) and computes the losses from their formulas. Across simulated hosts (BRAID_HOST_ID)
the hierarchical dispatch must be exact and send each token once per remote host; the compressed
dispatch must equal the dense model fed the same quantized tokens (the backward passes the
gradient straight through the rounding), and stay within a bound derived from the int8/fp8 step.

Padded to capacity, a forward and backward after the first read nothing on the host: on CPU the
ways to read a tensor's value are patched to raise (and the guard is shown to catch each), on a
GPU torch's sync debug mode raises at any stream sync. The GPU cases (marked) run the layer on
CUDA tensors against the same dense reference, the reference on the CPU.
"""
import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
from braid.comm import moe
from braid.comm.core.build_info import is_cuda_build
from braid.comm.ddp import comm_hook
from braid.comm.core.group import as_group
from braid.comm.core.group_carrier import host_groups
from helpers.ranks import carrier, environment, make_comm, new_store_path, process_group, run_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

TOL = {"rtol": 1e-9, "atol": 1e-12}  # float64, other summation orders: why, in the module docstring
D, HIDDEN = 6, 10
# GELU's derivative is at most 1.1289 (at x ~ 1.4142): an ExpertMLP's Lipschitz constant is at
# most 1.1289 ||W_down||_2 ||W_up||_2.
GELU_SLOPE = 1.129


# -- the dense reference -------------------------------------------------------------------------
def _dense(seed: int, num_experts: int, dtype=torch.float64):
    torch.manual_seed(seed)
    router = nn.Linear(D, num_experts, bias=False, dtype=dtype)
    experts = [moe.ExpertMLP(D, HIDDEN, dtype=dtype) for _ in range(num_experts)]
    return router, experts


def _tokens(seed: int, rank: int, count: int, shape=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    x = torch.randn(count, D, generator=g, dtype=torch.float64)
    return x.view(*shape, D) if shape else x


def _reference_keep(ids: list, weights: list, num_experts: int, cap: int, policy: str) -> list:
    """The documented capacity rule, as loops: per expert, its assignments ordered by weight
    (highest first) or by token, the earlier token first among equals; the first ``cap`` kept."""
    keep = [[True] * len(row) for row in ids]
    for e in range(num_experts):
        mine = [(t, j) for t, row in enumerate(ids) for j, i in enumerate(row) if i == e]
        if policy == "probs":
            mine.sort(key=lambda tj: (-weights[tj[0]][tj[1]], tj[0]))
        for t, j in mine[cap:]:
            keep[t][j] = False
    return keep


def _reference(router, experts, x, cfg, quantize=None):
    """The dense MoE on one rank's tokens ``x`` (..., D): (y, aux + z loss, tokens per expert,
    dropped). ``quantize``: the experts see ``quantize(x)``, its gradient passed straight through."""
    k, num_experts = cfg["top_k"], len(experts)
    flat = x.reshape(-1, D)
    t = flat.shape[0]
    logits = router(flat)
    probs = torch.softmax(logits, -1)
    scores = probs.detach() + cfg["bias"] if cfg.get("bias") is not None else probs.detach()
    ids = scores.topk(k, -1).indices
    w = probs.gather(1, ids)
    if cfg.get("normalize", True):
        w = w / w.sum(-1, keepdim=True)
    keep = torch.ones(t, k, dtype=torch.bool)
    if cfg.get("capacity") is not None and t:
        cap = math.ceil(cfg["capacity"] * t * k / num_experts)
        keep = torch.tensor(_reference_keep(ids.tolist(), w.tolist(), num_experts, cap, cfg["policy"]))
    inputs = flat if quantize is None else flat + (quantize(flat.detach()) - flat).detach()
    y = torch.zeros_like(flat)
    for e in range(num_experts):
        tok, j = ((ids == e) & keep).nonzero(as_tuple=True)
        y = y.index_add(0, tok, experts[e](inputs[tok]) * w[tok, j].unsqueeze(1))
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    loss = logits.new_zeros(())
    if t and cfg.get("aux"):
        f = counts.double() / (t * k)
        loss = loss + cfg["aux"] * num_experts * (f * probs.mean(0)).sum()
    if t and cfg.get("z"):
        loss = loss + cfg["z"] * (torch.logsumexp(logits, -1) ** 2).mean()
    return y.view(x.shape), loss, counts, int((~keep).sum())


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _compare(layer, router, experts, x, xs, cfg, group, label, quantize=None, guard=None) -> list:
    """Runs ``layer`` on this rank's ``x`` (moved to the layer's device) and the dense model on
    every rank's tokens ``xs`` (on the CPU); returns the failures (each "label: what"). With
    ``guard`` (a context manager factory), a first forward runs before and the compared forward
    and backward run inside the guard."""
    g = as_group(group)
    rank, n = g.rank, g.world_size
    device = layer.router.weight.device
    for p in [router.weight, *(q for e in experts for q in e.parameters())]:
        p.grad = None  # the dense model serves several layers
    gen = torch.Generator().manual_seed(7)
    out_grads = [torch.randn(xi.shape, generator=gen, dtype=torch.float64) for xi in xs]
    x = x.to(device, copy=True).requires_grad_()
    dy = out_grads[rank].to(device)  # before the guard: a copy from pageable host memory waits
    if guard is not None:
        with torch.no_grad():  # the first forward: where the ranks sit, read on the host once
            layer(x)
    with guard() if guard is not None else contextlib.nullcontext():
        y, aux = layer(x)
        ((y * dy).sum() + aux).backward()
    dense_x = [xi.clone().requires_grad_() for xi in xs]
    total = 0
    refs = []
    for r in range(n):
        ref = _reference(router, experts, dense_x[r], cfg, quantize)
        refs.append(ref)
        total = total + (ref[0] * out_grads[r]).sum() + ref[1]
    total.backward()
    failures = []

    def check(what, a, b):
        try:
            torch.testing.assert_close(a, b, **TOL)
        except AssertionError as e:
            failures.append(f"{label}: {what}: {str(e).splitlines()[0:4]}")

    check("output", y.detach().cpu(), refs[rank][0].detach())
    check("aux loss", aux.detach().cpu(), refs[rank][1].detach())
    check("input gradient", x.grad.cpu(), dense_x[rank].grad)
    router_grad = layer.router.weight.grad.clone()
    g.all_reduce(router_grad)
    check("router gradient (summed over ranks)", router_grad.cpu(), _grad(router.weight))
    for i, e in enumerate(layer.local_experts):
        for (name, p), q in zip(layer.experts[i].named_parameters(), experts[e].parameters()):
            check(f"expert {e} {name} gradient", _grad(p).cpu(), _grad(q))
    stats = layer.stats()
    if stats["tokens_per_expert"] != refs[rank][2].tolist() or stats["dropped"] != refs[rank][3]:
        failures.append(f"{label}: stats {stats['tokens_per_expert']} dropped {stats['dropped']}, reference "
                        f"{refs[rank][2].tolist()} dropped {refs[rank][3]}")
    return failures


# Cases of the exactness runs: top-1 (unnormalized: the router then learns from the output), top-2
# with both losses and no tokens on rank 0, top-3 with 4 experts per rank and few tokens (experts
# with nothing to do), capacity with either drop policy, tokens shaped (2, T/2, D).
CASES = (
    {"top_k": 1, "per_rank": 2, "normalize": False, "tokens": (7, 5, 9, 3)},
    {"top_k": 2, "per_rank": 2, "aux": 0.01, "z": 1e-3, "tokens": (0, 6, 8, 5)},
    {"top_k": 3, "per_rank": 4, "tokens": (2, 1, 3, 2)},
    {"top_k": 2, "per_rank": 2, "capacity": 0.5, "policy": "probs", "tokens": (12, 10, 12, 9)},
    {"top_k": 2, "per_rank": 3, "capacity": 0.75, "policy": "position", "tokens": (10, 12, 8, 10),
     "shape": True},
    # Padded to capacity (equal pieces, no counts exchanged): the same drops, the same results.
    {"top_k": 2, "per_rank": 2, "capacity": 0.5, "policy": "probs", "tokens": (10, 10, 10, 10), "pad": True},
    {"top_k": 1, "per_rank": 3, "capacity": 1.5, "policy": "position", "normalize": False,
     "tokens": (8, 8, 8, 8), "pad": True},
)


def _layer_kwargs(cfg: dict) -> dict:
    return {"top_k": cfg["top_k"], "normalize_topk": cfg.get("normalize", True),
            "capacity_factor": cfg.get("capacity"), "drop_policy": cfg.get("policy", "probs"),
            "aux_loss_coeff": cfg.get("aux", 0.0), "z_loss_coeff": cfg.get("z", 0.0),
            "pad_to_capacity": cfg.get("pad", False)}


class HostCopies(TorchDispatchMode):
    """Records the operators that copy a value from the device to the host (.item(), .tolist(),
    a nonzero's size): on a GPU each one makes the host wait for the stream."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.bincount", "aten.unique")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith(self.SYNCING):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


class HostRead(AssertionError):
    """A read of a tensor's value on the host where none may happen."""


# The Python ways to read a tensor's value on the host (on a GPU each waits for the stream);
# .tolist() reads the data without dispatching an operator, which HostCopies cannot see.
HOST_READS = ("tolist", "item", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads():
    """Raises HostRead at any read of a tensor's value on the host inside the block: the methods
    of HOST_READS and ``torch.nonzero`` patched to raise, and the operators HostCopies records
    (those reached from C++ as well) checked when the block ends."""
    def refuse(name):
        def read(*args, **kwargs):
            raise HostRead(f"{name} called")
        return read

    with pytest.MonkeyPatch.context() as patch, HostCopies() as mode:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        patch.setattr(torch, "nonzero", refuse("torch.nonzero"))
        yield
    if mode.seen:
        raise HostRead(f"operators that copy to the host ran: {sorted(set(mode.seen))}")


def _exactness_cases(group, rank: int, n: int) -> list:
    """CASES against the dense model; the padded ones, after their first forward, under
    no_host_reads."""
    failures = []
    for c, cfg in enumerate(CASES):
        num_experts = cfg["per_rank"] * n
        router, experts = _dense(10 + c, num_experts)
        layer = moe.MoE.from_dense(copy.deepcopy(router), copy.deepcopy(experts), group, **_layer_kwargs(cfg))
        counts = [cfg["tokens"][r % 4] for r in range(n)]
        shapes = [(2, t // 2) if cfg.get("shape") and t % 2 == 0 else None for t in counts]
        xs = [_tokens(c, r, counts[r], shapes[r]) for r in range(n)]
        failures += _compare(layer, router, experts, xs[rank], xs, cfg, group, f"case {c} {cfg}",
                             guard=no_host_reads if cfg.get("pad") else None)
    return failures


def _padded_needs_equal_tokens(group, rank: int, n: int) -> list:
    """pad_to_capacity with a different number of tokens on each rank: the first forward raises
    ValueError on every rank, with every rank's count."""
    router, experts = _dense(41, 2 * n)
    layer = moe.MoE.from_dense(router, experts, group, top_k=2, capacity_factor=1.0, pad_to_capacity=True)
    try:
        layer(_tokens(41, rank, 4 + rank))
    except ValueError as e:
        want = f"needs the same number of tokens on every rank (x holds {4 + rank} here; by rank: " \
               f"{[4 + r for r in range(n)]})"
        return [] if want in str(e) else [f"unequal tokens, padded: {e}"]
    return ["unequal tokens, padded: no error"]


def _dispatch_layout(group, rank: int, n: int) -> list:
    """dispatch() on its own: the rows of each local expert contiguous, source rank then token
    order within it, counts in the handle; combine() of outputs f_e(x) = (e + 1) x weights them."""
    failures = []
    num_experts, k, local = 2 * n, 2, 2
    gen = torch.Generator().manual_seed(3)
    every = [torch.randn(4 + r, D, generator=gen, dtype=torch.float64) for r in range(n)]
    # Distinct experts per token (the router's top-k), some assignments left out (-1).
    ids = [torch.where(torch.rand(4 + r, k, generator=gen) < 0.2, -1,
                       torch.rand(4 + r, num_experts, generator=gen).topk(k, -1).indices) for r in range(n)]
    weights = [torch.rand(4 + r, k, generator=gen, dtype=torch.float64) for r in range(n)]
    inputs, handle = moe.dispatch(every[rank], ids[rank], weights[rank], group, num_experts=num_experts)
    expect, counts = [], []
    for i in range(local):
        e = rank * local + i
        rows = [every[s][(ids[s] == e).any(1)] for s in range(n)]
        expect += rows
        counts.append(sum(r.shape[0] for r in rows))
    if handle.counts != counts or not torch.equal(inputs, torch.cat(expect)):
        failures.append(f"dispatch layout: counts {handle.counts}, expected {counts}")
    scale = torch.cat([torch.full((c, 1), float(rank * local + i + 1), dtype=torch.float64)
                       for i, c in enumerate(counts)])
    y = moe.combine(inputs * scale, handle)
    w = torch.where(ids[rank] >= 0, weights[rank] * (ids[rank] + 1), 0.0)
    try:
        torch.testing.assert_close(y, every[rank] * w.sum(1, keepdim=True), **TOL)
    except AssertionError as e:
        failures.append(f"combine: {e}")
    return failures


def _uneven_all_to_all(group, rank: int, n: int) -> list:
    """The group interface's all_to_all with split sizes: rank i sends i + j + 1 rows to rank j."""
    g = as_group(group)
    send = [rank + j + 1 for j in range(n)]
    recv = [i + rank + 1 for i in range(n)]
    x = torch.arange(sum(send) * 2, dtype=torch.float32).view(-1, 2) + 1000 * rank
    out = torch.empty(sum(recv), 2)
    g.all_to_all(out, x, output_split_sizes=recv, input_split_sizes=send)
    pieces = []
    for i in range(n):
        mine = torch.arange(sum(i + j + 1 for j in range(n)) * 2, dtype=torch.float32).view(-1, 2) + 1000 * i
        start = sum(i + j + 1 for j in range(rank))
        pieces.append(mine[start:start + i + rank + 1])
    return [] if torch.equal(out, torch.cat(pieces)) else ["uneven all_to_all rows differ"]


def _run_exact(rank, world_size, store_path, kind):
    with carrier(kind, rank, world_size, store_path) as group:
        failures = _uneven_all_to_all(group, rank, world_size)
        failures += _dispatch_layout(group, rank, world_size)
        failures += _exactness_cases(group, rank, world_size)
        failures += _padded_needs_equal_tokens(group, rank, world_size)
        as_group(group).barrier()
        return failures


@pytest.mark.parametrize("kind,world_size", [("communicator", 2), ("communicator", 3), ("communicator", 4),
                                             ("gloo", 2), ("gloo", 3), ("gloo", 4), ("braid", 3)])
def test_moe_equals_dense(kind, world_size):
    """Output, input gradient, router gradient and every expert's gradients equal the dense
    float64 MoE: top-1/2/3, both losses, capacity with both drop policies, a rank with no tokens,
    experts with none, padded to capacity without a host read after the first forward (and
    refused with unequal token counts); dispatch() and combine() on their own; the group's uneven
    all_to_all."""
    for r, failures in enumerate(run_ranks(_run_exact, world_size, kind)):
        assert not failures, f"rank {r}: " + "\n".join(failures)


# -- across simulated hosts ------------------------------------------------------------------------
def _lipschitz(expert: moe.ExpertMLP) -> float:
    return GELU_SLOPE * float(torch.linalg.matrix_norm(expert.down.weight, 2)
                              * torch.linalg.matrix_norm(expert.up.weight, 2))


def _hosts_cases(group, hosts, rank: int, n: int) -> tuple:
    """Hierarchical exact, int8 and fp8 against the dense model; (failures, what crossed)."""
    failures, crossed = [], {}
    # top-3 with capacity: dropped assignments (-1) travel nowhere, on hosts as in the flat dispatch.
    for c, (k, per_rank) in enumerate(((2, 2), (3, 3))):
        cfg = {"top_k": k} if k == 2 else {"top_k": k, "capacity": 0.75, "policy": "probs"}
        num_experts = per_rank * n
        router, experts = _dense(40 + c, num_experts)
        xs = [_tokens(40 + c, r, 16 + 3 * r) for r in range(n)]
        for mode in ("flat", "hierarchical", "int8", "fp8"):
            codec = None if mode in ("flat", "hierarchical") else moe.RowQuantizer(mode)
            layer = moe.MoE.from_dense(copy.deepcopy(router), copy.deepcopy(experts), group,
                                       hierarchical=False if mode == "flat" else hosts,
                                       dispatch_compression=codec, **_layer_kwargs(cfg))
            quantize = None if codec is None else (lambda v, q=codec: q.decode(q.encode(v), v.dtype))
            label = f"top-{k} {mode}"
            failures += _compare(layer, router, experts, xs[rank], xs, cfg, group, label, quantize)
            crossed[label] = layer.stats()["across_hosts"]
            if codec is not None:  # against the unquantized dense model, within the rounding's bound
                x = xs[rank]
                err = (codec.decode(codec.encode(x), x.dtype) - x).abs()
                scale = x.abs().amax(1, keepdim=True)
                bound = scale / 254 if mode == "int8" else x.abs() / 16 + scale / 448 * 2 ** -9
                if not bool((err <= bound * (1 + 1e-12)).all()):
                    failures.append(f"{label}: quantization error above its step")
                with torch.no_grad():
                    y, _ = layer(x)
                    exact = _reference(router, experts, x, cfg)[0]
                    # Routing sees exact tokens: each expert's output moves by at most its
                    # Lipschitz constant times the token's error, weighted (weights sum to 1).
                    lip = max(_lipschitz(e) for e in experts)
                    allowed = lip * torch.linalg.vector_norm(err, dim=1) * (1 + 1e-9)
                    off = torch.linalg.vector_norm(y - exact, dim=1)
                if not bool((off <= allowed).all()):
                    failures.append(f"{label}: off the exact output by {off.max():.3g} > {allowed.max():.3g}")
    return failures, crossed


def _row_multiset(t: torch.Tensor) -> list:
    return sorted(map(tuple, t.tolist()))


def _hosts_dispatch(group, hosts, rank: int, n: int) -> list:
    """dispatch(..., hosts=) on its own, twice (the host layout gathered once): the expert inputs
    hold, per local expert, the rows of every rank's tokens routed to it (in some order); combine()
    of outputs (e + 1) x weights them."""
    failures = []
    num_experts, k = 2 * n, 2
    gen = torch.Generator().manual_seed(9)
    every = [torch.randn(5 + r, D, generator=gen, dtype=torch.float64) for r in range(n)]
    ids = [torch.rand(5 + r, num_experts, generator=gen).topk(k, -1).indices for r in range(n)]
    weights = [torch.rand(5 + r, k, generator=gen, dtype=torch.float64) for r in range(n)]
    for _ in range(2):
        inputs, handle = moe.dispatch(every[rank], ids[rank], weights[rank], group, num_experts=num_experts,
                                      hosts=hosts)
        rows = inputs.split(handle.counts)
        scale = []
        for i, got in enumerate(rows):
            e = rank * 2 + i
            expect = torch.cat([every[s][(ids[s] == e).any(1)] for s in range(n)])
            if _row_multiset(got) != _row_multiset(expect):
                failures.append(f"dispatch with hosts: expert {e} got other rows")
            scale.append(torch.full((got.shape[0], 1), float(e + 1), dtype=torch.float64))
        y = moe.combine(inputs * torch.cat(scale), handle)
        if not torch.allclose(y, every[rank] * (weights[rank] * (ids[rank] + 1)).sum(1, keepdim=True), **TOL):
            failures.append("combine with hosts: wrong weighted sums")
    return failures


def _run_hosts(rank, world_size, store_path, kind, host_of):
    with environment({"BRAID_HOST_ID": f"host{host_of[rank]}"}):
        with carrier(kind, rank, world_size, store_path) as group:
            hosts = group.split_by_host() if kind == "communicator" else host_groups(dist.group.WORLD)
            failures, crossed = _hosts_cases(group, hosts, rank, world_size)
            failures += _hosts_dispatch(group, hosts, rank, world_size)
            as_group(group).barrier()
            if kind == "communicator":
                hosts.intra.group.close()
                hosts.inter.group.close()
            return failures, crossed


@pytest.mark.parametrize("kind,host_of", [("communicator", (0, 0, 1, 1)), ("gloo", (0, 0, 1, 1)),
                                          ("communicator", (0, 1, 0, 1))])
def test_moe_across_hosts(kind, host_of):
    """2 simulated hosts x 2 ranks (grouped, and interleaved): the hierarchical dispatch equals the
    dense MoE and sends each token once per remote host holding one of its experts (the lower
    bound), fewer rows than the flat dispatch; int8 and fp8 dispatch equal the dense MoE on the
    quantized tokens (gradients straight through) and stay within the bound of their rounding."""
    for r, (failures, crossed) in enumerate(run_ranks(_run_hosts, 4, kind, host_of)):
        assert not failures, f"rank {r}: " + "\n".join(failures)
        for k in (2, 3):
            flat, hier = crossed[f"top-{k} flat"], crossed[f"top-{k} hierarchical"]
            assert hier["rows"] == hier["rows_lower_bound"] == flat["rows_lower_bound"] > 0, crossed
            assert flat["rows"] > hier["rows"], crossed
            row = D * 8
            assert flat["bytes"]["dispatch"] == flat["rows"] * row, crossed
            assert hier["bytes"]["dispatch"] == hier["rows"] * (row + k * 12), crossed  # + weights, targets
            # int8: one byte per value and a float32 scale per row instead of 8 bytes per value.
            assert crossed[f"top-{k} int8"]["bytes"]["dispatch"] == hier["rows"] * (D + 4 + k * 12), crossed


# -- on CUDA tensors ---------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Two ranks sharing the GPU, on two simulated hosts (BRAID_HOST_ID): dropless with both losses,
# capacity, padded (after its first forward, no stream sync), hierarchical exact and int8.
GPU_CASES = (
    ("dropless", {"top_k": 2, "per_rank": 2, "aux": 0.01, "z": 1e-3, "tokens": (9, 6)}),
    ("capacity", {"top_k": 2, "per_rank": 3, "capacity": 0.5, "policy": "probs", "tokens": (12, 10)}),
    ("padded", {"top_k": 2, "per_rank": 2, "capacity": 0.75, "policy": "position", "tokens": (10, 10),
                "pad": True}),
    ("hierarchical", {"top_k": 2, "per_rank": 2, "tokens": (8, 11), "hosts": True}),
    ("int8", {"top_k": 3, "per_rank": 2, "tokens": (7, 12), "hosts": True, "codec": "int8"}),
)


@contextlib.contextmanager
def no_stream_syncs():
    """torch raises at any operation that makes the host wait for a CUDA stream inside the block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _run_gpu(rank, world_size, store_path, kind):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    failures = []
    with environment({"BRAID_HOST_ID": f"host{rank}"}):
        if kind == "nccl":
            ctx = process_group(rank, world_size, store_path, backend="nccl")
        else:
            ctx = carrier(kind, rank, world_size, store_path)
        with ctx as group:
            group = dist.group.WORLD if group is None else group
            hosts = group.split_by_host() if kind == "communicator" else host_groups(dist.group.WORLD)
            for c, (name, cfg) in enumerate(GPU_CASES):
                router, experts = _dense(90 + c, cfg["per_rank"] * world_size)
                codec = moe.RowQuantizer(cfg["codec"]) if "codec" in cfg else None
                layer = moe.MoE.from_dense(copy.deepcopy(router).to(device),
                                           [copy.deepcopy(e).to(device) for e in experts], group,
                                           hierarchical=hosts if cfg.get("hosts") else False,
                                           dispatch_compression=codec, **_layer_kwargs(cfg))
                quantize = None if codec is None else (lambda v, q=codec: q.decode(q.encode(v), v.dtype))
                # gloo moves host memory: its group copies CUDA tensors down and back, which waits
                # for the stream by nature; the layer's own freedom from syncs is checked on the
                # other groups (and on CPU by no_host_reads).
                guard = no_stream_syncs if cfg.get("pad") and kind != "gloo" else None
                xs = [_tokens(90 + c, r, cfg["tokens"][r]) for r in range(world_size)]
                failures += _compare(layer, router, experts, xs[rank], xs, cfg, group, f"{kind} {name}",
                                     quantize, guard)
            torch.cuda.synchronize()
            as_group(group).barrier()
            if kind == "communicator":
                hosts.intra.group.close()
                hosts.inter.group.close()
    return failures


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ("communicator", "gloo", "nccl"))
def test_moe_on_cuda_tensors(kind):
    """Dropless, capacity, padded, hierarchical and int8 dispatch on CUDA tensors equal the dense
    float64 MoE (output and every gradient), over a Communicator, gloo and NCCL; padded makes
    no stream sync after its first forward (on gloo, see _run_gpu)."""
    if kind == "communicator" and not is_cuda_build():
        pytest.skip("needs a braid build with CUDA")
    if kind == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank")
    for r, failures in enumerate(run_ranks(_run_gpu, 2, kind, deadline_s=300)):
        assert not failures, f"rank {r}: " + "\n".join(failures)


# -- expert and data parallelism ---------------------------------------------------------------------
def _run_ep_dp(rank, world_size, store_path):
    """4 ranks = 2 expert-parallel groups ({0, 1}, {2, 3}) x 2 data-parallel replicas; experts
    reduced over {0, 2} and {1, 3}, the router over all four: by reduce_gradients alone, and with
    DDP over the four ranks for the router (torch's all-reduce, and braid's hook), the experts'
    parameters ignored by DDP."""
    with process_group(rank, world_size, store_path):
        ep = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        expert_dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        cfg = {"top_k": 2, "aux": 0.02}
        router, experts = _dense(60, 4)
        xs = [_tokens(60, r, 5 + 2 * r) for r in range(world_size)]
        gen = torch.Generator().manual_seed(8)
        out_grads = [torch.randn(xi.shape, generator=gen, dtype=torch.float64) for xi in xs]
        total = 0
        for r in range(world_size):
            ref_y, ref_loss, _, _ = _reference(router, experts, xs[r], cfg)
            total = total + (ref_y * out_grads[r]).sum() + ref_loss
        (total / world_size).backward()
        failures = []
        for recipe in ("reduce_gradients", "ddp", "ddp+braid-hook"):
            layer = moe.MoE.from_dense(copy.deepcopy(router), copy.deepcopy(experts), ep,
                                       **_layer_kwargs(cfg))
            model = layer
            if recipe != "reduce_gradients":
                ddp = nn.parallel.DistributedDataParallel
                ddp._set_params_and_buffers_to_ignore_for_model(
                    layer, [f"experts.{name}" for name, _ in layer.experts.named_parameters()])
                model = ddp(layer)
                if recipe == "ddp+braid-hook":
                    model.register_comm_hook(*comm_hook(dist.group.WORLD))
            y, aux = model(xs[rank])
            ((y * out_grads[rank]).sum() + aux).backward()
            moe.reduce_gradients(layer, dist.group.WORLD, expert_dp, dense=recipe == "reduce_gradients")
            pairs = [("router", layer.router.weight, router.weight)]
            for i, e in enumerate(layer.local_experts):
                pairs += [(f"expert {e}", p, q)
                          for p, q in zip(layer.experts[i].parameters(), experts[e].parameters())]
            for what, mine, ref in pairs:
                if not torch.allclose(mine.grad, ref.grad, **TOL):
                    failures.append(f"{recipe}: {what}: {(mine.grad - ref.grad).abs().max():.3g}")
        return failures


def test_expert_and_data_parallel_gradients_equal_dense():
    """EP x DP (2 x 2): after reduce_gradients (alone, or for the experts beside DDP over every
    rank) every parameter's gradient is that of the dense model's mean loss over the four ranks'
    tokens."""
    for r, failures in enumerate(run_ranks(_run_ep_dp, 4)):
        assert not failures, f"rank {r}: {failures}"


def _run_bias(rank, world_size, store_path):
    """Auxiliary-loss-free balancing: loads of two training forwards summed over the ranks by one
    update; the bias then moves by rate * sign(mean - load)."""
    c = make_comm(rank, world_size, store_path)
    router, experts = _dense(70, 4)
    layer = moe.MoE.from_dense(router, experts, c, top_k=2, bias_update_rate=0.1)
    loads = torch.zeros(4, dtype=torch.int64)
    for step in range(2):
        layer(_tokens(70 + step, rank, 6 + rank))
        loads += torch.tensor(layer.stats()["tokens_per_expert"])
    with torch.no_grad():
        layer.eval()
        layer(_tokens(80, rank, 3))  # evaluation: not counted
    total = layer.update_expert_bias()
    every = torch.empty(2 * 4, dtype=torch.int64)
    c.all_gather(every, loads)
    expect = every.view(2, 4).sum(0)
    c.close()
    bias = 0.1 * torch.sign(expect.float().mean() - expect.float())
    return torch.equal(total, expect) and torch.equal(layer.expert_bias, bias) and not layer.expert_load.any()


def test_expert_bias_update_sums_loads_over_ranks():
    assert all(run_ranks(_run_bias, 2))


# -- in one process ----------------------------------------------------------------------------------
def test_capacity_drops_follow_the_rule():
    """route() keeps, per expert, ceil(c * T * k / E) assignments: the highest weights ("probs")
    or the first tokens ("position"), the earlier token first among equal weights."""
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for t, e, k in ((13, 4, 2), (20, 8, 3), (7, 3, 1)):
        logits = torch.randn(t, e, generator=gen)
        logits[3] = logits[2]  # equal weights: the earlier token wins
        for c in (0.25, 0.5, 1.0, 2.0):
            for policy in moe.DROP_POLICIES:
                r = moe.route(logits, k, capacity_factor=c, drop_policy=policy)
                full = moe.route(logits, k)
                cap = math.ceil(c * t * k / e)
                assert moe.capacity(t, k, e, c) == cap
                keep = torch.tensor(_reference_keep(full.expert_ids.tolist(), full.weights.tolist(), e, cap,
                                                    policy))
                assert torch.equal(r.expert_ids, torch.where(keep, full.expert_ids, -1)), (t, e, k, c, policy)
                assert r.dropped == int((~keep).sum())
                assert int(torch.bincount(r.expert_ids[r.expert_ids >= 0], minlength=e).max()) <= cap
                checked += r.dropped
    assert checked > 0


def test_aux_losses_equal_their_formulas():
    """Switch/Megatron load balancing E * sum_e f_e P_e and the z-loss mean(logsumexp^2), with
    their coefficients; zero without tokens."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    r = moe.route(logits, 2, aux_loss_coeff=0.3, z_loss_coeff=0.07)
    probs = logits.softmax(-1)
    chosen = logits.topk(2, -1).indices
    f = [sum(int(e in row) for row in chosen.tolist()) / (11 * 2) for e in range(5)]
    p = [sum(probs[t, e].item() for t in range(11)) / 11 for e in range(5)]
    assert r.aux_loss.item() == pytest.approx(0.3 * 5 * sum(a * b for a, b in zip(f, p)), rel=1e-12)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 11
    assert r.z_loss.item() == pytest.approx(0.07 * z, rel=1e-12)
    empty = moe.route(logits[:0], 2, aux_loss_coeff=0.3, z_loss_coeff=0.07)
    assert empty.aux_loss.item() == 0 and empty.z_loss.item() == 0 and empty.expert_ids.shape == (0, 2)


def test_expert_bias_selects_but_does_not_weight():
    """DeepSeek-V3's bias moves the top-k selection only: the weights are the unbiased
    probabilities of the selected experts, renormalised."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 6, generator=gen)
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0, 0.0, 0.0])
    r = moe.route(logits, 2, expert_bias=bias)
    assert bool((r.expert_ids == 2).any(1).all())  # every token now picks expert 2
    probs = logits.softmax(-1).gather(1, r.expert_ids)
    torch.testing.assert_close(r.weights, probs / probs.sum(1, keepdim=True))


def test_host_read_guard_catches_each_read():
    """no_host_reads, the guard of the padded runs, fails on every way of reading a value on the
    host (and lets computation on the device through): it can fail."""
    t = torch.arange(4.0)
    reads = {"tolist": lambda: t.tolist(), "item": lambda: t[1].item(), "cpu": lambda: t.cpu(),
             "nonzero": lambda: t.nonzero(), "torch.nonzero": lambda: torch.nonzero(t),
             "bool": lambda: bool(t[1] > 0), "int": lambda: int(t[1]), "float": lambda: float(t[1]),
             "index": lambda: [0, 1][t.long()[1]], "bincount": lambda: torch.bincount(t.long())}
    for what, read in reads.items():
        with pytest.raises(HostRead):
            with no_host_reads():
                read()
            pytest.fail(f"{what} read the host unnoticed")
    with no_host_reads():
        y = (t * 2).cumsum(0)
    assert y.tolist() == [0.0, 2.0, 6.0, 12.0]


def test_row_quantizer_round_trip():
    """Per-row int8/fp8: zero rows stay zero, the empty batch passes, 4 bytes of scale per row."""
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(5))
    x[1] = 0
    for fmt in ("int8", "fp8"):
        q = moe.RowQuantizer(fmt)
        payload = q.encode(x)
        assert payload.dtype == torch.uint8 and payload.shape == (5, q.row_bytes(7)) == (5, 11)
        back = q.decode(payload, torch.float32)
        assert back.dtype == torch.float32 and torch.equal(back[1], torch.zeros(7))
        # The largest magnitude maps to the format's largest value: back within float32 rounding.
        torch.testing.assert_close(back.abs().amax(1), x.abs().amax(1), rtol=1e-6, atol=0)
        assert q.decode(q.encode(x[:0]), torch.float32).shape == (0, 7)


class _FakeGroup:
    """A stand-in with a group's methods (nothing here reaches a collective)."""

    def __init__(self, world_size):
        self.rank, self.world_size = 0, world_size

    def all_reduce(self, *a, **k):
        raise AssertionError("no collective expected")

    all_gather = reduce_scatter = broadcast = all_to_all = all_reduce


def test_bad_arguments_name_the_argument():
    three, one = _FakeGroup(3), _FakeGroup(1)
    with pytest.raises(ValueError, match="num_experts=4 does not divide by the group's 3 ranks"):
        moe.MoE(8, 4, group=three)
    with pytest.raises(ValueError, match="top_k=5 is larger than num_experts=4"):
        moe.MoE(8, 4, top_k=5, group=one)
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="capacity_factor must be None"):
            moe.MoE(8, 4, group=one, capacity_factor=bad)
    with pytest.raises(ValueError, match="drop_policy must be one of"):
        moe.MoE(8, 4, group=one, drop_policy="random")
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        moe.MoE(0, 4, group=one)
    with pytest.raises(ValueError, match="router must be an nn.Linear"):
        moe.MoE(8, 4, group=one, router=nn.Linear(8, 4))
    with pytest.raises(ValueError, match="compression must be None, 'int8', 'fp8'"):
        moe.MoE(8, 4, group=one, dispatch_compression="int4")
    with pytest.raises(TypeError, match="hierarchical must be a bool or a HostGroups"):
        moe.MoE(8, 4, group=one, hierarchical="yes")
    with pytest.raises(ValueError, match="experts holds 3 modules, the router routes to 4"):
        moe.MoE.from_dense(nn.Linear(8, 4, bias=False), [nn.Identity()] * 3, one)
    layer = moe.MoE(8, 4, group=one)
    with pytest.raises(ValueError, match=r"x must be a floating tensor of shape \(..., d_model=8\)"):
        layer(torch.zeros(3, 7))
    x, ids, w = torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    with pytest.raises(ValueError, match="weights must be a floating tensor of expert_ids' shape"):
        moe.dispatch(x, ids, torch.ones(3, 1), one, num_experts=4)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, num_experts=4\)"):
        moe.dispatch(x, ids + 4, w, one, num_experts=4)
    with pytest.raises(ValueError, match="expert_ids must have shape"):
        moe.dispatch(x, ids[:2], w[:2], one, num_experts=4)
    with pytest.raises(ValueError, match="num_experts=4 does not divide by the group's 3 ranks"):
        moe.dispatch(x, ids, w, three, num_experts=4)
    with pytest.raises(TypeError, match="hosts must be a HostGroups"):
        moe.dispatch(x, ids, w, one, num_experts=4, hosts=object())
    # Tensors on another device than x's (meta tensors stand in for a GPU's): refused before any
    # value is read.
    with pytest.raises(ValueError, match="expert_ids is on meta and x on cpu: x, expert_ids and weights"):
        moe.dispatch(x, ids.to("meta"), w, one, num_experts=4)
    with pytest.raises(ValueError, match="weights is on meta and x on cpu"):
        moe.dispatch(x, ids, w.to("meta"), one, num_experts=4)
    with pytest.raises(ValueError, match=r"route: logits must have shape \(tokens, num_experts\), got shape "
                                         r"\(2, 3, 4\)"):
        moe.route(torch.zeros(2, 3, 4), 2)
    with pytest.raises(ValueError, match=r"logits must have shape .*, got shape \(4,\)"):
        moe.route(torch.zeros(4), 2)
    with pytest.raises(TypeError, match="route: logits must be a floating tensor"):
        moe.route(torch.zeros(3, 4, dtype=torch.int64), 2)
    inputs, handle = moe.dispatch(x, ids, w, one, num_experts=4)
    with pytest.raises(ValueError, match="outputs must be a 2-D tensor with one row per expert input"):
        moe.combine(inputs[:1], handle)


def test_group_interface_checks_split_sizes():
    """The ProcessGroupAdapter's uneven all_to_all refuses split sizes that do not match the rows."""
    with process_group(0, 1, new_store_path()):
        g = as_group(dist.group.WORLD)
        with pytest.raises(ValueError, match=r"input_split_sizes must hold world_size \(1\) non-negative"):
            g.all_to_all(torch.empty(3, 2), torch.empty(3, 2), output_split_sizes=[3], input_split_sizes=[2])
        out = torch.empty(3, 2)
        g.all_to_all(out, torch.ones(3, 2), output_split_sizes=[3], input_split_sizes=[3])
        assert torch.equal(out, torch.ones(3, 2))
