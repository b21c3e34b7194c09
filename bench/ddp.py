"""DDP benchmark: step time of a small transformer language model on CPU ranks, with torch's
gloo DDP, torch's fp16 hook, braid's exact hook and each compressed hook (over the braid
communicator, over the gloo group, over a group of braid's c10d backend), and the exposed
communication time.

    python -m braid.bench ddp                       # 2 ranks, ~25M parameters
    python -m braid.bench ddp --steps 6 --modes gloo,braid,int8 --json results/ddp.json
    python -m braid.bench ddp --modes compute,gloo,braid --shapes 4x128,1x128,1x32
    python -m braid.bench ddp --modes gloo,fp16,exact@gloo,int8@gloo,int8@braidpg

A mode ``KIND@CARRIER`` is braid's hook with compressor KIND (exact, bf16, int8, int4, topk, auto) over
the process group CARRIER (``gloo``: the run's gloo group; ``braidpg``: a group of braid's c10d
backend): braid compresses, the group moves the bytes. Plain KIND runs the hook over a braid
communicator. The summary line compares the int8 hook over gloo with the exact exchange (wire
bytes) and with torch's fp16 hook (step time).

Every mode's step is also given over the exact hook's ("braid") as the median of per-step ratios
(the modes run back to back within a step, so the machine's drift cancels), and "auto"'s over
every other mode's the same way.

``--shapes`` runs one table per (batch x sequence length) per rank, with the same model: how much
of a step communication takes, and so what an exact hook can save, depends on the tokens each
rank computes per step against the fixed gradient bytes.

Every mode trains its own copy of the same model from the same weights on the same batches
(forward, backward, SGD step); the modes take turns step by step. A step is timed from a barrier
to the end of optimizer.step(); the figure is the median over ``--steps`` timed steps of the
slowest rank, after ``--warmup`` steps (DDP rebuilds
its buckets after step 1 and the compressors start after their 2-step warm-up). ``compute`` runs
the same steps without DDP on every rank at once (the same contention for the cores, no
communication); exposed communication = step time - compute step time. The wire ratio is that
of the compressed buckets over the timed steps (buckets under 64 KiB travel uncompressed).

With ``--link-mbit`` (the rate of the link between hosts; ``multihost`` passes it) the row
``floor`` is the least step any DDP exchange of the same buckets can take on that link, from the
compute run's gradient-ready times (:class:`LinkFloor`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from braid import comm

from . import launch, report, turns

HOOKS = {  # braid hook kinds: the compressor and its description
    "exact": (None, "exact"),
    "bf16": (lambda: comm.Cast(torch.bfloat16), "Cast(bfloat16)"),
    "int8": (lambda: comm.Int8Quantizer(), "Int8Quantizer()"),
    "int4": (lambda: comm.Int4Quantizer(), "Int4Quantizer()"),
    "topk": (lambda: comm.TopK(0.01), "TopK(0.01)"),
    "auto": (lambda: comm.Adaptive(), "Adaptive(): per bucket, chosen from the measured link"),
}
CARRIERS = {"gloo": "over the gloo group", "braidpg": "over a braid c10d group"}
# The optimizer in the hook (not in the default run): braid.optim's AdamW stepped after the backward
# ("adamw") or by the exact hook as each bucket is reduced ("adamw-hooked"), over the communicator.
OPTIMIZER_MODES = ("adamw", "adamw-hooked")
MODES = ("compute", "gloo", "fp16", "braid", "bf16", "int8", "int4", "topk", "auto",
         *(f"{kind}@{carrier}" for carrier in CARRIERS for kind in HOOKS), *OPTIMIZER_MODES)
# What runs without --modes: every kind over braid; exact, int8 and top-k over gloo (the carrier's
# targets compare int8@gloo with exact and with fp16); int8 over braid's c10d group.
DEFAULT_MODES = ("compute", "gloo", "fp16", "braid", "bf16", "int8", "int4", "topk", "auto",
                 "exact@gloo", "int8@gloo", "topk@gloo", "int8@braidpg")
DESCRIPTIONS = {
    "compute": "no DDP, no communication (the compute floor)",
    "floor": "least step any DDP exchange of these buckets can take on the --link-mbit link",
    "gloo": "torch DDP, gloo all-reduce",
    "fp16": "torch DDP + torch's fp16_compress_hook (gloo)",
    "braid": "DDP + braid exact hook over a braid communicator",
    "adamw": "DDP + braid exact hook, braid.optim.AdamW stepped after the backward",
    "adamw-hooked": "DDP + braid exact hook stepping braid.optim.AdamW bucket by bucket (optimizer=)",
    **{kind: f"DDP + braid hook over a braid communicator, {what}" for kind, (_, what) in HOOKS.items()
       if kind != "exact"},
    **{f"{kind}@{carrier}": f"DDP + braid hook {where}, {what}" for kind, (_, what) in HOOKS.items()
       for carrier, where in CARRIERS.items()},
}


def _hook_of(mode: str) -> tuple:
    """(compressor kind, carrier name or "" for a braid communicator) of a braid hook mode."""
    kind, _, carrier = mode.partition("@")
    return ("exact" if kind == "braid" else kind), carrier


class TinyLM(torch.nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, tied output layer."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
        layer = torch.nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.register_buffer(
            "mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos[: ids.shape[1]]
        s = ids.shape[1]
        h = self.norm(self.blocks(h, mask=self.mask[:s, :s], is_causal=True))
        return h @ self.tok.weight.t()


def _run_rank(rank: int, world: int, store_port: int | None, args: argparse.Namespace) -> int:
    """One rank: every shape, then rank 0 gathers the figures and reports them."""
    with turns.rank_session(rank, world, store_port, args) as c:
        total = len(args.shapes) * (args.warmup + args.steps) * len(args.modes)
        progress = report.Progress(total, enabled=rank == 0)
        # Every rank makes the braid c10d group (a collective), when a mode uses it.
        uses_braid_pg = any(m.endswith("@braidpg") for m in args.modes)
        braid_pg = dist.new_group(backend="braid") if uses_braid_pg else None
        carriers = {"": c, "gloo": dist.group.WORLD, "braidpg": braid_pg}
        per_shape = [_run_shape(rank, args, carriers, batch, seq, progress) for batch, seq in args.shapes]
        progress.close()
        gathered = [None] * world
        dist.all_gather_object(gathered, per_shape)
    return _report(args, gathered) if rank == 0 else 0


def _run_shape(
    rank: int, args: argparse.Namespace, carriers: dict, batch: int, seq: int, progress: report.Progress
) -> dict:
    """Trains every mode for the warm-up and timed steps on (batch, seq) token batches; returns
    each mode's step times, last loss, wire ratio and parameter count on this rank. ``carriers``:
    what a braid hook runs over, by carrier name ("" the braid communicator)."""
    from braid.comm import ddp
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    max_seq = max(s for _, s in args.shapes)  # one model for every shape
    runs = {}
    for mode in args.modes:
        torch.manual_seed(0)
        model = TinyLM(args.vocab, args.dim, args.layers, args.heads, max_seq)
        net = model
        compressor = None
        opt = None  # SGD unless the mode times braid.optim's AdamW
        if mode != "compute":
            net = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb)
            if mode in OPTIMIZER_MODES:
                from braid import optim

                opt = optim.AdamW(model.parameters(), lr=1e-3)
                state, hook = ddp.comm_hook(carriers[""], optimizer=opt if mode == "adamw-hooked" else None)
                net.register_comm_hook(state, hook)
            elif mode == "fp16":
                net.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif mode != "gloo":
                kind, carrier = _hook_of(mode)
                make = HOOKS[kind][0]
                compressor = None if make is None else make()
                state, hook = ddp.comm_hook(carriers[carrier], compressor)
                net.register_comm_hook(state, hook)
        runs[mode] = {
            "model": model,
            "net": net,
            "compressor": compressor,
            "times": [],
            "losses": [],
            "opt": opt if opt is not None else torch.optim.SGD(model.parameters(), lr=1e-3),
            "hooked": mode == "adamw-hooked",  # stepped by the hook: no step() after the backward
            "wire0": None,
        }
    floor = LinkFloor(runs["compute"]["model"]) if args.link_mbit and "compute" in runs else None
    g = torch.Generator().manual_seed(rank)
    # Round-robin: step i of every mode runs back to back, so the slow phases of a shared
    # machine hit every mode alike instead of whichever mode happened to run then; the order
    # rotates by one mode per step, since the mode run last in a step measured a few percent
    # slower than the same exchange run earlier in it.
    modes = list(args.modes)
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (batch, seq + 1), generator=g)
        turn = step % len(modes)
        for mode in modes[turn:] + modes[:turn]:
            run = runs[mode]
            progress(mode, f"{batch}x{seq} step {step + 1}/{args.warmup + args.steps}", None)
            if step == args.warmup and run["compressor"] is not None:
                run["wire0"] = run["compressor"].wire_total
            dist.barrier()
            t0 = time.perf_counter()
            logits = run["net"](ids[:, :-1])
            targets = ids[:, 1:].reshape(-1)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets)
            run["opt"].zero_grad(set_to_none=False)
            loss.backward()
            t_backward = time.perf_counter()
            if not run["hooked"]:
                run["opt"].step()
            if step >= args.warmup:
                run["times"].append(time.perf_counter() - t0)
                run["losses"].append(loss.item())
                if mode == "compute" and floor is not None:
                    floor.record(t0, t_backward, time.perf_counter())
    results = {}
    for mode, run in runs.items():
        ratio = None
        comp = run["compressor"]
        if comp is not None:  # the timed steps only (the warm-up is exact)
            sent = comp.wire_total.sent - run["wire0"].sent
            ratio = (comp.wire_total.dense - run["wire0"].dense) / sent if sent else None
        results[mode] = {
            "times": run["times"],
            "loss": run["losses"][-1],
            "wire_ratio": ratio,
            "nparams": sum(p.numel() for p in run["model"].parameters()),
        }
        if isinstance(comp, comm.Adaptive):  # what "auto" chose per bucket, and why
            results[mode]["decisions"] = {str(k): [d.choice, d.reason] for k, d in comp.decisions().items()}
    if floor is not None:
        hosts = carriers[""].num_hosts
        results["floor"] = {
            "times": floor.floors(args.bucket_mb * 2**20, args.link_mbit * 1e6 / 8, hosts),
            "loss": None,
            "wire_ratio": None,
            "nparams": results["compute"]["nparams"],
        }
    return results


class LinkFloor:
    """The least time a DDP step can take when the gradients cross a link of a given rate.

    The compute run stamps when each parameter's gradient is final (a post-accumulate hook; a tied
    weight's fires once, after both uses) and when backward and the optimizer step end. A step's
    floor packs the gradients into DDP's buckets as DDP's rebuild does (in the order they became
    ready, each bucket closed once it holds ``bucket_bytes``), lets each bucket start when its last
    gradient is ready and the link has carried the buckets before it, charges each bucket
    2(h-1)/h of its bytes on a host's uplink (the least an all-reduce over h hosts moves through
    it), and adds the optimizer step after the last one. Any DDP exchange of the same buckets,
    braid's or gloo's, takes at least that long: the payload the link really carries is below its
    nominal rate (headers), and the transfers also take CPU time from the backward."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stamps: dict[int, float] = {}
        self.steps: list[tuple[list[float], float, float]] = []
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: self._stamp(i))

    def _stamp(self, i: int) -> None:
        self.stamps[i] = time.perf_counter()

    def record(self, t0: float, t_backward: float, t_end: float) -> None:
        """Keeps the step that began at ``t0`` (perf_counter seconds): its gradients' stamps, the
        end of its backward and of its optimizer step."""
        ready = [self.stamps[i] - t0 for i in range(len(self.params))]
        self.steps.append((ready, t_backward - t0, t_end - t0))
        self.stamps.clear()

    def floors(self, bucket_bytes: float, link_bytes_per_s: float, hosts: int) -> list[float]:
        """The floor of each recorded step, in seconds from its start."""
        share = 2 * (hosts - 1) / hosts
        out = []
        for ready, t_backward, t_end in self.steps:
            order = sorted(range(len(self.params)), key=ready.__getitem__)
            tensors = [self.params[i] for i in order]
            buckets, _ = dist._compute_bucket_assignment_by_size(
                tensors, [int(bucket_bytes)], [False] * len(order), list(range(len(order))))
            link_free = 0.0
            for bucket in buckets:
                members = [order[j] for j in bucket]
                nbytes = sum(self.params[i].numel() * self.params[i].element_size() for i in members)
                start = max(link_free, max(ready[i] for i in members))
                link_free = start + share * nbytes / link_bytes_per_s
            out.append(max(t_end, link_free + (t_end - t_backward)))
        return out


