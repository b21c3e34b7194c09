"""braid's DDP comm hook at 2 and 3 CPU ranks against torch's gloo DDP.

One spawn per world size trains the same small regression MLP (several buckets, rebuilt after
step 1) with gloo DDP, the exact braid hook and the int8 and top-k hooks, with
gradient_as_bucket_view, static_graph, no_sync accumulation and torch.compile in the mix, and
returns every run's parameters and held-out loss.
"""

import pickle

import pytest
import torch
from helpers.ranks import make_comm, process_group, run_ranks

STEPS = 100  # training runs compared by loss
EXACT_STEPS = 30  # runs compared parameter by parameter with gloo DDP
IN, HIDDEN = 16, 48


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # identical initial parameters on every rank and in every run
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


_G = torch.Generator().manual_seed(123)
_W1, _W2 = torch.randn(IN, 8, generator=_G) / 4, torch.randn(8, 1, generator=_G)


def _teacher(x: torch.Tensor) -> torch.Tensor:
    """A fixed random tanh network: 100 steps take the held-out loss from 0.7 to about 0.04."""
    return torch.tanh(x @ _W1) @ _W2


def _batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(32, IN, generator=g)
    return x, _teacher(x) + 0.05 * torch.randn(32, 1, generator=g)


def _train(rank, mode, c, *, bucket_view, static_graph, accumulate, steps, compiled=False, device="cpu",
           dtype=torch.float32):
    """Trains with torch's DDP on the default group (mode "gloo", the group these tests mostly
    use) or the braid hook over ``c`` (a braid communicator, or a process group: None for the
    default one) without or with compression, the model and batches in ``dtype`` on ``device``;
    returns parameters (on the CPU), held-out loss and the hook state."""
    from braid import comm
    from braid.comm import ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model().to(device, dtype)
    # bucket_cap_mb 0.004: ~1000 floats per bucket, so the 3.1K parameters span several buckets.
    # Compiled: torch.compile's DDP graph splitter wants no bucket smaller than DDP's first (1 MiB).
    m = DDP(model, bucket_cap_mb=1 if compiled else 0.004, gradient_as_bucket_view=bucket_view,
            static_graph=static_graph)
    state = None
    if mode != "gloo":
        compression = {"exact": None, "int8": comm.Int8Quantizer(seed=rank),
                       "int4": comm.Int4Quantizer(seed=rank), "topk": comm.TopK(0.05),
                       "fp8": comm.FP8Quantizer()}[mode]
        state, hook = ddp.comm_hook(c, compression, min_compress_bytes=0)
        m.register_comm_hook(state, hook)
    # aot_eager: dynamo and AOT autograd as in training with torch.compile, without the minutes
    # inductor's C++ compilation would add; the hook runs in DDP's reducer either way.
    fwd = torch.compile(m, backend="aot_eager") if compiled else m
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = (t.to(device, dtype) for t in _batch(rank, step, micro))
            if micro < accumulate - 1:
                with m.no_sync():  # local accumulation: the hook must not run
                    ((fwd(x) - y) ** 2).mean().backward()
            else:
                ((fwd(x) - y) ** 2).mean().backward()
        opt.step()
    xe = torch.randn(512, IN, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        loss = ((model(xe.to(device, dtype)).cpu().float() - _teacher(xe)) ** 2).mean().item()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return params, loss, state


def ddp_runs(rank, n, store_path, variants):
    with process_group(rank, n, store_path):
        out = {}
        with make_comm(rank, n, store_path) as c:
            for mode, opts in variants:
                params, loss, state = _train(rank, mode, c, **opts)
                out[(mode, tuple(sorted(opts.items())))] = (params, loss)
                if state is not None and state.compression is not None:
                    steps = pickle.loads(pickle.dumps(state)).state_dict()["step"]
                    out[(mode, "state")] = (steps, state.compression.wire_total.sent)
        return out


# static_graph is not combined with no_sync: torch's reducer asserts on that pair whatever the hook.
OPTIONS = [
    {"bucket_view": True, "static_graph": False, "accumulate": 1, "steps": EXACT_STEPS},
    {"bucket_view": False, "static_graph": True, "accumulate": 1, "steps": EXACT_STEPS},
    {"bucket_view": True, "static_graph": False, "accumulate": 2, "steps": EXACT_STEPS},
    {"bucket_view": True, "static_graph": False, "accumulate": 1, "steps": EXACT_STEPS, "compiled": True},
]
TRAIN = {"bucket_view": True, "static_graph": False, "accumulate": 1, "steps": STEPS}


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_hooks_against_gloo(n):
    variants = [(mode, opts) for opts in OPTIONS for mode in ("gloo", "exact")]
    variants += [(mode, TRAIN) for mode in ("gloo", "int8", "topk")]
    # 3 ranks share 2 cores (and the machine may be busy): a generous deadline for ~500 DDP steps.
    results = run_ranks(ddp_runs, n, variants, deadline_s=400)
    for key in results[0]:
        if key[1] == "state":
            steps, sent = results[0][key]
            assert steps == STEPS, "the hook counts synchronized steps"
            assert sent > 0, "buckets were compressed"
            continue
        for r in results[1:]:  # every rank holds the same parameters
            assert torch.equal(r[key][0], results[0][key][0]), key
    for opts in OPTIONS:
        o = tuple(sorted(opts.items()))
        gloo_params, gloo_loss = results[0][("gloo", o)]
        exact_params, _ = results[0][("exact", o)]
        # braid averages as sum-then-divide, gloo DDP divides each gradient first: the two differ by
        # float32 rounding per step, which 30 SGD steps keep far below 1e-6.
        assert (exact_params - gloo_params).abs().max().item() < 1e-6, opts
    o = tuple(sorted(TRAIN.items()))
    baseline = results[0][("gloo", o)][1]
    assert baseline < 0.1, baseline  # the model learned (from 0.7): the comparisons below mean something
    assert results[0][("int8", o)][1] <= 1.10 * baseline, (results[0][("int8", o)][1], baseline)
    assert results[0][("topk", o)][1] <= 1.50 * baseline, (results[0][("topk", o)][1], baseline)


def hook_without_compression_for_small_buckets(rank, n, store_path):
    """Buckets under min_compress_bytes are reduced exactly: the compressor never runs."""
    from braid import comm
    from braid.comm import ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    with process_group(rank, n, store_path):
        with make_comm(rank, n, store_path) as c:
            q = comm.Int8Quantizer()
            m = DDP(_model())
            state, hook = ddp.comm_hook(c, q, min_compress_bytes=1 << 20)
            m.register_comm_hook(state, hook)
            for step in range(4):
                x, y = _batch(rank, step, 0)
                ((m(x) - y) ** 2).mean().backward()
            return q.wire_total.sent, state.step


def state_built_before_the_group(rank, n, store_path):
    """As Lightning does: the hook state on the default group (None) is built before
    init_process_group; the run equals one whose state was built after."""
    from braid import comm
    from braid.comm import ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    early = ddp.comm_hook(None, comm.Int8Quantizer(seed=rank), min_compress_bytes=0)
    runs = []
    with process_group(rank, n, store_path):
        late = ddp.comm_hook(None, comm.Int8Quantizer(seed=rank), min_compress_bytes=0)
        for state, hook in (early, late):
            m = DDP(_model(), bucket_cap_mb=0.004)
            m.register_comm_hook(state, hook)
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            for step in range(4):  # past the warm-up: compressed
                opt.zero_grad()
                x, y = _batch(rank, step, 0)
                ((m(x) - y) ** 2).mean().backward()
                opt.step()
            runs.append((torch.cat([p.detach().reshape(-1) for p in m.parameters()]),
                         state.compression.wire_total.sent))
    (early_params, early_sent), (late_params, late_sent) = runs
    return bool(torch.equal(early_params, late_params)) and early_sent == late_sent > 0


def test_hook_state_built_before_init_process_group():
    assert run_ranks(state_built_before_the_group, 2) == [True, True]


def test_small_buckets_go_uncompressed():
    assert run_ranks(hook_without_compression_for_small_buckets, 2) == [(0, 4), (0, 4)]


def resume_from_checkpoint(rank, n, store_path, compressor, carrier="braid"):
    """A run restarted from a checkpoint (new model, DDP, optimizer and hook state, loaded) ends
    bit for bit where a run without the restart ends, when that run also goes exact for the
    warm-up steps after the checkpoint (``steps_here`` reset, what loading does): the resumed
    DDP's first step lays out its buckets in another order, and compressing it with the saved
    residuals (keyed by bucket index) once put them on the wrong parameters. ``carrier``: the
    hook over a braid communicator, or over the gloo default group."""
    import contextlib
    import io

    from braid import comm
    from braid.comm import ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    make_q = {"int8": lambda: comm.Int8Quantizer(stochastic=False), "topk": lambda: comm.TopK(0.05),
              "cast": lambda: comm.Cast(torch.bfloat16)}[compressor]

    def build(c):
        model = _model()
        m = DDP(model, bucket_cap_mb=0.004)
        state, hook = ddp.comm_hook(c, make_q(), min_compress_bytes=0)
        m.register_comm_hook(state, hook)
        return model, m, state, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def step(m, opt, i):
        opt.zero_grad()
        x, y = _batch(rank, i, 0)
        ((m(x) - y) ** 2).mean().backward()
        opt.step()

    def last_four(model, m, state, opt):
        """Steps 4-7: the compressed bytes each sent, and the parameters after them."""
        sent = []
        for i in range(4, 8):
            before = state.compression.wire_total.sent
            step(m, opt, i)
            sent.append(state.compression.wire_total.sent - before)
        return sent, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    with process_group(rank, n, store_path):
        with make_comm(rank, n, store_path) if carrier == "braid" else contextlib.nullcontext() as c:
            model, m, state, opt = build(c)
            for i in range(4):
                step(m, opt, i)
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
                       saved)
            state.steps_here = 0  # the uninterrupted run: exact for the warm-up, same buckets
            modes, straight = last_four(model, m, state, opt)

            saved.seek(0)
            ckpt = torch.load(saved, weights_only=False)
            model, m, state, opt = build(c)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            state.load_state_dict(ckpt["hook"])
            resumed_modes, resumed = last_four(model, m, state, opt)
            return torch.equal(straight, resumed), modes, resumed_modes, state.step


