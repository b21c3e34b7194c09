"""python -m braid.plan: rank parallel layouts of a transformer on a cluster.

    python -m braid.plan --model llama3-70b --cluster h100x8:64
    python -m braid.plan --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 \\
        --seq 8192 --batch 512 --hosts 16 --devices-per-host 8 --device-memory 80G --peak-tflops 989 \\
        --intra-gbps 450 --inter-gbps 50 --top 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .cluster import CLUSTER_PRESETS, GiB, Cluster, parse_bytes
from .cost import COMPRESSIONS, Assumptions
from .model import MODEL_PRESETS, TransformerShape
from .search import PARALLELISMS, Constraints, Layout, NoLayoutFits, PlanResult, search


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # raise instead of exiting, so main() returns 2
        raise _UsageError(message)


def _csv(kind: Any, name: str):
    def parse(text: str) -> List[Any]:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {text!r} is not a comma-separated list") from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    p = _Parser(
        prog="python -m braid.plan",
        description="Rank parallel layouts (DP x TP x PP x CP x EP, ZeRO, "
        "micro-batches, recomputation, gradient compression) of a decoder-only transformer on a "
        "cluster by predicted step time. Links are given, or measured with --measure.",
    )
    m = p.add_argument_group("model (a preset, or its fields; fields override a preset's)")
    m.add_argument("--model", help=f"preset: {', '.join(sorted(MODEL_PRESETS))}")
    for flag, help_ in (
        ("--layers", "transformer blocks"),
        ("--hidden", "model width"),
        ("--heads", "query heads"),
        ("--kv-heads", "key/value heads (default: heads)"),
        ("--ffn", "MLP width (one expert's for MoE; default 4 x hidden)"),
        ("--vocab", "vocabulary size"),
        ("--seq", "sequence length (tokens)"),
        ("--experts", "experts per MoE layer (0: dense)"),
        ("--top-k", "experts per token"),
        ("--head-dim", "head width (default hidden / heads)"),
        ("--params", "a measured parameter count (scales the formula's parts)"),
    ):
        m.add_argument(flag, type=int, help=help_)
    m.add_argument("--batch", "--global-batch", dest="batch", type=int, help="global batch, in sequences")
    m.add_argument("--dtype", choices=["bf16", "fp32"])
    m.add_argument("--optimizer", choices=["adam", "sgd"])
    m.add_argument("--mlp", choices=["gated", "plain"], help="gated (SwiGLU, 3 matrices) or plain (2)")
    m.add_argument("--tie-embeddings", action="store_true", default=None)
    m.add_argument(
        "--no-flash-attention",
        dest="flash_attention",
        action="store_false",
        default=None,
        help="attention stores its s x s scores",
    )
    m.add_argument("--dropout", action="store_true", default=None, help="dropout masks are kept")

    c = p.add_argument_group("cluster (a preset NAME:HOSTS, or its fields; fields override a preset's)")
    c.add_argument(
        "--cluster", help=f"preset: {', '.join(sorted(CLUSTER_PRESETS))}, as NAME:HOSTS (h100x8:64)"
    )
    c.add_argument("--hosts", type=int)
    c.add_argument("--devices-per-host", type=int)
    c.add_argument("--device-memory", help="bytes per device: 80G (GiB), 80GB (10^9), or a number")
    c.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s per device")
    c.add_argument(
        "--intra-gbps", type=float, help="GB/s (bytes) one device sends inside a host, one direction"
    )
    c.add_argument(
        "--inter-gbps", type=float, help="GB/s (bytes) one device sends to another host, one direction"
    )
    c.add_argument("--intra-latency-us", type=float, help="microseconds per message inside a host")
    c.add_argument("--inter-latency-us", type=float, help="microseconds per message between hosts")
    c.add_argument(
        "--measure",
        action="store_true",
        help="measure the hosts x ranks and both links among the ranks this command runs on "
        "(launch it with torchrun on the cluster; rank 0 prints); fields given still win",
    )

    k = p.add_argument_group("constraints")
    k.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free (0.1)")
    for name in ("dp", "tp", "pp", "cp", "ep"):
        k.add_argument(f"--{name}", type=int, help=f"force the {name.upper()} degree")
    k.add_argument("--micro-batches", type=int, help="force the micro-batch count")
    k.add_argument("--interleave", type=int, help="force the pipeline chunks per rank (1: plain 1F1B)")
    k.add_argument("--max-tp", type=int, help="largest TP (default: devices per host)")
    k.add_argument("--max-pp", type=int)
    k.add_argument("--max-cp", type=int, default=16)
    k.add_argument("--max-ep", type=int)
    k.add_argument("--max-interleave", type=int, default=8)
    k.add_argument(
        "--parallelisms",
        type=_csv(str, "--parallelisms"),
        help=f"allowed dimensions, comma-separated (default {','.join(PARALLELISMS)})",
    )
    k.add_argument("--zero", type=_csv(int, "--zero"), help="allowed ZeRO stages, e.g. 0,1 (default 0,1,2,3)")
    k.add_argument(
        "--recompute",
        choices=["auto", "on", "off"],
        default="auto",
        help="activation recomputation: search both (auto), always, never",
    )
    k.add_argument(
        "--compression",
        type=_csv(str, "--compression"),
        help=f"allowed gradient compressions (default {','.join(COMPRESSIONS)})",
    )
    k.add_argument("--uneven-pp", action="store_true", help="allow pp that does not divide layers")
    k.add_argument("--no-kv-replication", action="store_true", help="tp must divide kv_heads")

    a = p.add_argument_group("cost model")
    a.add_argument(
        "--efficiency", type=float, default=0.4, help="fraction of peak the matrix work reaches (0.4)"
    )
    a.add_argument(
        "--overlap",
        type=float,
        default=None,
        help="fraction of backward/forward compute a data-parallel collective hides behind "
        "(default 0.8; with --measure, measured)",
    )
    a.add_argument(
        "--codec-gbps",
        type=float,
        default=200.0,
        help="GB/s of gradient the compression codec encodes and decodes (200)",
    )
    a.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket, MiB (25)")
    a.add_argument(
        "--half-efficiency-tokens",
        type=float,
        default=128,
        help="tokens per micro-batch per device at which matrix work runs at half efficiency (128)",
    )
    a.add_argument(
        "--optimizer-ns-per-param",
        type=float,
        default=0.0,
        help="nanoseconds of the optimizer step per parameter a device updates (0: left out)",
    )
    a.add_argument(
        "--loss-logits",
        type=float,
        default=1.0,
        help="float32 logits-sized tensors the loss holds as its backward starts: 1 for a fused or "
        "vocabulary-parallel cross-entropy (default), 3 for F.cross_entropy on the full logits",
    )

    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, help="layouts to list (5)")
    o.add_argument("--json", action="store_true", help="print everything as JSON")
    return p


def _model(args: argparse.Namespace) -> TransformerShape:
    fields: Dict[str, Any] = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "ffn": args.ffn,
        "vocab": args.vocab,
        "seq": args.seq,
        "batch": args.batch,
        "experts": args.experts,
        "top_k": args.top_k,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "head_dim": args.head_dim,
        "params": args.params,
        "tie_embeddings": args.tie_embeddings,
        "flash_attention": args.flash_attention,
        "dropout": args.dropout,
        "gated": None if args.mlp is None else args.mlp == "gated",
    }
    if args.model:
        return TransformerShape.preset(args.model, **fields)
    missing = [f"--{n}" for n in ("layers", "hidden", "heads", "vocab", "seq", "batch") if fields[n] is None]
    if missing:
        raise _UsageError(f"give --model PRESET or the model's shape: missing {', '.join(missing)}")
    return TransformerShape(**{k: v for k, v in fields.items() if v is not None})


def _cluster(args: argparse.Namespace) -> Cluster:
    def scaled(value: Optional[float], factor: float) -> Optional[float]:
        return None if value is None else value * factor

    fields: Dict[str, Any] = {
        "hosts": args.hosts,
        "devices_per_host": args.devices_per_host,
        "device_memory": None
        if args.device_memory is None
        else parse_bytes(args.device_memory, "--device-memory"),
        "peak_flops": scaled(args.peak_tflops, 1e12),
        "intra_bandwidth": scaled(args.intra_gbps, 1e9),
        "inter_bandwidth": scaled(args.inter_gbps, 1e9),
        "intra_latency": scaled(args.intra_latency_us, 1e-6),
        "inter_latency": scaled(args.inter_latency_us, 1e-6),
    }
    if args.cluster:
        return Cluster.preset(args.cluster, **fields)
    required = {
        "hosts": "--hosts",
        "devices_per_host": "--devices-per-host",
        "device_memory": "--device-memory",
        "peak_flops": "--peak-tflops",
        "intra_bandwidth": "--intra-gbps",
        "inter_bandwidth": "--inter-gbps",
    }
    missing = [flag for name, flag in required.items() if fields[name] is None]
    if missing:
        raise _UsageError(f"give --cluster NAME:HOSTS or the cluster's fields: missing {', '.join(missing)}")
    return Cluster(**{k: v for k, v in fields.items() if v is not None})


def _constraints(args: argparse.Namespace) -> Constraints:
    kw: Dict[str, Any] = dict(
        headroom=args.headroom,
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        ep=args.ep,
        micro_batches=args.micro_batches,
        interleave=args.interleave,
        max_tp=args.max_tp,
        max_pp=args.max_pp,
        max_cp=args.max_cp,
        max_ep=args.max_ep,
        max_interleave=args.max_interleave,
        uneven_pp=args.uneven_pp,
        replicate_kv_heads=not args.no_kv_replication,
        recompute={"auto": (False, True), "on": (True,), "off": (False,)}[args.recompute],
    )
    if args.parallelisms is not None:
        kw["parallelisms"] = tuple(args.parallelisms)
    if args.zero is not None:
        kw["zero_stages"] = tuple(args.zero)
    if args.compression is not None:
        kw["compression"] = tuple(args.compression)
    return Constraints(**kw)


def _assumptions(args: argparse.Namespace) -> Assumptions:
    if args.codec_gbps is None or args.codec_gbps <= 0:
        raise _UsageError(f"--codec-gbps must be positive, got {args.codec_gbps}")
    if args.bucket_mb is None or args.bucket_mb <= 0:
        raise _UsageError(f"--bucket-mb must be positive, got {args.bucket_mb}")
    return Assumptions(
        efficiency=args.efficiency,
        overlap=0.8 if args.overlap is None else args.overlap,
        codec_seconds_per_byte=1 / (args.codec_gbps * 1e9),
        bucket_bytes=int(args.bucket_mb * 1024**2),
        half_efficiency_tokens=args.half_efficiency_tokens,
        optimizer_seconds_per_param=args.optimizer_ns_per_param * 1e-9,
        loss_logits=args.loss_logits,
    )


def _g(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def describe_inputs(result: PlanResult, links: str = "given, not measured") -> str:
    """The first lines of the report: model, cluster and how many layouts were looked at;
    ``links`` says where the links' figures come from."""
    m, c = result.model, result.cluster
    moe = f", {m.experts} experts top-{m.top_k}" if m.moe else ""
    hosts = f"{c.hosts} host{'s' if c.hosts > 1 else ''}"
    usable = _g(c.device_memory * (1 - result.constraints.headroom))
    model = (
        f"model: {m.name or 'custom'}: {m.param_count() / 1e9:.2f}B parameters "
        f"({m.active_param_count() / 1e9:.2f}B active){moe}, {m.layers} layers, hidden {m.hidden}, "
        f"heads {m.heads}/{m.kv_heads}, seq {m.seq}, batch {m.batch} sequences, {m.dtype}, {m.optimizer}"
    )
    cluster = (
        f"cluster: {c.name or 'custom'}: {hosts} x {c.devices_per_host} = {c.devices} devices, "
        f"{_g(c.device_memory)}, {c.peak_for(m.dtype) / 1e12:g} TFLOP/s peak, links "
        f"{c.intra_bandwidth / 1e9:g} GB/s in a host, {c.inter_bandwidth / 1e9:g} GB/s between hosts "
        f"({links})"
    )
    counts = (
        f"layouts: {result.evaluated} evaluated, {result.fitting} fit in {usable} per device; "
        f"efficiency {result.assumptions.efficiency:g}, overlap {result.assumptions.overlap:g}"
    )
    return "\n".join([model, cluster, counts])


