"""Attention benchmark: braid's Triton kernels against torch's fused attention, in TFLOP/s.

    python -m braid.bench attention                       # every section (the dense one: ~10 min)
    python -m braid.bench attention --head-dims 128 --seqs 4096 --json r.json --plot r.png
    python -m braid.bench attention --sections varlen,window --head-dims 128 --causal yes

All rows are bfloat16 with heads * head_dim = --hidden (2048) and --tokens (16384) tokens per
call, head dims 64 and 128, causal and not. Three sections (--sections, default all):

- dense: the usual sweep for flash attention, sequence lengths 512 .. 16384 with batch * seq =
  tokens. braid (braid.kernels.scaled_dot_product_attention) against torch's SDPA restricted with
  torch.nn.attention.sdpa_kernel to one backend each: flash (FLASH_ATTENTION), cudnn
  (CUDNN_ATTENTION), efficient (EFFICIENT_ATTENTION).
- varlen: the tokens packed as documents whose lengths are drawn from a long-tailed distribution
  (log-normal, median 512, sigma 1; seeded by --seed, the last one cut to make the sum).
  braid (braid.kernels.flash_attention_varlen) against flex (torch.nn.attention.flex_attention,
  compiled, with a block mask that keeps each token in its document) and sdpa-padded (every
  document padded to the longest, then torch's SDPA with is_causal, or without it a key padding
  mask; the padding and unpadding are timed with it, as a user of packed data pays them). The
  table's seq is the longest document and batch the number of documents.
- window: causal sliding-window attention, each query seeing itself and the --window keys before
  it, at the lengths of --seqs longer than the window (causal only). braid (flash_attention with
  window=(W, 0)) against flex with the same mask as a block mask.

A configuration an implementation rejects (a backend, a missing flex_attention) is shown as "-".

Timing: triton.testing.do_bench (CUDA events, L2 flushed between calls, median of the runs in
--rep milliseconds after --warmup milliseconds), the same function for every implementation;
the order of the implementations alternates from one configuration to the next, so that none
always runs first. fwd times one forward call; bwd times out.backward(dout) on a graph kept alive,
gradients reset between calls. FLOPs: forward 4 * D * H * (visible query-key pairs): B * S^2,
halved when causal, in the dense rows; the sum over the documents in the varlen rows (the same for
every implementation: padding counts as waste); the pairs inside the window in the window rows.
Backward 2.5 times the forward (five matmuls, one of them the recomputation of Q K^T). The first
call of braid (per head dim, causal flag and options) runs Triton's autotuner and the first call of
flex compiles it (several seconds each); that happens during the check, before anything is timed.

Check: before timing, each implementation's output and dq, dk, dv are compared with float32
attention (torch's EFFICIENT_ATTENTION backend on float32 copies of the inputs; per document in
the varlen rows, with an explicit boolean mask in the window rows). err is the largest absolute
difference over the four; "ok" when it is at most twice the largest error of the other
implementations on the same inputs plus 2**-8, "WRONG" otherwise (the same rule as the unit
tests: the error of bfloat16 attention is dominated by the rounding of its inputs and output).

--json writes::

    {"benchmark": "attention", "date": ISO 8601 UTC, "machine": {..., gpu, torch, triton, braid},
     "config": {dtype, sections, head_dims, seqs, tokens, hidden, causal, impls, window, seed,
                document_lengths, warmup_ms, rep_ms},
     "records": [{"section", "impl", "pass", "head_dim", "causal", "seq", "batch", "heads", "time_ms",
                  "tflops", "err", "wrong"}, ...],
     "tuned": ["KERNEL KEY: CONFIGURATION", ...]}   (the autotuner's choices, also printed)

--plot draws the dense and window rows (TFLOP/s against the sequence length; the varlen rows have
one length each and are in the table only). Without a CUDA GPU it says that every section needs
one and exits 0, measuring nothing. Exit status 3 when a check failed.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from importlib import metadata

import torch
import torch.nn.functional as F

from . import report

SECTIONS = ("dense", "varlen", "window")
IMPLS = {"dense": ("braid", "flash", "cudnn", "efficient"), "varlen": ("braid", "flex", "sdpa-padded"),
         "window": ("braid", "flex")}
ALL_IMPLS = tuple(dict.fromkeys(i for section in SECTIONS for i in IMPLS[section]))
# The peers braid's ratios are shown against, per section.
RATIO_PEERS = {"dense": ("flash", "cudnn"), "varlen": ("flex", "sdpa-padded"), "window": ("flex",)}
PASSES = ("fwd", "bwd")
EXIT_FINDINGS = 3
BWD_FLOP_FACTOR = 2.5
# bfloat16 keeps 8 significant bits: 2**-8 is one rounding of an output of size 1, the floor of
# the check for outputs where torch's own error happens to be tiny.
CHECK_FLOOR = 2.0 ** -8
DOCUMENT_MEDIAN = 512  # tokens: the varlen rows' document lengths, log-normal around it
DOCUMENT_SIGMA = 1.0

Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def forward_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Q K^T and P V: 2 * 2 * B * H * S^2 * D multiply-adds counted as two FLOPs; half when causal."""
    flops = 4.0 * batch * seq * seq * heads * head_dim
    return flops / 2 if causal else flops