@pytest.mark.parametrize("compressor", ["int8", "topk", "cast"])
def test_resumed_hook_continues_the_run(compressor):
    for same, modes, resumed_modes, steps in run_ranks(resume_from_checkpoint, 2, compressor):
        assert steps == 8
        # Warm-up (dense bytes) at the first two steps after the checkpoint, compressed after.
        assert modes[2] < modes[0] and modes[3] < modes[1], modes
        assert resumed_modes == modes, (resumed_modes, modes)
        assert same, "the resumed run's parameters differ from the uninterrupted run's"


@pytest.mark.parametrize("raw, value", [("", 64 << 10), ("0", 0), ("1000", 1000), ("256K", 256 << 10),
                                        ("2m", 2 << 20), ("1G", 1 << 30)])
def test_compress_min_bytes_from_environment(monkeypatch, raw, value):
    from braid.comm import ddp

    monkeypatch.setenv("BRAID_COMPRESS_MIN_BYTES", raw)
    assert ddp._min_bytes_from_env() == value


@pytest.mark.parametrize("raw", ["-1", "1.5", "K", "12kb", "big"])
def test_bad_compress_min_bytes_named(monkeypatch, raw):
    from braid.comm import ddp

    monkeypatch.setenv("BRAID_COMPRESS_MIN_BYTES", raw)
    with pytest.raises(ValueError, match="BRAID_COMPRESS_MIN_BYTES"):
        ddp._min_bytes_from_env()


