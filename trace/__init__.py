"""braid.trace: the flight recorder's dumps read back.

Each communicator records its last calls in a ring buffer; on ``CommTimeout``, ``PeerError`` or
``CollectiveMismatch`` (and on ``dump_trace()`` or a chosen signal) every rank writes it to
``$BRAID_TRACE_DIR/braid-trace-<comm_id>-rank<R>.json``. This package reads those files
(``load``), finds the first collective where the ranks diverge, the ranks slow to arrive and what
the calls cost (``analyze``, in words with ``render``), and exports Chrome/Perfetto traces
(``to_chrome``). The command line: ``python -m braid.trace analyze DIR`` and ``python -m
braid.trace export DIR --chrome OUT.json``. docs/trace.md describes the format and the rules."""
from .analysis import analyze
from .chrome import to_chrome
from .dump import Dump, Entry, TraceFileError, communicators, load
from .report import render

__all__ = ["Dump", "Entry", "TraceFileError", "analyze", "communicators", "load", "render", "to_chrome"]
