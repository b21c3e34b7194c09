"""braid.plan: the memory model against hand counts, the search's invariants, bad inputs, the CLI,
MoE layouts and monotonicity. Pure arithmetic on CPU: no processes, no devices."""

import contextlib
import io
import json

import pytest
import torch
from torch import nn

from braid.plan import (
    Assumptions,
    Candidate,
    Cluster,
    Constraints,
    NoLayoutFits,
    TransformerShape,
    candidates,
    evaluate,
    parse_bytes,
    plan,
    profile_module,
    search,
)
from braid.plan.__main__ import main
from braid.plan.cost import (activation_bytes_per_layer, all_reduce, device_params, memory, reduce_scatter,
                             stage_layers)

GiB = 1024**3


def tiny(**kw):
    """2 layers, h 64, 4 heads of 16 (2 kv heads), gated MLP of 128, vocab 100, seq 32, batch 8."""
    fields = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100, seq=32, batch=8)
    fields.update(kw)
    return TransformerShape(**fields)


def small_cluster(**kw):
    fields = dict(
        hosts=1,
        devices_per_host=4,
        device_memory=GiB,
        peak_flops=1e12,
        intra_bandwidth=100e9,
        inter_bandwidth=10e9,
    )
    fields.update(kw)
    return Cluster(**fields)


# -- memory against hand counts ----------------------------------------------------------------------
def test_parameter_count_by_hand():
    m = tiny()
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v (2 kv heads x 16), o
    mlp = 3 * 64 * 128  # gate, up, down
    layer = attention + mlp + 2 * 64  # + two norms
    total = 2 * layer + 100 * 64 + 100 * 64 + 64  # + embedding, output head, final norm
    assert m.param_count() == total == 86848
    assert m.active_param_count() == total
    # 6 N T + 12 L s^2 (a d) B, N without the embedding lookup
    n = 2 * (attention + mlp) + 100 * 64
    assert m.model_flops() == pytest.approx(6 * n * 32 * 8 + 12 * 2 * 32**2 * 64 * 8)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_states_by_zero_stage(zero):
    m, cl = tiny(), small_cluster()
    a = Assumptions(bucket_bytes=100_000)
    c = Candidate(dp=4, tp=1, pp=1, cp=1, zero=zero)
    mem = memory(m, cl, c, a)
    p = 86848
    # bf16: 2-byte weights and gradients; Adam: float32 master + two float32 moments = 12 bytes
    assert mem.parameters == 2 * p / (4 if zero >= 3 else 1)
    assert mem.gradients == 2 * p / (4 if zero >= 2 else 1)
    assert mem.optimizer == 12 * p / (4 if zero >= 1 else 1)
    largest_unit = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64  # one block's parameters
    # Two buckets in flight from ZeRO-2 (DDP's and ZeRO-1's buckets are the gradients themselves),
    # beyond the loss's working set (by default one float32 tensor of the logits' size, gone before
    # the first bucket is ready)
    loss = 4 * 32 * 2 * 100
    buckets = 2 * 100_000 - loss if zero >= 2 else 0
    assert mem.buffers == buckets + (2 * 2 * largest_unit if zero == 3 else 0)
    assert mem.residual == 0


def test_buckets_only_where_gradients_are_exchanged_apart_from_themselves():
    m, cl = tiny(), small_cluster()
    a = Assumptions(bucket_bytes=100_000)
    loss = 4 * 32 * 2 * 100
    # a compressed exchange encodes and decodes copies of its buckets, even without ZeRO
    int8 = Candidate(dp=4, tp=1, pp=1, cp=1, compression="int8")
    assert memory(m, cl, int8, a).buffers == 2 * 100_000 - loss
    # a dense model on tensor parallelism alone exchanges no gradients: no buckets at any stage
    assert memory(m, cl, Candidate(dp=1, tp=4, pp=1, cp=1, zero=2), a).buffers == 0
    # torch's F.cross_entropy holds three such tensors: its working set leaves the buckets less
    int8_three = memory(m, cl, int8, Assumptions(bucket_bytes=100_000, loss_logits=3))
    assert int8_three.buffers == 2 * 100_000 - 3 * loss
    # a large working set of the loss leaves the buckets nothing to add
    zero2 = Candidate(dp=4, tp=1, pp=1, cp=1, zero=2)
    assert memory(m, cl, zero2, Assumptions(bucket_bytes=1000)).buffers == 0