def test_comm_hook_arguments_validated():
    from braid.comm import Communicator, Int8Quantizer, ddp
    from torch.distributed import HashStore

    with pytest.raises(TypeError, match="group must be a braid.comm.Communicator"):
        ddp.comm_hook(object())
    with Communicator(HashStore(), 0, 1) as c:
        state = ddp.CommHookState(c, Int8Quantizer(), 0)
        restored = pickle.loads(pickle.dumps(state))
    assert restored.communicator is None and restored.compression is not None
    with pytest.raises(RuntimeError, match="set state.group after loading"):
        ddp.braid_hook(restored, None)
    # On the default group (None) a restored state finds the group again: nothing to set.
    assert pickle.loads(pickle.dumps(ddp.CommHookState(None, Int8Quantizer(), 0)))._detached is False


def _train_optimizer(rank, c, name, overlapped, accumulate, steps=8):
    """The MLP under DDP with the exact braid hook over ``c`` and a braid.optim optimizer: stepped
    after the backward (``opt.step()``), or by the hook as each bucket is reduced
    (``optimizer=``). Returns the parameters and whether step() refused to run in hook mode."""
    from braid import optim
    from braid.comm import ddp
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    m = DDP(model, bucket_cap_mb=0.004)
    opt = {"sgd": lambda ps: optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
           "adamw": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[name](m.parameters())
    state, hook = ddp.comm_hook(c, optimizer=opt if overlapped else None)
    m.register_comm_hook(state, hook)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # groups read at each step
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = _batch(rank, step, micro)
            if micro < accumulate - 1:
                with m.no_sync():
                    ((m(x) - y) ** 2).mean().backward()
            else:
                ((m(x) - y) ** 2).mean().backward()
        if not overlapped:
            opt.step()
        sched.step()
    refused = None
    if overlapped:
        try:
            opt.step()
            refused = False
        except RuntimeError as e:
            refused = "stepped by braid's DDP comm hook" in str(e)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), refused


