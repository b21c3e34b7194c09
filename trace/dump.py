"""The flight recorder's dump files (format "braid-trace", version 1): reading and validation."""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional

FORMAT = "braid-trace"
VERSION = 1
# The recorder names its files braid-trace-<comm_id>-rank<R>.json; a directory is read by this
# pattern, so other files in it (a torch.profiler trace, a log) are left alone.
FILE_PREFIX = "braid-trace-"
FILE_SUFFIX = ".json"
# The recorder's file name: which communicator and rank a dump is of, even when its content is
# unreadable.
_FILE_NAME = re.compile(re.escape(FILE_PREFIX) + r"(?P<comm_id>.+)-rank(?P<rank>\d+)"
                        + re.escape(FILE_SUFFIX))
STATES = ("issued", "started", "completed", "failed")


class TraceFileError(ValueError):
    """A dump file that cannot be read as format braid-trace version 1; the message names the file
    and what is wrong with it."""


@dataclass(frozen=True)
class Entry:
    """One recorded call (a collective or a point-to-point transfer) of one rank."""

    id: int                    # 1-based count of calls recorded on the communicator
    seq: Optional[int]         # collective sequence number, equal on every rank; None for send/recv
    kind: str
    dtype: str
    count: int
    op: Optional[str]
    root: Optional[int]
    peer: Optional[int]
    algorithm: Optional[str]
    bytes: dict[str, int]      # {transport: bytes this rank sent for the call}
    wire_ratio: Optional[float]
    state: str                 # one of STATES
    issued_us: int
    started_us: Optional[int]
    completed_us: Optional[int]  # also the time of failure for a failed call
    error: Optional[str]
    thread: str
    stack: Optional[str]

    @property
    def finished(self) -> bool:
        """Whether the call ended (completed or failed)."""
        return self.state in ("completed", "failed")

    @property
    def total_bytes(self) -> int:
        """Bytes sent over every transport."""
        return sum(self.bytes.values())


@dataclass(frozen=True)
class Dump:
    """The recorder's buffer of one rank of one communicator, as dumped."""

    path: str
    comm_id: str
    rank: int
    world_size: int
    hosts: tuple[int, ...]     # host index of every rank
    hostname: str
    pid: int
    reason: str
    dumped_us: int
    buffer: int
    recorded: int
    braid_version: str
    entries: tuple[Entry, ...]  # oldest first (ascending id)

    @property
    def evicted(self) -> bool:
        """Whether the ring overwrote calls: the oldest recorded calls are gone."""
        return self.recorded > len(self.entries)


def load(path: str | os.PathLike, bad: Optional[dict[str, TraceFileError]] = None) -> list[Dump]:
    """Reads and validates dumps: one file, or every ``braid-trace-*.json`` file of a directory.

    Returns the dumps sorted by communicator and rank. Raises ``TraceFileError`` naming the file
    for a file that is not a valid dump, and for two dumps of one communicator that disagree on its
    layout or claim the same rank. With ``bad`` (a dict), a file that is not a valid dump is left
    out and recorded there instead, ``{file: its TraceFileError}``, so that one corrupt dump does
    not cost the others."""
    path = os.fspath(path)
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.startswith(FILE_PREFIX) and n.endswith(FILE_SUFFIX))
        if not names:
            raise TraceFileError(f"{path}: no dump files ({FILE_PREFIX}*{FILE_SUFFIX}) in this directory")
        files = [os.path.join(path, n) for n in names]
    elif os.path.exists(path):
        files = [path]
    else:
        raise TraceFileError(f"{path}: no such file or directory")
    dumps = []
    for f in files:
        try:
            dumps.append(read_dump(f))
        except TraceFileError as e:
            if bad is None:
                raise
            bad[f] = e
    _check_layouts(dumps)
    return sorted(dumps, key=lambda d: (d.comm_id, d.rank))