def _table(gathered: list[dict], modes: Sequence[str]) -> tuple[str, list[dict]]:
    rows = []
    for mode in [*modes, *(["floor"] if "floor" in gathered[0] else [])]:
        per_step = [
            max(r[mode]["times"][i] for r in gathered) for i in range(len(gathered[0][mode]["times"]))
        ]
        rows.append(
            {
                "mode": mode,
                "step_s": statistics.median(per_step),
                "step_times": per_step,
                "loss": gathered[0][mode]["loss"],
                "wire_ratio": gathered[0][mode]["wire_ratio"],
                "nparams": gathered[0][mode]["nparams"],
                **({"decisions": gathered[0][mode]["decisions"]} if "decisions" in gathered[0][mode] else {}),
            }
        )
    base = {r["mode"]: r["step_s"] for r in rows}
    lines = [f"{'mode':<13}{'step':>10}{'exposed comm':>14}{'vs gloo':>9}{'wire ratio':>12}  what"]
    for r in rows:
        measured = r["mode"] not in ("compute", "floor")
        exposed = r["step_s"] - base["compute"] if "compute" in base and measured else None
        r["exposed_s"] = exposed
        vs = f"{r['step_s'] / base['gloo']:.2f}x" if "gloo" in base else "-"
        lines.append(
            f"{r['mode']:<13}{r['step_s'] * 1e3:>8.0f}ms"
            f"{'-' if exposed is None else f'{exposed * 1e3:.0f}ms':>14}{vs:>9}"
            f"{'-' if not r['wire_ratio'] else format(r['wire_ratio'], '.2f') + 'x':>12}  "
            f"{DESCRIPTIONS[r['mode']]}"
        )
    summary = _int8_over_gloo(base, {r["mode"]: r["wire_ratio"] for r in rows})
    if summary:
        lines.append(summary)
    times = {x["mode"]: x["step_times"] for x in rows if x["mode"] not in ("compute", "floor")}
    over_exact = _over_exact(times)
    if over_exact:
        lines.append("each mode over braid (exact) in the same steps (median of per-step ratios): "
                     + ", ".join(f"{m} {v:.3f}x" for m, v in over_exact.items()))
    if all(m in times for m in OPTIMIZER_MODES):
        paired = report.paired_ratios({m: times[m] for m in OPTIMIZER_MODES}, "adamw-hooked")
        lines.append(f"adamw-hooked step over adamw's in the same steps (median of per-step ratios): "
                     f"{paired['adamw']:.3f}x (below 1: the step hides under the backward)")
    for r in rows:
        if "decisions" in r:
            ordered = sorted(r["decisions"].items(), key=lambda i: int(i[0]))
            chose = ", ".join(f"{k}: {c}" for k, (c, _) in ordered)
            lines.append(f"{r['mode']} chose per bucket {{{chose}}}")
            paired = report.paired_ratios(times, r["mode"])
            if paired:
                lines.append(f"{r['mode']} against each mode in the same steps (median of per-step ratios): "
                             + ", ".join(f"{m} {v:.3f}x" for m, v in paired.items()))
    return "\n".join(lines), rows