def test_fp32_sgd_states():
    m, cl = tiny(dtype="fp32", optimizer="sgd"), small_cluster()
    mem = memory(m, cl, Candidate(dp=4, tp=1, pp=1, cp=1, zero=0))
    p = 86848
    assert (mem.parameters, mem.gradients, mem.optimizer) == (4 * p, 4 * p, 4 * p)  # momentum only


def test_activations_by_hand():
    m, cl = tiny(), small_cluster()
    s, b, h, d, f, v = 32, 2, 64, 16, 128, 100  # b = batch / (dp m) = 8 / 4
    sbh = s * b * h
    # 2 bytes x (norm inputs 2sbh + attention input sbh + Q and output 2 s b (a d) + K, V 2 s b d kv
    #            + MLP input sbh + three s b f intermediates)
    per_layer = 2 * (2 * sbh + sbh + 2 * s * b * 64 + 2 * s * b * d * 2 + sbh + 3 * s * b * f)
    assert per_layer == 106496
    c = Candidate(dp=4, tp=1, pp=1, cp=1)
    assert activation_bytes_per_layer(m, c) == per_layer
    # the loss's working set on the last stage: float32 logits-sized tensors, one by default (a
    # fused or vocabulary-parallel loss), three for F.cross_entropy (the log-softmax, its gradient
    # and the logits' gradient)
    loss = 4 * s * b * v
    assert memory(m, cl, c).activations == 2 * per_layer + loss
    assert memory(m, cl, c, Assumptions(loss_logits=3)).activations == 2 * per_layer + 3 * loss
    # full recomputation: each block keeps its 2-byte input, plus one block recomputed at a time
    c_rc = Candidate(dp=4, tp=1, pp=1, cp=1, recompute=True)
    assert memory(m, cl, c_rc).activations == 2 * (2 * sbh) + per_layer + loss
    # tensor (sequence) parallelism and context parallelism divide it
    assert activation_bytes_per_layer(m, Candidate(dp=2, tp=2, pp=1, cp=1)) == 2 * per_layer / 2  # b = 4
    assert activation_bytes_per_layer(m, Candidate(dp=2, tp=1, pp=1, cp=2)) == 2 * per_layer / 2


def test_korthikanti_formula():
    # GPT block (f = 4h, plain MLP, no GQA, dropout, stored scores): s b h (34 + 5 a s / h) bytes
    m = TransformerShape(
        layers=4,
        hidden=256,
        heads=8,
        vocab=1000,
        seq=128,
        batch=4,
        gated=False,
        dropout=True,
        flash_attention=False,
    )
    s, b, h, a = 128, 4, 256, 8
    got = activation_bytes_per_layer(m, Candidate(dp=1, tp=1, pp=1, cp=1))
    assert got == s * b * h * (34 + 5 * a * s / h)
    # with tensor and sequence parallelism: / t
    got_tp = activation_bytes_per_layer(m, Candidate(dp=1, tp=4, pp=1, cp=1))
    assert got_tp == s * b * h * (34 + 5 * a * s / h) / 4


def test_pipeline_in_flight():
    m = tiny(batch=16)
    cl = small_cluster(devices_per_host=2)
    c = Candidate(dp=1, tp=1, pp=2, cp=1, micro_batches=4)  # b = 4, one block per stage
    one = activation_bytes_per_layer(m, c)
    logits = 32 * 4 * 100
    mem = memory(m, cl, c)
    # 1F1B: stage 0 keeps min(pp, m) = 2 micro-batches, the last stage 1 plus the loss's working
    # set (one float32 tensor of the logits' size; the schedule keeps no logits past their loss)
    stage0, stage1 = 2 * one, one + 4 * logits
    assert mem.activations == max(stage0, stage1) and mem.stage == (0 if stage0 > stage1 else 1)
    # torch's pipeline stage computes a micro-batch's weight gradients whole before accumulating
    # them: one more copy of the stage's gradients among the buffers (no data parallelism here)
    per = device_params(m, c)
    ends = per["embedding"] if mem.stage == 0 else per["head"] + per["final_norm"]
    stage_grads = 2 * (per["layer_dense"] + ends)
    assert mem.buffers == stage_grads
    # the last stage too, where the loss's working set is: a large vocabulary makes it the fullest
    big = tiny(batch=16, vocab=5000)
    last = memory(big, cl, c)
    per = device_params(big, c)
    assert last.stage == 1 and last.buffers == 2 * (per["layer_dense"] + per["head"] + per["final_norm"])