def window_pairs(seq: int, window: int) -> int:
    """(query, key) pairs a causal window of `window` keys before each query leaves visible:
    query i sees min(i, window) + 1 keys."""
    w = min(window, seq - 1)
    return w * (w + 1) // 2 + (seq - w) * (w + 1)


def document_lengths(tokens: int, seed: int) -> list[int]:
    """Document lengths drawn from a log-normal distribution (median DOCUMENT_MEDIAN, sigma
    DOCUMENT_SIGMA: many short documents, a few long ones) with `seed`, until they sum to
    `tokens`; the last one is cut to make the sum."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        n = int(torch.empty(1).log_normal_(math.log(DOCUMENT_MEDIAN), DOCUMENT_SIGMA, generator=gen).item())
        lengths.append(min(max(n, 1), tokens - sum(lengths)))
    return lengths


def _torch_backends() -> dict:
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention_call(impl: str, causal: bool, attn_mask: torch.Tensor | None = None) -> Call:
    """(q, k, v) -> output of (B, H, S, D) tensors for a dense implementation; torch's backends run
    alone under sdpa_kernel, so that a backend that cannot take the inputs raises instead of handing
    them to another."""
    if impl == "braid":
        from braid.kernels import scaled_dot_product_attention

        return lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import sdpa_kernel

    backend = _torch_backends()[impl]

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
    return call


def _flex(mask_mod, seq: int, device: torch.device) -> Call:
    """Compiled flex_attention with the block mask of `mask_mod` over seq x seq positions, on
    (B, H, S, D) tensors."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, None, None, seq, seq, device=device)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def varlen_call(impl: str, causal: bool, lengths: Sequence[int], device: torch.device) -> Call:
    """(q, k, v) -> output of packed (tokens, H, D) tensors holding documents of `lengths`."""
    longest, count = max(lengths), len(lengths)
    sizes = torch.tensor(lengths, device=device)
    if impl == "braid":
        from braid.kernels import flash_attention_varlen

        cu = torch.cat((sizes.new_zeros(1), sizes.cumsum(0))).to(torch.int32)
        return lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)
    if impl == "flex":
        document = torch.repeat_interleave(torch.arange(count, device=device), sizes)

        def same_document(b, h, q_idx, kv_idx):
            same = document[q_idx] == document[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same

        flex = _flex(same_document, sum(lengths), device)
        return lambda q, k, v: flex(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
    if impl == "sdpa-padded":
        # Token t of document b sits in row b * longest + (its place in b) of the padded batch.
        starts = torch.cat((sizes.new_zeros(1), sizes.cumsum(0)[:-1]))
        document = torch.repeat_interleave(torch.arange(count, device=device), sizes)
        rows = document * longest + torch.arange(sum(lengths), device=device) - starts[document]
        valid = torch.arange(longest, device=device)[None, :] < sizes[:, None]
        mask = None if causal else valid[:, None, None, :]  # keys past a document's end

        def pad(t: torch.Tensor) -> torch.Tensor:
            padded = t.new_zeros(count * longest, *t.shape[1:]).index_copy(0, rows, t)
            return padded.unflatten(0, (count, longest)).transpose(1, 2)

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # is_causal aligns top-left: a document's rows see none of its padding keys.
            out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, is_causal=causal)
            return out.transpose(1, 2).flatten(0, 1).index_select(0, rows)
        return call
    raise ValueError(f"no varlen implementation {impl!r}")


def window_call(impl: str, window: int, seq: int, device: torch.device) -> Call:
    """(q, k, v) -> output of (B, H, S, D) tensors with a causal window of `window` keys."""
    if impl == "braid":
        from braid.kernels import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal=True, window=(window, 0))
    if impl == "flex":
        return _flex(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= window), seq, device)
    raise ValueError(f"no window implementation {impl!r}")


