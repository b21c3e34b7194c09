"""Output of the benchmarks: progress bar, nccl-tests style tables, JSON and busbw plots (torch-free)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from .protocol import ALL_OPS, REDOP



def choice_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type``: a comma-separated list of ``choices`` (duplicates dropped, order
    kept); ArgumentTypeError naming the unknown ones, or an empty list."""
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        unknown = [s for s in items if s not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'} given; choose from "
                                             f"{', '.join(choices)} (comma-separated)")
        return items
    return parse

def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """``[####------]  12/108  braid all_reduce 4 MiB`` on stderr: redrawn in place on a terminal,
    otherwise one line at most every 10 seconds so that logs stay short."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None):
        self._total = total
        self._done = 0
        self._enabled = enabled and total > 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._last_line = 0.0
        self._width = 0

    def __call__(self, impl: str, op: str, nbytes: int | None) -> None:
        """Announces the next cell (``nbytes`` None: no size to show)."""
        self._done += 1
        if not self._enabled:
            return
        filled = 20 * (self._done - 1) // self._total  # cells finished before this one
        line = (f"[{'#' * filled}{'-' * (20 - filled)}] {self._done:>{len(str(self._total))}}/{self._total}"
                f"  {impl} {op}" + ("" if nbytes is None else f" {human_bytes(nbytes)}"))
        if self._tty:
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif time.monotonic() - self._last_line >= 10 or self._done == 1:
            self._stream.write(line + "\n")
            self._last_line = time.monotonic()
        self._stream.flush()

    def skip(self, cells: int) -> None:
        """Counts ``cells`` announced cells as done without running them (a run that needed fewer)."""
        self._done += cells

    def close(self) -> None:
        """Erases the bar (terminal only)."""
        if self._enabled and self._tty and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0


def _select(records: Sequence[dict], impl: str, op: str) -> list[dict]:
    return sorted((r for r in records if r["impl"] == impl and r["op"] == op), key=lambda r: r["bytes"])


def impls_of(records: Sequence[dict]) -> list[str]:
    """Implementations in order of first appearance."""
    return list(dict.fromkeys(r["impl"] for r in records))


def ops_of(records: Sequence[dict]) -> list[str]:
    present = {r["op"] for r in records}
    return [op for op in ALL_OPS if op in present]


def results_table(records: Sequence[dict], impl: str, op: str) -> str:
    """One nccl-tests style block: the sizes of ``op`` measured with ``impl``."""
    rows = _select(records, impl, op)
    if not rows:
        return ""
    lines = [f"# {impl} {op}, {rows[0]['world_size']} ranks",
             (f"#{'size':>11} {'count':>11} {'type':>9} {'redop':>6} {'time':>11} {'algbw':>9} "
              f"{'busbw':>9} {'#wrong':>7}"),
             f"#{'(B)':>11} {'(elements)':>11} {'':>9} {'':>6} {'(us)':>11} {'(GB/s)':>9} {'(GB/s)':>9}"]
    for r in rows:
        lines.append(f"{r['bytes']:>12} {r['count']:>11} {r['dtype']:>9} {REDOP[r['op']]:>6} "
                     f"{r['time_us']:>11.2f} {r['algbw_gbps']:>9.3f} {r['busbw_gbps']:>9.3f} {r['wrong']:>7}")
    return "\n".join(lines)


def _size(r: dict) -> int:
    """The size a record was asked for (the row it belongs to); records without it: its bytes."""
    return r.get("size", r["bytes"])


def ratio_table(records: Sequence[dict], impl: str, peer: str) -> str:
    """busbw of ``impl`` over busbw of ``peer`` per op and size (>1: ``impl`` faster). Equal to
    the peer's time over ``impl``'s: both measured the same bytes, and that also holds for 1 rank."""
    ops = [op for op in ops_of(records) if _select(records, impl, op) and _select(records, peer, op)]
    if not ops:
        return ""
    by_key: dict[tuple, dict] = {(r["impl"], r["op"], _size(r)): r for r in records}
    sizes = sorted({_size(r) for r in records if r["impl"] in (impl, peer) and r["op"] in ops})
    flagged = False
    lines = [f"# busbw ratio {impl} / {peer} (>1: {impl} faster)",
             f"#{'size (B)':>11}" + "".join(f" {op:>15}" for op in ops)]
    for nbytes in sizes:
        cells = []
        for op in ops:
            mine, theirs = by_key.get((impl, op, nbytes)), by_key.get((peer, op, nbytes))
            if mine is None or theirs is None:
                cells.append(f"{'-':>15}")
                continue
            mark = "!" if mine["wrong"] or theirs["wrong"] else " "
            flagged |= mark == "!"
            cells.append(f"{theirs['time_us'] / mine['time_us']:>14.2f}{mark}")
        lines.append((f"{nbytes:>12}" + "".join(f" {c}" for c in cells)).rstrip())
    if flagged:
        lines.append("# !: one side returned wrong elements at this size")
    return "\n".join(lines)


def floor_table(records: Sequence[dict], impl: str, floor_gbps: dict) -> str:
    """``impl``'s busbw beside the single-copy floor: each rank copying every byte it must move
    once at this machine's copy rate for that size (``floor_gbps``: bytes -> GB/s). For every
    collective here that is a busbw equal to the copy rate (each rank reads the (n-1)/n of the
    data, or 2(n-1)/n for all_reduce, that busbw counts); a column per op of busbw / floor."""
    ops = [op for op in ops_of(records) if _select(records, impl, op)]
    if not ops or not floor_gbps:
        return ""
    by_key: dict[tuple, dict] = {(r["op"], _size(r)): r for r in records if r["impl"] == impl}
    lines = [f"# single-copy floor (GB/s: one copy of each byte that must move, at this machine's copy "
             f"rate) and {impl}'s busbw / floor",
             f"#{'size (B)':>11} {'floor':>9}" + "".join(f" {op:>15}" for op in ops)]
    for nbytes in sorted(floor_gbps):
        floor = floor_gbps[nbytes]
        cells = []
        for op in ops:
            r = by_key.get((op, nbytes))
            cells.append(f"{'-':>15}" if r is None or floor <= 0 else f"{r['busbw_gbps'] / floor:>15.2f}")
        lines.append((f"{nbytes:>12} {floor:>9.2f}" + "".join(f" {c}" for c in cells)).rstrip())
    return "\n".join(lines)


def machine_info() -> dict:
    """What a reader needs to compare runs: host, CPU, cores, memory, load, OS, Python."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"hostname": socket.gethostname(), "cpu": cpu, "logical_cpus": os.cpu_count(),
            "usable_cpus": usable, "memory_gib": memory_gib,
            # Other work on the host skews every figure; the 1, 5 and 15 minute averages at start.
            "load_average": [round(x, 2) for x in os.getloadavg()], "platform": platform.platform(),
            "python": platform.python_version()}