def test_stage_layers_and_compression_residual():
    assert stage_layers(32, 4) == (8, 8, 8, 8)
    assert stage_layers(126, 16) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B: one block fewer at the ends
    m, cl = tiny(), small_cluster(hosts=2, devices_per_host=2)
    mem = memory(m, cl, Candidate(dp=4, tp=1, pp=1, cp=1, compression="int8"))
    assert mem.residual == 4 * 86848  # float32 error feedback of the gradients


# -- communication primitives --------------------------------------------------------------------------
def test_alpha_beta():
    cl = small_cluster(hosts=4, devices_per_host=2, intra_latency=1e-6, inter_latency=1e-5)
    n = 1e9
    assert all_reduce(cl, n, (2, 1)) == pytest.approx(2 * (1 / 2 * n / 100e9 + 1e-6))
    assert all_reduce(cl, n, (1, 4)) == pytest.approx(2 * (3 / 4 * n / 10e9 + 3 * 1e-5))
    # hierarchical: in-host reduce-scatter and all-gather around an all-reduce of n / 2 between hosts
    hier = 2 * (1 / 2 * n / 100e9 + 1e-6) + 2 * (3 / 4 * (n / 2) / 10e9 + 3 * 1e-5)
    assert all_reduce(cl, n, (2, 4)) == pytest.approx(hier)
    assert reduce_scatter(cl, n, (1, 4), wire=0.5) == pytest.approx(3 / 4 * n / 2 / 10e9 + 3 * 1e-5)