def _over_exact(step_times: dict) -> dict:
    """Each mode's step over braid's exact hook's, paired step by step as auto's ratios are
    (report.paired_ratios): {mode: ratio}, empty without the exact hook ("braid")."""
    if "braid" not in step_times:
        return {}
    return {m: report.paired_ratios({m: times, "braid": step_times["braid"]}, m)["braid"]
            for m, times in step_times.items() if m != "braid" and len(times) == len(step_times["braid"])}


def _int8_over_gloo(step_s: dict, wire_ratio: dict) -> str:
    """The process-group carrier's targets, where the run has the modes: the int8 hook over gloo
    sends >= 3.9x fewer bytes than the exact exchange and steps no slower than torch's fp16 hook."""
    if "int8@gloo" not in step_s or not wire_ratio.get("int8@gloo"):
        return ""
    text = f"int8@gloo: wire bytes {wire_ratio['int8@gloo']:.2f}x fewer than exact (target >= 3.9x)"
    if "fp16" in step_s:
        text += (f"; step {step_s['int8@gloo'] / step_s['fp16']:.2f}x torch's fp16 hook's "
                 "(target <= 1.00x)")
    return text


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument(
        "--modes", default=",".join(DEFAULT_MODES),
        help=f"comma-separated, from {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)})"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode (default 8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (default 3)")
    parser.add_argument("--vocab", type=int, default=12288)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument(
        "--shapes",
        metavar="BxS,...",
        help="comma-separated batch x sequence length per rank, one table each (default: --batch x --seq)",
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (default 25)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument(
        "--link-mbit", type=float, default=0.0,
        help="rate of the link between hosts (Mbit/s): with the compute mode, adds the row 'floor', the "
             "least step a DDP exchange of the same buckets can take on it (default 0: none)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for every wait")
    parser.add_argument("--deadline", type=float, default=7200.0, help="seconds the whole run may take")
    parser.add_argument("--bind", choices=("auto", "core", "none"), default="none",
                        help="rank placement as for the collectives benchmark (default none: "
                             "braid's and gloo's communication threads run wherever a core is free)")
    parser.add_argument("--json", metavar="PATH", type=report.output_path(),
                        help="write machine info and rows as JSON")
    args = parser.parse_args(argv)
    args.modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes: unknown {unknown or '(none given)'}; choose from {', '.join(MODES)}")
    for name in ("nproc", "steps", "vocab", "dim", "layers", "heads", "seq", "batch", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: DDP rebuilds its buckets after its first step, and the "
                     "compressed hooks run exact for their first 2 steps")
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if not args.bucket_mb > 0 or not args.timeout > 0 or not args.deadline > 0:
        parser.error("--bucket-mb, --timeout and --deadline must be positive")
    if args.link_mbit < 0:
        parser.error("--link-mbit must be 0 (no link floor) or positive")
    if args.link_mbit and "compute" not in args.modes:
        parser.error("--link-mbit needs the compute mode in --modes (its gradient-ready times make the "
                     "floor)")
    args.shapes = _parse_shapes(parser, args.shapes) if args.shapes else [(args.batch, args.seq)]
    args.machine = report.machine_info()
    world = int(os.environ["WORLD_SIZE"]) if launch.launcher() == "torchrun" else args.nproc
    args.bind = launch.resolve_bind(args.bind, world)
    started = time.time()
    if launch.launcher() == "torchrun":
        return launch.run_rank_reporting(_run_rank, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                                         None, args)
    return launch.spawn(_run_rank, args.nproc, args.timeout, started + args.deadline, args)


def _report(args: argparse.Namespace, gathered: list) -> int:
    """Prints one table per shape and writes the JSON (rank 0)."""
    machine = args.machine
    world = len(gathered)
    all_rows = []
    for i, (batch, seq) in enumerate(args.shapes):
        text, rows = _table([per_rank[i] for per_rank in gathered], args.modes)
        for r in rows:
            r.update(batch=batch, seq=seq)
        all_rows.extend(rows)
        print(
            f"# braid DDP benchmark: {world} ranks x {args.threads} thread, "
            f"{rows[0]['nparams'] / 1e6:.1f}M parameters (dim {args.dim}, {args.layers} layers, "
            f"vocab {args.vocab}), batch {batch} x seq "
            f"{seq} per rank, buckets {args.bucket_mb:g} MB, median of {args.steps} steps; "
            f"load average {machine['load_average']}"
        )
        print(text, flush=True)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "machine"}
        report.write_json(args.json, {"machine": machine, "args": settings, "rows": all_rows})
    return 0


def _parse_shapes(parser: argparse.ArgumentParser, text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        try:
            batch, seq = (int(p) for p in parts)
        except ValueError:
            parser.error(f"--shapes: expected BATCHxSEQ items such as 4x128, got {item!r}")
        if batch < 1 or seq < 1:
            parser.error(f"--shapes: batch and sequence length must be >= 1, got {item!r}")
        shapes.append((batch, seq))
    return shapes