def output_path(suffix: str | None = None):
    """An argparse ``type`` for a file the run writes at its end (``--json``, ``--plot``), checked
    before anything runs, so that a bad path does not throw the results away afterwards: not
    empty, not a directory, with ``suffix`` when given, and creatable (its directory is made)."""

    def check(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("the path is empty")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r} is a directory")
        if suffix is not None and not text.lower().endswith(suffix):
            raise argparse.ArgumentTypeError(f"{text!r} must end in {suffix}")
        existed = os.path.exists(text)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(text)), exist_ok=True)
            with open(text, "a"):
                pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror}") from None
        if not existed:
            os.remove(text)
        return text

    return check


def write_json(path: str, document: dict) -> None:
    """``document`` as JSON: a dict takes one line per key, a list of dicts (the records) one line
    per element, anything else one line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(_json_lines(document, 0) + "\n")


def _json_lines(value: object, depth: int) -> str:
    pad, end = " " * (depth + 1), " " * depth
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k)}: {_json_lines(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{end}}}"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "[\n" + ",\n".join(pad + json.dumps(v) for v in value) + f"\n{end}]"
    return json.dumps(value)


def panel_grid(count: int, max_cols: int, panel_size: tuple[float, float]):
    """A matplotlib figure (no display needed) with ``count`` panels in rows of ``max_cols``;
    returns (figure, iterator over the axes). Pass both to :func:`save_panels`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(max_cols, count)
    nrows = -(-count // ncols)
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False).flat


def save_panels(fig, axes, path: str, title: str) -> None:
    """Hides the panels ``axes`` still holds (unused), titles the figure and writes it as PNG."""
    for ax in list(axes):
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def plot_busbw(path: str, records: Sequence[dict], title: str) -> None:
    """PNG of busbw against size: one panel per op, one line per impl, wrong results crossed out."""
    ops = ops_of(records)
    if not ops:
        print(f"braid.bench: nothing measured: {path} not written", file=sys.stderr)
        return
    fig, axes = panel_grid(len(ops), 2, (6.4, 4.4))
    for op, ax in zip(ops, axes):  # ops first: zip must not take an axis it will not use
        wrong_labelled = False
        for impl in impls_of(records):
            rows = [r for r in _select(records, impl, op) if r["busbw_gbps"] > 0]
            if not rows:
                continue
            xs, ys = [r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows]
            ax.plot(xs, ys, marker="o", markersize=4, label=impl)
            bad = [r for r in rows if r["wrong"]]
            if bad:
                ax.plot([r["bytes"] for r in bad], [r["busbw_gbps"] for r in bad], "x", color="red",
                        markersize=10, label=None if wrong_labelled else "#wrong > 0")
                wrong_labelled = True
        sizes = sorted({r["bytes"] for r in records if r["op"] == op})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [human_bytes(s).replace(" ", "") for s in sizes], rotation=45, fontsize=8)
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(op)
        ax.set_xlabel("size S (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.legend(fontsize=8)
    save_panels(fig, axes, path, title)


def paired_ratios(step_times: dict, mode: str) -> dict:
    """``mode``'s step over each other mode's, taken step by step (the modes run back to back within
    a step) and the median over the steps: {other mode: ratio}. On a shared machine whose speed
    drifts during a run (by up to 2x over a few minutes on a shared VM), the ratio of two
    medians carries that drift into the comparison; the per-step ratio pairs steps run moments
    apart and cancels it."""
    mine = step_times[mode]
    return {m: statistics.median(a / b for a, b in zip(mine, other))
            for m, other in step_times.items() if m != mode and len(other) == len(mine)}