# -- the search ----------------------------------------------------------------------------------------
def test_search_invariants():
    m = tiny(batch=16)
    cl = small_cluster(hosts=2, devices_per_host=4)
    layouts = plan(m, cl, top=None)
    assert layouts
    fastest = min(x.step for x in layouts)
    assert layouts[0].step <= fastest * 1.001
    for x in layouts:
        assert x.dp * x.tp * x.pp * x.cp == cl.devices
        assert x.dp % x.ep == 0
        assert x.fits and x.memory.total <= cl.device_memory * 0.9
        assert (m.batch // x.dp) % x.micro_batches == 0
        assert x.step == pytest.approx(
            x.time.compute + x.time.bubble + sum(c.exposed for c in x.time.comms.values())
        )
        assert 0 < x.mfu < 1
    best = layouts[0]
    d = best.to_dict()
    assert d["rank"] == 1 and d["memory"]["total"] == best.memory.total and d["reasons"]
    assert "init_device_mesh" in best.snippet
    json.dumps(d)


def test_top_and_reasons():
    m = tiny(batch=16)
    cl = small_cluster(hosts=2, devices_per_host=4)
    top = plan(m, cl, top=3)
    assert [x.rank for x in top] == [1, 2, 3]
    assert all(x.reasons and x.snippet for x in top)


def test_forced_degrees():
    m = tiny(batch=16)
    cl = small_cluster(hosts=2, devices_per_host=4)
    layouts = plan(m, cl, Constraints(tp=2, pp=2, zero_stages=(1,), recompute=(False,)), top=None)
    assert {(x.tp, x.pp, x.zero, x.recompute) for x in layouts} == {(2, 2, 1, False)}


def test_tp_inside_a_host_for_a_wide_model():
    m = TransformerShape(
        layers=8, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=4096, batch=64
    )
    cl = Cluster.preset("h100x8:2")
    # 7.4B parameters: with plain data parallelism (16 bytes each) they fit only split over TP
    best = plan(m, cl, Constraints(parallelisms=("dp", "tp"), zero_stages=(0,)), top=1)[0]
    assert best.tp > 1 and best.tp <= 8
    assert any("inside a host" in r for r in best.reasons)


def test_moe_gives_expert_parallel_layouts():
    m = tiny(experts=8, top_k=2, batch=16)
    cl = small_cluster(hosts=2, devices_per_host=4)
    layouts = plan(m, cl, top=None)
    eps = {x.ep for x in layouts}
    assert max(eps) > 1
    for x in layouts:
        assert m.experts % x.ep == 0 and x.dp % x.ep == 0
    with_ep = next(x for x in layouts if x.ep > 1)
    assert (
        "ep" in with_ep.time.comms and "moe.MoE(" in plan(m, cl, Constraints(ep=with_ep.ep), top=1)[0].snippet
    )
    # experts are split over ep: the parameters of a device shrink with it
    c1 = Candidate(dp=8, tp=1, pp=1, cp=1, ep=1)
    c8 = Candidate(dp=8, tp=1, pp=1, cp=1, ep=8)
    expert = 3 * 64 * 128
    assert memory(m, cl, c1).parameters - memory(m, cl, c8).parameters == pytest.approx(2 * 2 * 7 * expert)
    assert m.active_param_count() < m.param_count()


def test_experts_apart_reduce_after_the_backward():
    """EP (experts that differ inside a data-parallel group) keeps the experts out of the wrapper:
    their gradients are all-reduced over their replicas after the backward, fully exposed, and the
    dense gradients alone hide behind it; with every expert on every rank they all hide."""
    m = tiny(experts=4, top_k=2, batch=16)
    cl = small_cluster(hosts=2, devices_per_host=2)
    a = Assumptions(bucket_bytes=1 << 40)
    ep2 = evaluate(m, cl, Candidate(dp=4, tp=1, pp=1, cp=1, ep=2), assumptions=a)
    # 2 of the 4 experts per rank, replicated over ranks r and r + 2 (the other host)
    experts = m.layers * 2 * m.mlp_params() * m.dtype_bytes
    want = all_reduce(cl, experts, (1, 2))
    assert ep2.time.comms["expert_dp"].exposed == pytest.approx(want)
    assert ep2.time.comms["expert_dp"].total == pytest.approx(want)
    assert ep2.step >= ep2.time.comms["expert_dp"].exposed + ep2.time.compute
    # EP over all 4: no replica, nothing to reduce apart; EP 1: no comm of its own
    ep4 = evaluate(m, cl, Candidate(dp=4, tp=1, pp=1, cp=1, ep=4), assumptions=a)
    ep1 = evaluate(m, cl, Candidate(dp=4, tp=1, pp=1, cp=1, ep=1), assumptions=a)
    assert "expert_dp" not in ep4.time.comms and "expert_dp" not in ep1.time.comms


def test_compression_when_the_link_is_slow():
    m = TransformerShape(layers=4, hidden=2048, heads=16, vocab=32000, seq=1024, batch=32)
    cl = small_cluster(
        hosts=4, devices_per_host=1, device_memory="80G", peak_flops=400e12, inter_bandwidth=1e9
    )
    exact = evaluate(m, cl, Candidate(dp=4, tp=1, pp=1, cp=1))
    int8 = evaluate(m, cl, Candidate(dp=4, tp=1, pp=1, cp=1, compression="int8"))
    assert int8.time.comms["dp"].total < exact.time.comms["dp"].total / 1.9
    best = plan(m, cl, Constraints(parallelisms=("dp",)), top=1)[0]
    assert best.compression in ("int8", "int4")
    assert any("fewer bytes" in r for r in best.reasons)


# -- monotonicity ------------------------------------------------------------------------------------
@pytest.mark.parametrize("moe", [False, True])
def test_faster_link_never_slower(moe):
    m = tiny(batch=16, experts=4 if moe else 0)
    steps = []
    for gbps in (1, 5, 25, 125):
        cl = small_cluster(hosts=2, devices_per_host=4, inter_bandwidth=gbps * 1e9)
        # the fastest predicted step (the first ranked may be a simpler one within 0.1% of it)
        steps.append(min(x.step for x in plan(m, cl, top=None)))
    assert steps == sorted(steps, reverse=True)


def test_more_memory_never_removes_a_layout():
    m = tiny(batch=16)

    def fitting(memory_bytes):
        cl = small_cluster(hosts=2, devices_per_host=4, device_memory=memory_bytes)
        return {x.candidate for x in candidates(m, cl, assumptions=Assumptions(bucket_bytes=1024)) if x.fits}

    sizes = [1024**2, 2 * 1024**2, GiB]
    sets = [fitting(s) for s in sizes]
    assert sets[0] and sets[0] <= sets[1] <= sets[2]
    assert len(sets[0]) < len(sets[2])


# -- bad inputs ------------------------------------------------------------------------------------
def test_forced_tp_not_dividing_heads():
    m = TransformerShape(layers=4, hidden=4096, heads=32, vocab=1000, seq=128, batch=8)
    cl = small_cluster(hosts=1, devices_per_host=6)
    with pytest.raises(ValueError, match=r"tp=3 does not divide heads=32"):
        plan(m, cl, Constraints(tp=3))


@pytest.mark.parametrize(
    "kw, constraint, pattern",
    [
        (dict(batch=6), Constraints(dp=4), r"batch=6 is not divisible by dp=4"),
        (dict(), Constraints(pp=3), r"pp=3 does not divide layers=2|pp=3 is more than layers=2"),
        (dict(seq=30), Constraints(cp=2), r"seq=30 is not divisible by 2\*cp=4"),
        (dict(), Constraints(ep=2), r"ep=2 needs experts"),
        (dict(), Constraints(tp=3), r"tp=3 neither divides nor is a multiple of devices_per_host=4"),
        (dict(), Constraints(tp=4, replicate_kv_heads=False), r"tp=4 does not divide kv_heads=2"),
    ],
)
def test_divisibility_errors(kw, constraint, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan(tiny(**kw), small_cluster(), constraint)


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(layers=-1), r"layers must be a positive int, got -1"),
        (dict(hidden=0), r"hidden must be a positive int"),
        (dict(kv_heads=3), r"kv_heads=3 does not divide heads=4"),
        (dict(experts=4, top_k=5), r"top_k=5 is larger than experts=4"),
        (dict(dtype="fp8"), r"dtype must be one of"),
        (dict(optimizer="lion"), r"optimizer must be one of"),
    ],
)
def test_bad_model(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        tiny(**kw)


def test_bad_cluster_and_constraints():
    with pytest.raises(ValueError, match=r"hosts must be a positive int"):
        small_cluster(hosts=0)
    with pytest.raises(ValueError, match=r"inter_bandwidth must be a positive"):
        small_cluster(inter_bandwidth=-1.0)
    with pytest.raises(ValueError, match=r"device_memory='80Q'"):
        small_cluster(device_memory="80Q")
    with pytest.raises(ValueError, match=r"headroom"):
        Constraints(headroom=1.5)
    with pytest.raises(ValueError, match=r"zero_stages: 4"):
        Constraints(zero_stages=(0, 4))
    with pytest.raises(ValueError, match=r"efficiency"):
        Assumptions(efficiency=0)
    with pytest.raises(ValueError, match=r"dp\*tp\*pp\*cp"):
        evaluate(tiny(), small_cluster(), Candidate(dp=2, tp=1, pp=1, cp=1))


def test_unknown_presets():
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt-9'"):
        TransformerShape.preset("gpt-9")
    with pytest.raises(ValueError, match=r"unknown cluster preset 'x100x8'"):
        Cluster.preset("x100x8:4")
    with pytest.raises(ValueError, match=r"host count"):
        Cluster.preset("h100x8:zero")


def test_presets_and_sizes():
    assert parse_bytes("80G") == 80 * GiB and parse_bytes("80GB") == 80 * 10**9 and parse_bytes(1024) == 1024
    assert round(TransformerShape.preset("llama3-8b").param_count() / 1e9, 2) == 8.03
    assert round(TransformerShape.preset("llama3-70b").param_count() / 1e9, 1) == 70.6
    assert round(TransformerShape.preset("llama3-405b").param_count() / 1e9, 0) == 406
    mixtral = TransformerShape.preset("mixtral-8x7b")
    assert (
        round(mixtral.param_count() / 1e9, 1) == 46.7 and round(mixtral.active_param_count() / 1e9, 1) == 12.9
    )
    qwen = TransformerShape.preset("qwen3-30b-a3b")  # published: 30.5B, 3.3B activated
    assert round(qwen.param_count() / 1e9, 1) == 30.5
    assert qwen.active_param_count() == pytest.approx(3.3e9, rel=0.02)
    cl = Cluster.preset("h100x8:64")
    assert cl.devices == 512 and cl.device_memory == 80 * GiB


def test_no_valid_layout_names_a_reason():
    # dp = pp = cp = 1 on 8 devices leaves tp = 8, which 4 heads cannot take
    with pytest.raises(NoLayoutFits, match=r"no valid layout .*tp=8 does not divide heads=4"):
        plan(tiny(), small_cluster(hosts=1, devices_per_host=8), Constraints(dp=1, pp=1, cp=1))


def test_no_layout_fits():
    m = TransformerShape(layers=4, hidden=8192, heads=64, vocab=32000, seq=4096, batch=8)
    with pytest.raises(NoLayoutFits, match=r"no layout fits in .* the smallest"):
        plan(m, small_cluster(device_memory="1G"))


# -- the module helpers ----------------------------------------------------------------------------
def test_profile_module():
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    prof = profile_module(net)
    assert prof.parameters == 8 * 16 + 16 + 16 * 4 + 4 and prof.activation_bytes is None
    with torch.device("meta"):
        meta_net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(2, 8, requires_grad=True)
    prof = profile_module(meta_net, x)
    # saved for the backward: the input (2x8), the GELU input (2x16) and the GELU output (2x16), float32
    assert prof.activation_bytes == 4 * (2 * 8 + 2 * 16 + 2 * 16)
    with pytest.raises(ValueError, match=r"meta device"):
        profile_module(net, x)


def test_from_module_scales_the_formula():
    net = nn.Linear(1000, 1000)
    shape = TransformerShape.from_module(net, layers=2, hidden=64, heads=4, vocab=100, seq=32, batch=8)
    assert shape.param_count() == 1001000
    assert shape.param_scale == pytest.approx(1001000 / tiny(kv_heads=4, ffn=256).param_count())


# -- the command line ----------------------------------------------------------------------------------
def run_cli(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


SMALL = [
    "--layers",
    "4",
    "--hidden",
    "512",
    "--heads",
    "8",
    "--kv-heads",
    "4",
    "--ffn",
    "1408",
    "--vocab",
    "32000",
    "--seq",
    "1024",
    "--batch",
    "32",
    "--hosts",
    "2",
    "--devices-per-host",
    "4",
    "--device-memory",
    "16G",
    "--peak-tflops",
    "100",
    "--intra-gbps",
    "100",
    "--inter-gbps",
    "10",
]


def test_cli_table():
    rc, out, _ = run_cli(SMALL + ["--top", "3"])
    assert rc == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    assert "MFU" in lines[header] and "mem/device" in lines[header]
    assert [line.split()[0] for line in lines[header + 1 : header + 4]] == ["1", "2", "3"]
    assert "best:" in out and "init_device_mesh" in out and "why:" in out


def test_cli_json():
    rc, out, _ = run_cli(SMALL + ["--json", "--top", "2"])
    assert rc == 0
    d = json.loads(out)
    assert len(d["layouts"]) == 2 and d["cluster"]["devices"] == 8
    first = d["layouts"][0]
    assert set(first["memory"]) >= {"parameters", "gradients", "optimizer", "activations", "buffers", "total"}
    assert {"compute_s", "bubble_s", "comms"} <= set(first["time"])
    assert first["dp"] * first["tp"] * first["pp"] * first["cp"] == 8


def test_cli_preset():
    rc, out, _ = run_cli(["--model", "llama3-8b", "--cluster", "h100x8:1", "--top", "2"])
    assert rc == 0 and "llama3-8b" in out and "h100x8:1" in out


def test_cli_errors():
    rc, _, err = run_cli(["--model", "gpt-9", "--cluster", "h100x8:1"])
    assert rc == 2 and "unknown model preset 'gpt-9'" in err
    rc, _, err = run_cli(SMALL + ["--tp", "3"])
    assert rc == 2 and "tp=3" in err
    rc, _, err = run_cli(["--layers", "4", "--cluster", "h100x8:1"])
    assert rc == 2 and "--hidden" in err
    rc, _, err = run_cli(
        SMALL[:-6]
        + ["--device-memory", "1M", "--peak-tflops", "100", "--intra-gbps", "100", "--inter-gbps", "10"]
    )
    assert rc == 1 and "no layout fits" in err


def test_snippet_mesh_builds():
    """The snippet's mesh and group lines run against torch's fake process group."""
    dist = pytest.importorskip("torch.distributed")
    fake = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    m = tiny(experts=4, batch=16, seq=64)
    cl = small_cluster(hosts=2, devices_per_host=8)
    layout = plan(m, cl, Constraints(tp=2, cp=2, ep=2), top=1)[0]
    code = layout.snippet
    mesh_part = code[code.index("mesh = ") : code.index("# --- end of mesh ---")].replace('"cuda"', '"cpu"')
    dist.init_process_group("fake", store=fake.FakeStore(), rank=0, world_size=cl.devices)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        scope = {"init_device_mesh": init_device_mesh}
        exec(mesh_part, scope)
        assert scope["mesh"].size() == cl.devices
        for name in ("dp_group", "tp_group", "cp_group", "ep_group", "expert_dp_group"):
            assert scope[name] is not None
        assert dist.get_world_size(scope["dp_group"]) == layout.dp * layout.cp
        assert dist.get_world_size(scope["expert_dp_group"]) == layout.dp * layout.cp * layout.tp // layout.ep
    finally:
        dist.destroy_process_group()


def test_search_result_counts():
    result = search(tiny(batch=16), small_cluster(hosts=2, devices_per_host=4), top=2)
    assert result.evaluated >= result.fitting >= len(result.layouts) == 2
    assert json.loads(json.dumps(result.to_dict()))["fitting"] == result.fitting


def test_optimizer_step_time_by_hand():
    """optimizer_seconds_per_param adds the step of the parameters a device updates: all of its
    stage's without ZeRO, 1/dp of them from ZeRO-1; 0 (the default) leaves it out."""
    m, cl = tiny(), small_cluster()
    per = 1e-9
    with_opt = Assumptions(optimizer_seconds_per_param=per)
    for c, share in ((Candidate(dp=4, tp=1, pp=1, cp=1), 1), (Candidate(dp=4, tp=1, pp=1, cp=1, zero=1), 4),
                     (Candidate(dp=1, tp=4, pp=1, cp=1), 1)):
        base = evaluate(m, cl, c).time
        timed = evaluate(m, cl, c, assumptions=with_opt).time
        assert base.optimizer == 0
        device_params = m.param_count() if c.tp == 1 else None
        if device_params is not None:
            assert timed.optimizer == pytest.approx(per * device_params / share)
        else:  # TP: each rank holds its slice of the matrices and whole norms
            assert 0 < timed.optimizer < per * m.param_count() / 2
        assert timed.step == pytest.approx(base.step + timed.optimizer)
        assert timed.to_dict()["optimizer_s"] == timed.optimizer
    with pytest.raises(ValueError, match="optimizer_seconds_per_param"):
        Assumptions(optimizer_seconds_per_param=-1.0)


def test_cli_optimizer_term():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--model", "llama3-8b", "--cluster", "h100x8:1", "--top", "1",
                     "--optimizer-ns-per-param", "2"]) == 0
    assert "+ optimizer " in out.getvalue()