def table(layouts: Sequence[Layout]) -> str:
    """The ranking: rank, layout, step time, MFU, memory per device."""
    rows = [
        (
            "rank",
            "layout (dp tp pp cp ep, ZeRO, micro-batches, recompute, compression)",
            "step s",
            "MFU",
            "mem/device",
        )
    ]
    for x in layouts:
        rows.append((str(x.rank), x.label(), f"{x.step:.3f}", f"{x.mfu:.1%}", _g(x.memory.total)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for r in rows:
        lines.append(
            f"{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  "
            f"{r[4]:>{widths[4]}}"
        )
    return "\n".join(lines)


def details(x: Layout) -> str:
    """The best layout in full: settings, step time and memory by part, reasons, snippet."""
    c = x.candidate
    t = x.time
    pipeline = ""
    if c.pp > 1:
        pipeline = f", {c.interleave} chunks per pipeline rank" if c.interleave > 1 else ", 1F1B pipeline"
    lines = [
        f"best: dp={c.dp} tp={c.tp} pp={c.pp} cp={c.cp} ep={c.ep}, ZeRO-{c.zero}, {c.micro_batches} "
        f"micro-batch{'es' if c.micro_batches > 1 else ''}{pipeline}, recomputation "
        f"{'on' if c.recompute else 'off'}, gradient compression {c.compression}",
        f"step {t.step:.3f} s = compute {t.compute:.3f} (recomputation {t.recompute:.3f}) + bubble "
        f"{t.bubble:.3f} + exposed communication {sum(v.exposed for v in t.comms.values()):.3f}"
        + (f" + optimizer {t.optimizer:.3f}" if t.optimizer else "")
        + f"; MFU {x.mfu:.1%}",
    ]
    if t.comms:
        lines.append("  communication  link    total s  exposed s  hidden s  what")
        for name, v in t.comms.items():
            lines.append(
                f"  {name:<13}  {v.link:<6} {v.total:8.3f}  {v.exposed:9.3f}  {v.hidden:8.3f}  {v.note}"
            )
    mem = x.memory
    stage = f" (pipeline stage {mem.stage})" if c.pp > 1 else ""
    lines.append(f"memory per device{stage}: {_g(mem.total)} of {_g(x.memory_limit)} usable")
    for part in mem.PARTS:
        lines.append(f"  {part:<12} {_g(getattr(mem, part)):>10}")
    lines.append("why:")
    lines.extend(f"  - {r}" for r in x.reasons)
    lines.append("apply it:")
    lines.extend(f"    {line}" if line else "" for line in x.snippet.splitlines())
    return "\n".join(lines)


def report(result: PlanResult, links: str = "given, not measured") -> str:
    """The whole text report (``links``: where the links' figures come from)."""
    return "\n\n".join([describe_inputs(result, links), table(result.layouts), details(result.layouts[0])])


def _measure(args: argparse.Namespace) -> Optional[Any]:
    """--measure: the links among the job's ranks (every rank measures; the default process group,
    started from torchrun's environment when none is); fills the cluster fields not given. Returns
    the measurement on rank 0, None on the others (which print nothing)."""
    import torch
    import torch.distributed as dist

    from .measure import measure_links, measure_matmul_overlap

    started = False
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise _UsageError("--measure runs on the ranks of a job: launch the command with torchrun "
                              "(RANK and WORLD_SIZE are not set)")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
        started = True
    try:
        links = measure_links(None)
        overlap = measure_matmul_overlap(None)
        rank = dist.get_rank()
    finally:
        if started:
            dist.destroy_process_group()
    given = {
        "hosts": links.hosts,
        "devices_per_host": links.devices_per_host,
        "intra_gbps": None if links.intra_bandwidth is None else links.intra_bandwidth / 1e9,
        "inter_gbps": None if links.inter_bandwidth is None else links.inter_bandwidth / 1e9,
        "intra_latency_us": None if links.intra_latency is None else links.intra_latency * 1e6,
        "inter_latency_us": None if links.inter_latency is None else links.inter_latency * 1e6,
    }
    if args.overlap is None:
        args.overlap = round(overlap["overlap"], 2)
    for name, value in given.items():
        if getattr(args, name) is None and value is not None:
            setattr(args, name, value)
    return (links, overlap) if rank == 0 else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; returns 0, 1 when no layout fits, 2 for bad arguments."""
    parser = build_parser()
    args = None
    measured = None
    try:
        args = parser.parse_args(argv)
        if args.top <= 0:
            raise _UsageError(f"--top must be positive, got {args.top}")
        if args.measure:
            measured = _measure(args)
            if measured is None:  # not rank 0
                return 0
        result = search(_model(args), _cluster(args), _constraints(args), args.top, _assumptions(args))
    except NoLayoutFits as e:
        if args is not None and args.json:
            print(json.dumps({"error": str(e)}))
        else:
            print(f"braid.plan: {e}", file=sys.stderr)
        return 1
    except (_UsageError, ValueError, TypeError) as e:
        parser.print_usage(sys.stderr)
        print(f"braid.plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        if measured is not None:
            links, overlap = measured
            out["measured"] = {**links.cluster_fields(), "samples": links.samples, "overlap": overlap}
        print(json.dumps(out, indent=2))
    else:
        if measured is not None:
            from .measure import OVERLAP_BYTES

            links, overlap = measured
            print(links.describe())
            print(f"overlap: {overlap['overlap']:.2f}{' or more' if overlap['bound'] else ''} "
                  f"({overlap['products']:.0f} matrix products {overlap['compute_s'] * 1e3:.1f} ms, "
                  f"a {OVERLAP_BYTES >> 20} MiB all-reduce {overlap['comm_s'] * 1e3:.1f} ms, both at once "
                  f"{overlap['both_s'] * 1e3:.1f} ms)")
        print(report(result, links="measured where a pair of ranks crossed the level, else given"
                     if measured is not None else "given, not measured"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the output was piped into head or the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