def _forward_backward(call: Call, q, k, v, dout) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = call(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _max_error(got: list[torch.Tensor], truth: list[torch.Tensor]) -> float:
    return max((a.float() - b).abs().max().item() for a, b in zip(got, truth))


def _unavailable(base: dict, error: Exception) -> list[dict]:
    note = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
    return [dict(base, **{"pass": p, "time_ms": None, "tflops": None, "err": None, "wrong": None,
                          "unavailable": note}) for p in PASSES]


def measure(make_call: Callable[[], Call], base: dict, flops: float, warmup_ms: int, rep_ms: int,
            inputs: tuple, truth: list[torch.Tensor]) -> list[dict]:
    """The check and the fwd and bwd timings of one implementation on one configuration; every
    implementation goes through here, timed the same way."""
    import triton.testing

    q, k, v, dout = inputs
    try:
        call = make_call()
        err = _max_error(_forward_backward(call, q, k, v, dout), truth)
    except Exception as e:  # noqa: BLE001 -- a peer that cannot take the configuration is a "-"
        if base["impl"] == "braid":
            raise
        return _unavailable(base, e)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fwd_ms = triton.testing.do_bench(lambda: call(*leaves), warmup=warmup_ms, rep=rep_ms,
                                     return_mode="median")
    out = call(*leaves)
    bwd_ms = triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True), warmup=warmup_ms,
                                     rep=rep_ms, grad_to_none=leaves, return_mode="median")
    return [dict(base, **{"pass": "fwd", "time_ms": fwd_ms, "tflops": flops / fwd_ms / 1e9, "err": err}),
            dict(base, **{"pass": "bwd", "time_ms": bwd_ms, "tflops": BWD_FLOP_FACTOR * flops / bwd_ms / 1e9,
                          "err": err})]


def _judge(records: list[dict]) -> list[dict]:
    """Marks each record wrong or not against the errors of the other implementations."""
    for r in records:
        if r["err"] is not None:
            others = [o["err"] for o in records if o["impl"] != r["impl"] and o["err"] is not None]
            # No other result to compare with (--impls braid, or every peer refused the shape):
            # not checked, shown as "-", rather than passed.
            r["wrong"] = r["err"] > 2 * max(others) + CHECK_FLOOR if others else None
    return records


def _turn(impls: Sequence[str], turn: int) -> list[str]:
    """The implementations in the order they run at configuration number `turn`: alternating."""
    return list(impls) if turn % 2 == 0 else list(reversed(impls))


def _random(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))