def test_cli_loss_logits():
    """--loss-logits reaches the memory model: F.cross_entropy's three logits-sized tensors cost
    more than a fused loss's one on the last stage."""
    def memory_of(*extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["--model", "llama3-8b", "--cluster", "h100x8:1", "--top", "1", "--json",
                         "--tp", "8", "--pp", "1", "--cp", "1", "--zero", "0", *extra]) == 0
        d = json.loads(out.getvalue())
        return d["layouts"][0], d["model"]
    (fused, model), (torch_ce, _) = memory_of(), memory_of("--loss-logits", "3")
    assert (fused["dp"], fused["micro_batches"]) == (torch_ce["dp"], torch_ce["micro_batches"])
    b = model["batch"] // (fused["dp"] * fused["micro_batches"])
    logits = 4 * model["seq"] * b * model["vocab"] / 8  # float32, the vocabulary split over tp 8
    assert torch_ce["memory"]["activations"] - fused["memory"]["activations"] == pytest.approx(2 * logits)


def test_bubble_counts_each_other_stage_once():
    """Filling and draining: every stage but the slowest once, scaled by its work (the last stage
    also runs the head), over v interleaved chunks."""
    m, cl = tiny(layers=4), small_cluster()
    c = Candidate(dp=1, tp=1, pp=2, cp=1, micro_batches=4)
    t = evaluate(m, small_cluster(devices_per_host=2), c).time
    layer, head = m.layer_forward_flops(), m.head_forward_flops()
    t_mb = t.compute / c.micro_batches  # no per-micro-batch communication here (dp 1, tp 1)
    assert t.bubble == pytest.approx(t_mb * (2 * layer) / (2 * layer + head))
    t4 = evaluate(m, cl, Candidate(dp=1, tp=1, pp=4, cp=1, micro_batches=4)).time
    assert t4.bubble == pytest.approx(t4.compute / 4 * 3 * layer / (layer + head))
