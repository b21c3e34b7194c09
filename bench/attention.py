"""Attention benchmark: braid's Triton kernels against torch SDPA's fused backends, in TFLOP/s.

    python -m braid.bench attention                       # the full sweep, about 10 minutes
    python -m braid.bench attention --head-dims 128 --seqs 4096 --json r.json --plot r.png

The sweep is the usual one for flash attention: bfloat16, head dims 64 and 128, causal and not,
sequence lengths 512 .. 16384 with batch * seq = 16384 tokens and heads * head_dim = 2048.
Implementations: braid (braid.kernels.scaled_dot_product_attention) and torch's SDPA restricted
with torch.nn.attention.sdpa_kernel to one backend each: flash (FLASH_ATTENTION), cudnn
(CUDNN_ATTENTION), efficient (EFFICIENT_ATTENTION). A backend that rejects a configuration is
shown as "-".

Timing: triton.testing.do_bench (CUDA events, L2 flushed between calls, median of the runs in
--rep milliseconds after --warmup milliseconds). fwd times one forward call; bwd times
out.backward(dout) on a graph kept alive, gradients reset between calls. FLOPs: forward
4 * B * S^2 * H * D (two matmuls), halved when causal; backward 2.5 times the forward (five
matmuls, one of them the recomputation of Q K^T). The first braid call of each head dim and causal
flag runs Triton's autotuner (several seconds of compiling); it happens during the check, before
anything is timed.

Check: before timing, each implementation's output and dq, dk, dv are compared with float32
attention (torch's EFFICIENT_ATTENTION backend on float32 copies of the inputs). err is the largest
absolute difference over the four; "ok" when it is at most twice the largest error of torch's
backends on the same inputs plus 2**-8, "WRONG" otherwise (the same rule as the unit tests: the
error of bfloat16 attention is dominated by the rounding of its inputs and output).

--json writes::

    {"benchmark": "attention", "date": ISO 8601 UTC, "machine": {..., gpu, torch, triton, braid},
     "config": {dtype, head_dims, seqs, tokens, hidden, causal, impls, warmup_ms, rep_ms},
     "records": [{"impl", "pass", "head_dim", "causal", "seq", "batch", "heads", "time_ms",
                  "tflops", "err", "wrong"}, ...],
     "tuned": ["KERNEL KEY: CONFIGURATION", ...]}   (the autotuner's choices, also printed)

Without a CUDA GPU it says so and exits 0. Exit status 3 when a check failed.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from importlib import metadata

import torch
import torch.nn.functional as F

from . import report

IMPLS = ("braid", "flash", "cudnn", "efficient")
PASSES = ("fwd", "bwd")
EXIT_FINDINGS = 3
BWD_FLOP_FACTOR = 2.5
# bfloat16 keeps 8 significant bits: 2**-8 is one rounding of an output of size 1, the floor of
# the check for outputs where torch's own error happens to be tiny.
CHECK_FLOOR = 2.0 ** -8


def forward_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Q K^T and P V: 2 * 2 * B * H * S^2 * D multiply-adds counted as two FLOPs; half when causal."""
    flops = 4.0 * batch * seq * seq * heads * head_dim
    return flops / 2 if causal else flops


def _torch_backends() -> dict:
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention_call(impl: str, causal: bool) -> Callable[..., torch.Tensor]:
    """(q, k, v) -> output for an implementation; torch's backends run alone under sdpa_kernel,
    so that a backend that cannot take the inputs raises instead of handing them to another."""
    if impl == "braid":
        from braid.kernels import scaled_dot_product_attention

        return lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import sdpa_kernel

    backend = _torch_backends()[impl]

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def _forward_backward(call: Callable[..., torch.Tensor], q, k, v, dout) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = call(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _max_error(got: list[torch.Tensor], truth: list[torch.Tensor]) -> float:
    return max((a.float() - b).abs().max().item() for a, b in zip(got, truth))


def measure(impl: str, head_dim: int, causal: bool, seq: int, tokens: int, hidden: int, warmup_ms: int,
            rep_ms: int, inputs: tuple, truth: list[torch.Tensor]) -> list[dict]:
    """The check and the fwd and bwd timings of one implementation on one configuration."""
    import triton.testing

    q, k, v, dout = inputs
    batch, heads = tokens // seq, hidden // head_dim
    call = attention_call(impl, causal)
    base = {"impl": impl, "head_dim": head_dim, "causal": causal, "seq": seq, "batch": batch, "heads": heads}
    try:
        err = _max_error(_forward_backward(call, q, k, v, dout), truth)
    except RuntimeError as e:  # the backend does not take this configuration
        note = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return [dict(base, **{"pass": p, "time_ms": None, "tflops": None, "err": None, "wrong": None,
                              "unavailable": note}) for p in PASSES]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fwd_ms = triton.testing.do_bench(lambda: call(*leaves), warmup=warmup_ms, rep=rep_ms,
                                     return_mode="median")
    out = call(*leaves)
    bwd_ms = triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True), warmup=warmup_ms,
                                     rep=rep_ms, grad_to_none=leaves, return_mode="median")
    flops = forward_flops(batch, heads, seq, head_dim, causal)
    return [dict(base, **{"pass": "fwd", "time_ms": fwd_ms, "tflops": flops / fwd_ms / 1e9, "err": err}),
            dict(base, **{"pass": "bwd", "time_ms": bwd_ms, "tflops": BWD_FLOP_FACTOR * flops / bwd_ms / 1e9,
                          "err": err})]