def read_dump(path: str) -> Dump:
    """Reads one dump file; raises ``TraceFileError`` saying what is wrong with it."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TraceFileError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse(raw, path)


def parse(raw: bytes, path: str) -> Dump:
    """Parses and validates the bytes of a dump; ``path`` names it in errors."""
    # A stray byte in a stack or an error message must not cost the whole dump: undecodable bytes
    # become U+FFFD (text that was never a dump still fails as JSON below).
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        raise TraceFileError(f"{path}: empty file (the writer may have died before writing it)")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if _cut_short(text, e):
            what = "truncated JSON (the writer may have died in the middle of the file)"
        else:
            what = f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        raise TraceFileError(f"{path}: not a braid-trace dump: {what}") from None
    except RecursionError:
        raise TraceFileError(f"{path}: not a braid-trace dump: JSON nested too deeply") from None
    return validate(doc, path)


# The start of a number, as a text cut in the middle of one ends ("-", "12.", "1e").
_NUMBER_START = re.compile(r"-?\d*\.?\d*(?:[eE][-+]?\d*)?")


def _cut_short(text: str, error: json.JSONDecodeError) -> bool:
    """Whether the JSON text is a prefix of a document (the writer stopped early) rather than text
    that was never JSON: the parser failed at the end, in a number or literal the end cut off, or
    in a string or escape the end cut off."""
    rest = text[error.pos:].rstrip()
    return (_NUMBER_START.fullmatch(rest) is not None
            or any(literal.startswith(rest) for literal in ("true", "false", "null"))
            or error.msg.startswith("Unterminated string")
            or (error.msg.startswith("Invalid \\uXXXX escape") and len(rest) < 6))


def validate(doc: Any, path: str) -> Dump:
    """Validates a decoded dump document; ``path`` names it in errors. Keys this version does not
    know are ignored (a later writer of version 1 may add some)."""
    if not isinstance(doc, dict):
        raise TraceFileError(f"{path}: not a braid-trace dump: the top level is {_json_type(doc)}, "
                             "not an object")
    if doc.get("format") != FORMAT:
        raise TraceFileError(f"{path}: not a braid-trace dump: \"format\" is {_show(doc.get('format'))}, "
                             f"expected {json.dumps(FORMAT)}")
    if "version" not in doc:
        raise TraceFileError(f"{path}: version is missing")
    if not (_is_int(doc["version"]) and doc["version"] == VERSION):
        raise TraceFileError(f"{path}: braid-trace version {_show(doc['version'])} is not supported: this "
                             f"braid reads version {VERSION} (analyze it with the braid that wrote it)")
    f = _Fields(doc, path, "")
    world_size = f.get("world_size", _int_at_least(1))
    rank = f.get("rank", _int_at_least(0))
    if rank >= world_size:
        raise TraceFileError(f"{path}: rank {rank} is not below world_size {world_size}")
    hosts = f.get("hosts", _HOSTS)
    if len(hosts) != world_size:
        raise TraceFileError(f"{path}: hosts has {len(hosts)} entries, expected one per rank ({world_size})")
    entries = sorted((_parse_entry(e, path, i) for i, e in enumerate(f.get("entries", _LIST))),
                     key=lambda e: e.id)
    recorded = f.get("recorded", _int_at_least(0))
    if len(entries) > recorded:
        raise TraceFileError(f"{path}: holds {len(entries)} entries but recorded says {recorded} calls")
    _check_unique(entries, "id", path)
    _check_unique([e for e in entries if e.seq is not None], "seq", path)
    return Dump(
        path=path, comm_id=f.get("comm_id", _NONEMPTY_STR), rank=rank, world_size=world_size,
        hosts=tuple(hosts), hostname=f.get("hostname", _STR), pid=f.get("pid", _int_at_least(0)),
        reason=f.get("reason", _STR), dumped_us=f.get("dumped_us", _int_at_least(0)),
        buffer=f.get("buffer", _int_at_least(0)), recorded=recorded,
        braid_version=f.get("braid_version", _STR), entries=tuple(entries))


def named_in_file(path: str) -> Optional[tuple[str, int]]:
    """(comm_id, rank) that the recorder's name of a dump file says, or None for another name."""
    found = _FILE_NAME.fullmatch(os.path.basename(path))
    return (found["comm_id"], int(found["rank"])) if found else None


def communicators(dumps: Iterable[Dump]) -> dict[str, list[Dump]]:
    """{comm_id: [its dumps by rank]} in comm_id order."""
    found: dict[str, list[Dump]] = {}
    for d in sorted(dumps, key=lambda d: (d.comm_id, d.rank)):
        found.setdefault(d.comm_id, []).append(d)
    return found