def run_dense(head_dim: int, causal: bool, seq: int, args: argparse.Namespace, turn: int) -> list[dict]:
    """The dense implementations on one (head dim, causal, seq), on the same inputs."""
    batch, heads = args.tokens // seq, args.hidden // head_dim
    gen = torch.Generator(device="cuda").manual_seed(seq * 1000 + head_dim)
    q, k, v, dout = _random((batch, heads, seq, head_dim), gen)
    truth = _forward_backward(attention_call("efficient", causal), *(t.float() for t in (q, k, v, dout)))
    flops = forward_flops(batch, heads, seq, head_dim, causal)
    records = []
    for impl in _turn([i for i in IMPLS["dense"] if i in args.impls], turn):
        base = {"section": "dense", "impl": impl, "head_dim": head_dim, "causal": causal, "seq": seq,
                "batch": batch, "heads": heads}
        records += measure(lambda impl=impl: attention_call(impl, causal), base, flops, args.warmup, args.rep,
                           (q, k, v, dout), truth)
    return _judge(records)


def run_varlen(head_dim: int, causal: bool, lengths: Sequence[int], args: argparse.Namespace,
               turn: int) -> list[dict]:
    """The varlen implementations on one (head dim, causal) over packed documents of `lengths`."""
    heads, tokens, device = args.hidden // head_dim, sum(lengths), torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(args.seed * 1000 + head_dim)
    q, k, v, dout = _random((tokens, heads, head_dim), gen)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    per_document = attention_call("efficient", causal)

    def truth_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([per_document(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
                          for a, b in zip(bounds, bounds[1:])])

    truth = _forward_backward(truth_call, q.float(), k.float(), v.float(), dout.float())
    flops = sum(forward_flops(1, heads, n, head_dim, causal) for n in lengths)
    records = []
    for impl in _turn([i for i in IMPLS["varlen"] if i in args.impls], turn):
        base = {"section": "varlen", "impl": impl, "head_dim": head_dim, "causal": causal,
                "seq": max(lengths), "batch": len(lengths), "heads": heads}
        records += measure(lambda impl=impl: varlen_call(impl, causal, lengths, device), base, flops,
                           args.warmup, args.rep, (q, k, v, dout), truth)
    return _judge(records)


def run_window(head_dim: int, seq: int, args: argparse.Namespace, turn: int) -> list[dict]:
    """The window implementations on one (head dim, seq), causal, on the same inputs."""
    batch, heads, device = args.tokens // seq, args.hidden // head_dim, torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(seq * 1000 + head_dim + 1)
    q, k, v, dout = _random((batch, heads, seq, head_dim), gen)
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)[None, :]
    visible = (distance >= 0) & (distance <= args.window)
    truth = _forward_backward(attention_call("efficient", False, visible), q.float(), k.float(), v.float(),
                              dout.float())
    del distance, visible
    flops = 4.0 * batch * heads * head_dim * window_pairs(seq, args.window)
    records = []
    for impl in _turn([i for i in IMPLS["window"] if i in args.impls], turn):
        base = {"section": "window", "impl": impl, "head_dim": head_dim, "causal": True, "seq": seq,
                "batch": batch, "heads": heads}
        records += measure(lambda impl=impl: window_call(impl, args.window, seq, device), base, flops,
                           args.warmup, args.rep, (q, k, v, dout), truth)
    return _judge(records)


def _cell(x: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{fmt}}"


def _title(section: str, head_dim: int, causal: bool, args: argparse.Namespace) -> str:
    mask = "causal" if causal else "non-causal"
    if section == "varlen":
        return (f"# bf16 varlen, head dim {head_dim}, {mask}: TFLOP/s of the documents' own attention "
                f"(seq: the longest document, batch: documents; seed {args.seed})")
    if section == "window":
        return (f"# bf16 sliding window of {args.window} keys, head dim {head_dim}, causal: TFLOP/s "
                f"(fwd 4*B*H*D*visible pairs, bwd 2.5x fwd)")
    return (f"# bf16, head dim {head_dim}, {mask}: TFLOP/s "
            f"(fwd 4*B*S^2*H*D{'/2' if causal else ''}, bwd 2.5x fwd)")