def run_config(head_dim: int, causal: bool, seq: int, args: argparse.Namespace) -> list[dict]:
    """All implementations on one (head dim, causal, seq), on the same inputs."""
    batch, heads = args.tokens // seq, args.hidden // head_dim
    gen = torch.Generator(device="cuda").manual_seed(seq * 1000 + head_dim)
    shape = (batch, heads, seq, head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    truth = _forward_backward(attention_call("efficient", causal), q.float(), k.float(), v.float(),
                              dout.float())
    records = []
    for impl in args.impls:
        records += measure(impl, head_dim, causal, seq, args.tokens, args.hidden, args.warmup, args.rep,
                           (q, k, v, dout), truth)
    torch_errs = [r["err"] for r in records if r["impl"] != "braid" and r["err"] is not None]
    for r in records:
        if r["err"] is not None:
            # No torch result to compare with (--impls braid, or every torch backend refused the
            # shape): not checked, shown as "-", rather than passed.
            r["wrong"] = r["err"] > 2 * max(torch_errs) + CHECK_FLOOR if torch_errs else None
    return records


def _cell(x: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{fmt}}"


def table(records: Sequence[dict], head_dim: int, causal: bool, impls: Sequence[str]) -> str:
    """One block: TFLOP/s of every implementation per seq and pass, braid's ratios, the check."""
    rows = [r for r in records if r["head_dim"] == head_dim and r["causal"] == causal]
    if not rows:
        return ""
    by_key = {(r["impl"], r["pass"], r["seq"]): r for r in rows}
    ratio_peers = [p for p in ("flash", "cudnn") if p in impls and "braid" in impls]
    lines = [f"# bf16, head dim {head_dim}, {'causal' if causal else 'non-causal'}: TFLOP/s "
             f"(fwd 4*B*S^2*H*D{'/2' if causal else ''}, bwd 2.5x fwd)",
             f"#{'seq':>6} {'batch':>5} {'heads':>5} {'pass':>4}" + "".join(f" {i:>9}" for i in impls)
             + "".join(f" {'braid/' + p:>12}" for p in ratio_peers) + f" {'braid err':>10} {'check':>6}"]
    for seq in sorted({r["seq"] for r in rows}):
        for p in PASSES:
            cells = [by_key.get((i, p, seq)) for i in impls]
            first = next(c for c in cells if c is not None)
            line = f"{seq:>7} {first['batch']:>5} {first['heads']:>5} {p:>4}"
            line += "".join(" " + _cell(c["tflops"] if c else None, ".1f", 9) for c in cells)
            mine = by_key.get(("braid", p, seq))
            for peer in ratio_peers:
                theirs = by_key.get((peer, p, seq))
                ok = mine and theirs and mine["tflops"] and theirs["tflops"]
                line += " " + _cell(mine["tflops"] / theirs["tflops"] if ok else None, ".2f", 12)
            line += " " + _cell(mine["err"] if mine else None, ".2e", 10)
            checks = [c["wrong"] for c in cells if c and c["wrong"] is not None]
            line += f" {('WRONG' if any(checks) else 'ok') if checks else '-':>6}"
            lines.append(line)
    return "\n".join(lines)


def plot(path: str, records: Sequence[dict], impls: Sequence[str], title: str) -> None:
    """PNG of TFLOP/s against seq: one panel per (head dim, causal, pass), one line per impl."""
    panels = sorted({(r["head_dim"], r["causal"], r["pass"]) for r in records},
                    key=lambda x: (x[0], x[1], PASSES.index(x[2])))
    fig, axes = report.panel_grid(len(panels), 4, (4.6, 3.8))
    for (head_dim, causal, p), ax in zip(panels, axes):
        for impl in impls:
            rows = sorted((r for r in records if (r["impl"], r["head_dim"], r["causal"], r["pass"])
                           == (impl, head_dim, causal, p) and r["tflops"]), key=lambda r: r["seq"])
            if rows:
                ax.plot([r["seq"] for r in rows], [r["tflops"] for r in rows], marker="o", markersize=4,
                        label=impl)
        seqs = sorted({r["seq"] for r in records})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [str(s) for s in seqs], rotation=45, fontsize=8)
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.set_title(f"d={head_dim}, {'causal' if causal else 'non-causal'}, {p}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=8)
    report.save_panels(fig, axes, path, title)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", type=_int_list, default=(64, 128), help="(default 64,128)")
    p.add_argument("--seqs", type=_int_list, default=(512, 1024, 2048, 4096, 8192, 16384),
                   help="sequence lengths (default 512 .. 16384, powers of two)")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seq (default 16384)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default 2048)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="(default both)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated, from {','.join(IMPLS)} (default all)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up in ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench timed ms per measurement (default 100)")
    p.add_argument("--json", metavar="PATH", type=report.output_path(),
                   help="write the records as JSON (format in the module docstring)")
    p.add_argument("--plot", metavar="PATH", type=report.output_path(".png"),
                   help="write a PNG of TFLOP/s against sequence length")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the attention benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    impls = tuple(dict.fromkeys(s.strip() for s in args.impls.split(",") if s.strip()))
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        parser.error(f"--impls: {', '.join(unknown) or 'nothing'} given; choose from {', '.join(IMPLS)}")
    args.impls = impls
    for seq in args.seqs:
        if args.tokens % seq:
            parser.error(f"--tokens {args.tokens} is not a multiple of seq {seq}")
    for d in args.head_dims:
        if args.hidden % d:
            parser.error(f"--hidden {args.hidden} is not a multiple of head dim {d}")
    if not torch.cuda.is_available():
        print("braid.bench attention: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "nothing measured")
        return 0
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    gpu = torch.cuda.get_device_name()
    print(f"# braid.bench attention on {gpu}, torch {torch.__version__}, bf16, tokens {args.tokens}, "
          f"hidden {args.hidden}; do_bench median, warm-up {args.warmup} ms, {args.rep} ms timed", flush=True)
    records = []
    for head_dim in args.head_dims:
        for causal in causals:
            for seq in args.seqs:
                print(f"# d={head_dim} causal={causal} seq={seq} ...", file=sys.stderr, flush=True)
                records += run_config(head_dim, causal, seq, args)
            print(table(records, head_dim, causal, impls) + "\n", flush=True)
    unavailable = sorted({(r["impl"], r["unavailable"]) for r in records if r.get("unavailable")})
    for impl, why in unavailable:
        print(f"# {impl} unavailable for some configurations: {why}")
    wrong = [r for r in records if r.get("wrong")]
    if wrong:
        print(f"# {len(wrong)} checks failed: " + ", ".join(
            f"{r['impl']} d={r['head_dim']} causal={r['causal']} seq={r['seq']} err={r['err']:.3g}"
            for r in wrong if r["pass"] == "fwd"))
    tuned = []
    if "braid" in impls:
        from braid.kernels.attention import autotuner_choices

        tuned = autotuner_choices()
    if tuned:
        print("# braid's tile choices (autotuner, per kernel and key):")
        print("\n".join(f"#   {t}" for t in tuned))
    print(f"# wall time {time.time() - started:.1f} s")
    if args.json:
        machine = dict(report.machine_info(), gpu=gpu, torch=torch.__version__,
                       triton=_version("triton"), braid=_version("braid"))
        config = {"dtype": "bfloat16", "head_dims": list(args.head_dims), "seqs": list(args.seqs),
                  "tokens": args.tokens, "hidden": args.hidden, "causal": list(causals), "impls": list(impls),
                  "warmup_ms": args.warmup, "rep_ms": args.rep}
        report.write_json(args.json, {"benchmark": "attention",
                                      "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                      "machine": machine, "config": config, "records": records,
                                      "tuned": tuned})
    if args.plot:
        plot(args.plot, records, impls, f"attention TFLOP/s, bf16 ({gpu})")
    return EXIT_FINDINGS if wrong else 0


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