def overlapped_optimizer(rank, n, store_path):
    out = {}
    with process_group(rank, n, store_path):
        with make_comm(rank, n, store_path) as c:
            for carrier, group in (("communicator", c), ("gloo", None)):
                for name in ("sgd", "adamw"):
                    for accumulate in (1, 2):
                        key = (carrier, name, accumulate)
                        after, _ = _train_optimizer(rank, group, name, False, accumulate)
                        during, refused = _train_optimizer(rank, group, name, True, accumulate)
                        moved = (during - _model_params()).abs().max().item()
                        out[key] = (torch.equal(after, during), refused, moved)
    return out


def _model_params() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in _model().parameters()])


@pytest.mark.parametrize("n", [3])
def test_optimizer_stepped_by_the_hook_equals_stepping_after_backward(n):
    """comm_hook(..., optimizer=) steps each bucket's parameters as its average completes: the
    parameters equal those of the same optimizer stepped after the backward, bit for bit, over a
    braid communicator and over gloo, with and without no_sync accumulation and under an LR
    schedule; step() itself refuses to run."""
    results = run_ranks(overlapped_optimizer, n)
    for rank, out in enumerate(results):
        assert len(out) == 8
        for key, (same, refused, moved) in out.items():
            assert same, (rank, key)
            assert refused is True, (rank, key)
            assert moved > 1e-3, (rank, key, "the parameters did not move")


def test_hook_optimizer_must_step_parameters_one_at_a_time():
    from braid.comm import ddp

    with pytest.raises(TypeError, match="braid.optim optimizer"):
        ddp.comm_hook(None, optimizer=torch.optim.SGD(_model().parameters(), lr=0.1))