def _check_layouts(dumps: list[Dump]) -> None:
    """Dumps of one communicator agree on its layout, and no rank has two."""
    for comm_id, group in communicators(dumps).items():
        for before, d in zip(group, group[1:]):
            if (d.world_size, d.hosts) != (before.world_size, before.hosts):
                raise TraceFileError(
                    f"{d.path}: communicator {comm_id} has world_size {d.world_size} and hosts "
                    f"{list(d.hosts)} here but world_size {before.world_size} and hosts "
                    f"{list(before.hosts)} in {before.path}")
            if d.rank == before.rank:
                raise TraceFileError(f"{d.path}: a second dump of rank {d.rank} of communicator {comm_id} "
                                     f"(the other is {before.path}); keep one of them")


def _parse_entry(doc: Any, path: str, index: int) -> Entry:
    where = f"entries[{index}]"
    if not isinstance(doc, dict):
        raise TraceFileError(f"{path}: {where} should be an object, got {_show(doc)}")
    f = _Fields(doc, path, where + ".")
    entry = Entry(
        id=f.get("id", _int_at_least(1)),
        seq=f.get("seq", _optional(_int_at_least(0))),
        kind=f.get("kind", _NONEMPTY_STR),
        dtype=f.get("dtype", _STR),
        count=f.get("count", _int_at_least(0)),
        op=f.get("op", _optional(_STR)),
        root=f.get("root", _optional(_INT)),
        peer=f.get("peer", _optional(_INT)),
        algorithm=f.get("algorithm", _optional(_STR)),
        bytes=dict(f.get("bytes", _BYTES)),
        wire_ratio=f.get("wire_ratio", _optional(_RATIO)),
        state=f.get("state", _one_of(STATES)),
        issued_us=f.get("issued_us", _INT),
        started_us=f.get("started_us", _optional(_INT)),
        completed_us=f.get("completed_us", _optional(_INT)),
        error=f.get("error", _optional(_STR)),
        thread=f.get("thread", _STR),
        stack=f.get("stack", _optional(_STR)))
    if entry.finished and entry.completed_us is None:
        raise TraceFileError(f"{path}: {where}.completed_us is null although the call {entry.state}")
    return entry


def _check_unique(entries: list[Entry], field: str, path: str) -> None:
    seen = set()
    for e in entries:
        value = getattr(e, field)
        if value in seen:
            raise TraceFileError(f"{path}: two entries have {field} {value}")
        seen.add(value)


class _Type:
    """What a field must hold: ``expected`` says it in words, ``test`` checks a decoded value."""

    def __init__(self, expected: str, test: Callable[[Any], bool]):
        self.expected, self.test = expected, test


class _Fields:
    """Reads the required fields of one JSON object, naming the file and the key in errors."""

    def __init__(self, doc: dict, path: str, where: str):
        self.doc, self.path, self.where = doc, path, where

    def get(self, key: str, kind: _Type) -> Any:
        if key not in self.doc:
            raise TraceFileError(f"{self.path}: {self.where}{key} is missing")
        value = self.doc[key]
        if not kind.test(value):
            raise TraceFileError(f"{self.path}: {self.where}{key} should be {kind.expected}, "
                                 f"got {_show(value)}")
        return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_at_least(low: int) -> _Type:
    return _Type(f"an integer >= {low}", lambda v: _is_int(v) and v >= low)


def _optional(kind: _Type) -> _Type:
    return _Type(f"null or {kind.expected}", lambda v: v is None or kind.test(v))


def _one_of(values: tuple) -> _Type:
    return _Type("one of " + ", ".join(json.dumps(v) for v in values), lambda v: v in values)


_INT = _Type("an integer", _is_int)
_STR = _Type("a string", lambda v: isinstance(v, str))
_NONEMPTY_STR = _Type("a non-empty string", lambda v: isinstance(v, str) and v != "")
_RATIO = _Type("a finite number >= 0",
               lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and v >= 0)
_HOSTS = _Type("a list of host indexes (integers >= 0)",
               lambda v: isinstance(v, list) and all(_is_int(h) and h >= 0 for h in v))
_LIST = _Type("a list", lambda v: isinstance(v, list))
_BYTES = _Type('an object of byte counts (integers >= 0) per transport, with "shm" and "tcp"',
               lambda v: isinstance(v, dict) and "shm" in v and "tcp" in v
               and all(_is_int(b) and b >= 0 for b in v.values()))


def _json_type(v: Any) -> str:
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "a boolean"
    return "null" if v is None else "a number"


def _show(v: Any) -> str:
    """A value as JSON, shortened for an error message."""
    try:
        text = json.dumps(v)
    except (ValueError, RecursionError):
        return _json_type(v)
    return text if len(text) <= 60 else text[:57] + "..."