def table(records: Sequence[dict], section: str, head_dim: int, causal: bool, impls: Sequence[str],
          args: argparse.Namespace) -> str:
    """One block: TFLOP/s of every implementation of a section per seq and pass, braid's ratios,
    the check."""
    rows = [r for r in records if (r["section"], r["head_dim"], r["causal"]) == (section, head_dim, causal)]
    if not rows:
        return ""
    impls = [i for i in IMPLS[section] if i in impls]
    by_key = {(r["impl"], r["pass"], r["seq"]): r for r in rows}
    ratio_peers = [p for p in RATIO_PEERS[section] if p in impls and "braid" in impls]
    lines = [_title(section, head_dim, causal, args),
             f"#{'seq':>6} {'batch':>5} {'heads':>5} {'pass':>4}" + "".join(f" {i:>11}" for i in impls)
             + "".join(f" {'braid/' + p:>17}" for p in ratio_peers) + f" {'braid err':>10} {'check':>6}"]
    for seq in sorted({r["seq"] for r in rows}):
        for p in PASSES:
            cells = [by_key.get((i, p, seq)) for i in impls]
            first = next(c for c in cells if c is not None)
            line = f"{seq:>7} {first['batch']:>5} {first['heads']:>5} {p:>4}"
            line += "".join(" " + _cell(c["tflops"] if c else None, ".1f", 11) for c in cells)
            mine = by_key.get(("braid", p, seq))
            for peer in ratio_peers:
                theirs = by_key.get((peer, p, seq))
                ok = mine and theirs and mine["tflops"] and theirs["tflops"]
                line += " " + _cell(mine["tflops"] / theirs["tflops"] if ok else None, ".2f", 17)
            line += " " + _cell(mine["err"] if mine else None, ".2e", 10)
            checks = [c["wrong"] for c in cells if c and c["wrong"] is not None]
            line += f" {('WRONG' if any(checks) else 'ok') if checks else '-':>6}"
            lines.append(line)
    return "\n".join(lines)


