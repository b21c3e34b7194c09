"""Command line of the flight recorder's analyzer: ``python -m braid.trace analyze|export DIR``."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .analysis import DEFAULT_RECENT, analyze
from .chrome import to_chrome
from .dump import TraceFileError, communicators, load, named_in_file
from .report import render


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (2: bad arguments, nothing to read, or a dump
    that cannot be read: each such dump is named on stderr and the others are still analyzed or
    exported)."""
    parser = argparse.ArgumentParser(
        prog="python -m braid.trace",
        description="Reads braid's flight-recorder dumps (braid-trace-<comm>-rank<R>.json, one per rank).")
    # What both commands read: the dumps, and which communicator of them.
    dumps_args = argparse.ArgumentParser(add_help=False)
    dumps_args.add_argument("path", metavar="DIR", help="directory of dumps, or one dump file")
    dumps_args.add_argument("--comm", metavar="ID", help="only this communicator (its id or a unique prefix)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    analyze_cmd = commands.add_parser(
        "analyze", parents=[dumps_args],
        help="first divergent collective, missing ranks, slowest ranks, per-kind statistics",
        description="Analyzes each communicator found: the first collective where the ranks diverge "
                    "(ranks that never issued it and what they are doing, or the field that differs), "
                    "ranks slow to arrive, and per-kind statistics.")
    analyze_cmd.add_argument("--json", action="store_true",
                             help="print one JSON object per communicator (one per line) instead of words")
    analyze_cmd.add_argument("--recent", metavar="N", type=_positive_int, default=DEFAULT_RECENT,
                             help=f"slowest ranks over the last N collectives every rank recorded "
                                  f"(default {DEFAULT_RECENT})")
    export_cmd = commands.add_parser(
        "export", parents=[dumps_args],
        help="write a Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev)",
        description="Writes the dumps as a Chrome trace: a process per rank, a track per thread, "
                    "a slice per call with its fields.")
    export_cmd.add_argument("--chrome", metavar="OUT.json", required=True, help="the trace file to write")
    ns = parser.parse_args(argv)

    bad: dict[str, TraceFileError] = {}
    try:
        groups = communicators(load(ns.path, bad))
    except TraceFileError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    # {comm_id: {rank: why}} of the unreadable dumps, by the recorder's file names.
    unreadable: dict[str, dict[int, str]] = {}
    for path, error in bad.items():
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        named = named_in_file(path)
        if named is not None:
            unreadable.setdefault(named[0], {})[named[1]] = str(error)
    status = 2 if bad else 0
    if not groups:
        return status
    if ns.comm is not None:
        chosen = [c for c in groups if c == ns.comm] or [c for c in groups if c.startswith(ns.comm)]
        if len(chosen) != 1:
            found = "no" if not chosen else "several"
            parser.error(f"{found} communicators match --comm {ns.comm}; the dumps hold {', '.join(groups)}")
        groups = {chosen[0]: groups[chosen[0]]}

    if ns.command == "analyze":
        results = [analyze(group, recent=ns.recent, unreadable=unreadable.get(comm_id))
                   for comm_id, group in groups.items()]
        if ns.json:
            sys.stdout.write("".join(json.dumps(r) + "\n" for r in results))
        else:
            sys.stdout.write("\n".join(render(r) for r in results))
        return status
    trace = to_chrome([d for group in groups.values() for d in group])
    try:
        with open(ns.chrome, "w") as f:
            json.dump(trace, f)
    except OSError as e:
        print(f"{parser.prog}: error: cannot write {ns.chrome}: {e.strerror or e}", file=sys.stderr)
        return 1
    calls = sum(1 for event in trace["traceEvents"] if event["ph"] == "X")
    ranks = sum(len(group) for group in groups.values())
    print(f"wrote {ns.chrome}: {calls} calls of {ranks} rank{'s' if ranks != 1 else ''}; "
          f"open it in ui.perfetto.dev or chrome://tracing")
    return status


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