def plot(path: str, records: Sequence[dict], impls: Sequence[str], title: str) -> None:
    """PNG of TFLOP/s against seq: one panel per (section, head dim, causal, pass) of the dense and
    window rows, one line per impl."""
    records = [r for r in records if r["section"] in ("dense", "window")]
    panels = sorted({(r["section"], r["head_dim"], r["causal"], r["pass"]) for r in records},
                    key=lambda x: (SECTIONS.index(x[0]), x[1], x[2], PASSES.index(x[3])))
    fig, axes = report.panel_grid(len(panels), 4, (4.6, 3.8))
    for (section, head_dim, causal, p), ax in zip(panels, axes):
        for impl in impls:
            key = (section, impl, head_dim, causal, p)
            rows = sorted((r for r in records if r["tflops"]
                           and (r["section"], r["impl"], r["head_dim"], r["causal"], r["pass"]) == key),
                          key=lambda r: r["seq"])
            if rows:
                ax.plot([r["seq"] for r in rows], [r["tflops"] for r in rows], marker="o", markersize=4,
                        label=impl)
        seqs = sorted({r["seq"] for r in records if r["section"] == section})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [str(s) for s in seqs], rotation=45, fontsize=8)
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        kind = "window" if section == "window" else ("causal" if causal else "non-causal")
        ax.set_title(f"d={head_dim}, {kind}, {p}")
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
    p.add_argument("--sections", type=report.choice_list(SECTIONS), default=SECTIONS,
                   help=f"comma-separated, from {','.join(SECTIONS)} (default all)")
    p.add_argument("--head-dims", type=_int_list, default=(64, 128), help="(default 64,128)")
    p.add_argument("--seqs", type=_int_list, default=(512, 1024, 2048, 4096, 8192, 16384),
                   help="sequence lengths of the dense and window rows (default 512 .. 16384, powers of two)")
    p.add_argument("--tokens", type=int, default=16384,
                   help="batch * seq, and the varlen rows' tokens (default 16384)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default 2048)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                   help="(default both; the window rows are causal)")
    p.add_argument("--window", type=int, default=1024, help="keys before each query in the window rows "
                   "(default 1024)")
    p.add_argument("--seed", type=int, default=0, help="of the varlen rows' document lengths (default 0)")
    p.add_argument("--impls", type=report.choice_list(ALL_IMPLS), default=ALL_IMPLS,
                   help=f"comma-separated, from {','.join(ALL_IMPLS)} (default all)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up in ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench timed ms per measurement (default 100)")
    p.add_argument("--json", metavar="PATH", type=report.output_path(),
                   help="write the records as JSON (format in the module docstring)")
    p.add_argument("--plot", metavar="PATH", type=report.output_path(".png"),
                   help="write a PNG of TFLOP/s against sequence length (dense and window rows)")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Runs the attention benchmark with command-line arguments ``argv``; returns the exit status."""
    started = time.time()
    parser = _parser(prog)
    args = parser.parse_args(argv)
    impls = args.impls
    if "dense" in args.sections or "window" in args.sections:
        for seq in args.seqs:
            if args.tokens % seq:
                parser.error(f"--tokens {args.tokens} is not a multiple of seq {seq}")
    for d in args.head_dims:
        if args.hidden % d:
            parser.error(f"--hidden {args.hidden} is not a multiple of head dim {d}")
    if args.window < 1:
        parser.error(f"--window {args.window}: expected a positive number of keys")
    if not torch.cuda.is_available():
        print(f"braid.bench attention: the {', '.join(args.sections)} rows need a CUDA GPU "
              "(torch.cuda.is_available() is False); nothing measured")
        return 0
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    lengths = document_lengths(args.tokens, args.seed)
    gpu = torch.cuda.get_device_name()
    print(f"# braid.bench attention on {gpu}, torch {torch.__version__}, bf16, tokens {args.tokens}, "
          f"hidden {args.hidden}; do_bench median, warm-up {args.warmup} ms, {args.rep} ms timed", flush=True)
    records: list[dict] = []
    turn = 0
    for head_dim in args.head_dims:
        if "dense" in args.sections:
            for causal in causals:
                for seq in args.seqs:
                    print(f"# dense d={head_dim} causal={causal} seq={seq} ...", file=sys.stderr, flush=True)
                    records += run_dense(head_dim, causal, seq, args, turn)
                    turn += 1
                print(table(records, "dense", head_dim, causal, impls, args) + "\n", flush=True)
        if "varlen" in args.sections:
            for causal in causals:
                print(f"# varlen d={head_dim} causal={causal}: {len(lengths)} documents, longest "
                      f"{max(lengths)} ...", file=sys.stderr, flush=True)
                records += run_varlen(head_dim, causal, lengths, args, turn)
                turn += 1
                print(table(records, "varlen", head_dim, causal, impls, args) + "\n", flush=True)
        if "window" in args.sections:
            for seq in (s for s in args.seqs if s > args.window):
                print(f"# window d={head_dim} seq={seq} ...", file=sys.stderr, flush=True)
                records += run_window(head_dim, seq, args, turn)
                turn += 1
            print(table(records, "window", head_dim, True, impls, args) + "\n", flush=True)
    unavailable = sorted({(r["impl"], r["unavailable"]) for r in records if r.get("unavailable")})
    for impl, why in unavailable:
        print(f"# {impl} unavailable for some configurations: {why}")
    wrong = [r for r in records if r.get("wrong")]
    if wrong:
        print(f"# {len(wrong)} checks failed: " + ", ".join(
            f"{r['section']} {r['impl']} d={r['head_dim']} causal={r['causal']} seq={r['seq']} "
            f"err={r['err']:.3g}" for r in wrong if r["pass"] == "fwd"))
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
        config = {"dtype": "bfloat16", "sections": list(args.sections), "head_dims": list(args.head_dims),
                  "seqs": list(args.seqs), "tokens": args.tokens, "hidden": args.hidden,
                  "causal": list(causals), "impls": list(impls), "window": args.window, "seed": args.seed,
                  "document_lengths": lengths, "warmup_ms": args.warmup, "rep_ms": args.rep}
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
