"""braid.trace, the flight recorder's reader, on synthetic dumps written by the tests: the analyzer
names missing ranks and mismatched fields, leaves evicted calls out, finds slow ranks and computes
statistics by hand-checked numbers; the Chrome export has the right structure; bad files give a
TraceFileError naming the file (on the command line: named on stderr, exit status 2, the other
dumps still analyzed), and fuzzed files never crash it.
No rank processes: the C++ recorder that writes the dumps is tested with the communicator."""
import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from braid.trace import TraceFileError, analyze, communicators, load, render, to_chrome
from braid.trace.__main__ import main
from braid.trace.dump import parse

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_764_190_000_000_000  # wall clock of the synthetic runs, microseconds since the epoch
COMM = "9f3a0c1d2e3f4a5b"


def entry(id, seq, kind="all_reduce", *, issued, duration=100, state="completed", dtype="float32",
          count=1024, op="sum", root=None, peer=None, algorithm="ring", shm=None, tcp=0, started=None,
          wire_ratio=None, error=None, thread="4242", stack=None):
    """One recorded call as the C++ recorder writes it; started defaults to the issue time."""
    started = issued if started is None and state != "issued" else started
    finished = state in ("completed", "failed")
    return {"id": id, "seq": seq, "kind": kind, "dtype": dtype, "count": count, "op": op, "root": root,
            "peer": peer, "algorithm": algorithm,
            "bytes": {"shm": count * 4 if shm is None else shm, "tcp": tcp}, "wire_ratio": wire_ratio,
            "state": state, "issued_us": issued, "started_us": started,
            "completed_us": (started if started is not None else issued) + duration if finished else None,
            "error": error, "thread": thread, "stack": stack}


def dump_doc(rank, world_size, entries, *, comm_id=COMM, hosts=None, recorded=None, buffer=2000,
             reason="CommTimeout: rank 1 did not arrive at all_reduce #8", dumped=None):
    """A dump document; recorded defaults to the number of entries (nothing evicted)."""
    return {"format": "braid-trace", "version": 1, "braid_version": "0.1.0", "comm_id": comm_id,
            "rank": rank, "world_size": world_size, "hosts": hosts or [0] * world_size,
            "hostname": f"node-{rank}", "pid": 1000 + rank, "reason": reason,
            "dumped_us": dumped if dumped is not None else T0 + 60_000_000, "buffer": buffer,
            "recorded": len(entries) if recorded is None else recorded, "entries": entries}


def collectives(seqs, *, late=0, first_id=1, **fields):
    """Completed all_reduces with these seqs, one each millisecond, issued ``late`` us after it."""
    return [entry(first_id + i, s, issued=T0 + s * 1000 + late, **fields) for i, s in enumerate(seqs)]


def write(folder, doc, name=None):
    path = Path(folder) / (name or f"braid-trace-{doc['comm_id']}-rank{doc['rank']}.json")
    path.write_text(json.dumps(doc))
    return path


def analyze_docs(tmp_path, docs, **kwargs):
    for doc in docs:
        write(tmp_path, doc)
    return analyze(load(tmp_path), **kwargs)


def hang_docs():
    """3 ranks: rank 1 stopped after seq 7 (busy elsewhere); ranks 0 and 2 issued seq 8 and waited,
    rank 0 timed out."""
    stack = 'File "train.py", line 88, in step\n    loss = model(batch)'
    r0 = collectives(range(1, 8)) + [entry(8, 8, issued=T0 + 8000, state="failed", duration=300_000_000,
                                           error="CommTimeout: rank 1 did not arrive at all_reduce #8")]
    r1 = collectives(range(1, 7)) + [entry(7, 7, issued=T0 + 7000, stack=stack)]
    r2 = collectives(range(1, 8)) + [entry(8, 8, issued=T0 + 8000, state="started")]
    dumped = T0 + 300_010_000
    return [dump_doc(0, 3, r0, dumped=dumped), dump_doc(1, 3, r1, dumped=dumped, reason="PeerError: rank 0"),
            dump_doc(2, 3, r2, dumped=dumped)]


def test_missing_rank_named_with_its_last_call(tmp_path):
    """A rank that never issued seq 8: the divergence is seq 8, the rank is named with its last call
    (seq 7, completed, how long before its dump, its stack) and the timed-out rank's error shown."""
    result = analyze_docs(tmp_path, hang_docs())
    div = result["first_divergence"]
    assert (div["seq"], div["kind"], div["issued_by"], div["missing_ranks"]) == (8, "all_reduce", [0, 2], [1])
    assert div["mismatch"] is None
    (missing,) = div["missing"]
    last = missing["last_call"]
    assert (missing["rank"], missing["last_seq"], last["seq"], last["kind"], last["state"]) == \
        (1, 7, 7, "all_reduce", "completed")
    # completed at T0 + 7000 + 100 us, dumped at T0 + 300.01 s
    assert last["finished_before_dump_s"] == pytest.approx((300_010_000 - 7100) / 1e6)
    assert div["states"] == {"0": "failed", "2": "started"}
    assert div["errors"] == {"0": "CommTimeout: rank 1 did not arrive at all_reduce #8"}
    text = render(result)
    assert "First divergence: all_reduce seq 8" in text
    assert "issued by ranks 0, 2; not by rank 1" in text
    assert "rank 1 stopped at seq 7: its last call, all_reduce seq 7 (call #7), completed 300.0 s" in text
    assert "loss = model(batch)" in text
    assert "error on rank 0: CommTimeout" in text


def test_missing_rank_waiting_inside_braid(tmp_path):
    """A missing rank whose last call is a receive still in progress is said to wait inside braid,
    with the peer it waits on (a pipeline stage waiting for its neighbour while the others moved on)."""
    r0 = collectives(range(1, 4)) + [entry(4, 4, issued=T0 + 4000, state="started")]
    r1 = collectives(range(1, 4)) + [entry(4, None, "recv", issued=T0 + 3500, state="started", peer=0,
                                           op=None, algorithm=None)]
    result = analyze_docs(tmp_path, [dump_doc(0, 2, r0), dump_doc(1, 2, r1)])
    div = result["first_divergence"]
    assert (div["seq"], div["missing_ranks"]) == (4, [1])
    last = div["missing"][0]["last_call"]
    assert (last["kind"], last["peer"], last["state"]) == ("recv", 0, "started")
    assert last["finished_before_dump_s"] is None
    assert last["issued_before_dump_s"] == pytest.approx((60_000_000 - 3500) / 1e6)
    assert ("its last call, recv from rank 0 (call #4), issued 60.0 s before its dump, is still\n"
            "      in progress (started, not done): it is waiting inside braid") in render(result)


@pytest.mark.parametrize("field,values", [
    ("count", (1024, 1024, 2048)),
    ("dtype", ("float32", "bfloat16", "float32")),
    ("kind", ("all_reduce", "all_reduce", "broadcast")),
    ("op", ("sum", "max", "sum")),
    ("root", (0, 0, 1)),
])
def test_mismatch_names_field_and_values(tmp_path, field, values):
    """Seq 5 recorded by every rank with one field differing: that field, every rank's value."""
    docs = []
    for rank, value in enumerate(values):
        entries = collectives(range(1, 5)) + [entry(5, 5, issued=T0 + 5000, state="failed",
                                                    error="CollectiveMismatch", **{field: value})]
        docs.append(dump_doc(rank, 3, entries))
    div = analyze_docs(tmp_path, docs)["first_divergence"]
    assert (div["seq"], div["missing_ranks"]) == (5, [])
    assert div["mismatch"]["field"] == field
    assert div["mismatch"]["values"] == {str(r): v for r, v in enumerate(values)}
    assert div["kind"] == "all_reduce"  # the majority's
    text = render(analyze(load(tmp_path)))
    assert f"First divergence: all_reduce seq 5: {field} differs" in text
    odd = next(r for r, v in enumerate(values) if values.count(v) == 1)
    assert f"{field} = {values[odd]} on rank {odd}" in text


def test_all_to_all_v_counts_may_differ(tmp_path):
    """all_to_all_v's count is what each rank sends: differing counts are no divergence."""
    docs = [dump_doc(r, 2, [entry(1, 1, "all_to_all_v", issued=T0, count=100 * (r + 1), op=None)])
            for r in range(2)]
    result = analyze_docs(tmp_path, docs)
    assert result["first_divergence"] is None
    assert "No divergence" in render(result)


def test_rank_without_dump_is_said(tmp_path):
    """World of 3, dumps of ranks 0 and 2: rank 1 is listed as having left no dump."""
    result = analyze_docs(tmp_path, [hang_docs()[0], hang_docs()[2]])
    assert result["ranks"] == [0, 2]
    assert result["missing_dumps"] == [1]
    assert result["world_size"] == 3
    assert "rank 1 (host 0) left no dump: it may have died" in render(result)


def test_whole_host_without_dumps(tmp_path):
    """4 ranks on 2 hosts, host 1's ranks left no dump: said by host, as a host that may be down."""
    docs = [dump_doc(r, 4, collectives(range(1, 4)), hosts=[0, 0, 1, 1]) for r in (0, 1)]
    result = analyze_docs(tmp_path, docs)
    assert result["missing_dumps"] == [2, 3]
    assert ("ranks 2, 3 (host 1) left no dump: they may have died (killed, out of memory, crashed) before "
            "dumping, or dumped elsewhere; all of this host's ranks: the host may be down") in render(result)


def test_eviction_limits_the_window_and_is_not_missing(tmp_path):
    """Rank 0's ring (4 calls) holds seqs 7..10 of 10; rank 1 holds 1..10. Seqs 1..6 are not missing
    on rank 0 (evicted, not skipped); the report says the window starts at 7. A seq rank 0 never
    issued (11) is still found."""
    r0 = collectives(range(7, 11), first_id=7)
    r1 = collectives(range(1, 12))
    result = analyze_docs(tmp_path, [dump_doc(0, 2, r0, buffer=4, recorded=10), dump_doc(1, 2, r1)])
    assert result["window"]["limited_by_eviction"] is True
    assert result["window"]["evicted_before"] == {"0": 7}
    assert result["window"]["first_seq"] == 7
    div = result["first_divergence"]
    assert (div["seq"], div["missing_ranks"]) == (11, [0])
    text = render(result)
    assert "The buffers of rank 0 no longer hold seqs below 7 (evicted)" in text
    assert "Every rank is compared from seq 7 on" in text


def test_evicted_seq_is_compared_among_holders_only(tmp_path):
    """A mismatch at a seq one rank has evicted is found among the ranks still holding it, and the
    evicted rank is listed apart, not as missing."""
    r0 = collectives(range(5, 9), first_id=5)
    r1 = collectives(range(1, 9))
    r2 = collectives(range(1, 9))
    r2[2] = entry(3, 3, issued=T0 + 3000, count=7)
    result = analyze_docs(tmp_path, [dump_doc(0, 3, r0, buffer=4, recorded=8), dump_doc(1, 3, r1),
                                     dump_doc(2, 3, r2)])
    div = result["first_divergence"]
    assert (div["seq"], div["missing_ranks"], div["evicted_ranks"]) == (3, [], [0])
    assert div["mismatch"]["values"] == {"1": 1024, "2": 7}


def test_stuck_collective_without_divergence(tmp_path):
    """Every rank issued seq 4; ranks 0 and 1 wait in it, rank 2 completed it: no divergence, the
    unfinished collective and who finished it are reported."""
    docs = [dump_doc(r, 3, collectives(range(1, 4)) + [
        entry(4, 4, "broadcast", issued=T0 + 4000, root=0, state="completed" if r == 2 else "started")])
        for r in range(3)]
    result = analyze_docs(tmp_path, docs)
    assert result["first_divergence"] is None
    stuck = result["stuck"]
    assert (stuck["seq"], stuck["kind"]) == (4, "broadcast")
    assert (stuck["waiting"], stuck["completed_by"]) == ([0, 1], [2])
    assert stuck["waiting_s"]["0"] == pytest.approx((60_000_000 - 4000) / 1e6)
    assert "Unfinished: broadcast seq 4: ranks 0, 1 still waiting" in render(result)


def test_slowest_rank(tmp_path):
    """Rank 2 issues every collective 500 us after rank 0, rank 1 100 us after: rank 2 is last at
    every one; --recent limits the window to the last seqs every rank recorded."""
    docs = [dump_doc(r, 3, collectives(range(1, 21), late=late)) for r, late in enumerate((0, 100, 500))]
    result = analyze_docs(tmp_path, docs)
    assert result["slowest_rank"] == 2
    rows = {row["rank"]: row for row in result["slowest"]}
    assert (rows[2]["times_last"], rows[2]["mean_lateness_us"], rows[2]["max_lateness_us"]) == (20, 500, 500)
    assert (rows[1]["times_last"], rows[1]["mean_lateness_us"]) == (0, 100)
    assert rows[0]["mean_lateness_us"] == 0
    assert result["slowest_window"] == {"collectives": 20, "first_seq": 1, "last_seq": 20,
                                        "across_hosts": False}
    assert "slowest: rank 2" in render(result)
    recent = analyze(load(tmp_path), recent=5)["slowest_window"]
    assert (recent["collectives"], recent["first_seq"], recent["last_seq"]) == (5, 16, 20)


def test_stats_by_hand(tmp_path):
    """Per kind and algorithm, against numbers worked by hand at world size 4:
    all_reduce/ring: 2 calls per rank of 1024 float32 (S = 4096 B), 100 and 300 us: algbw = 8 * 4096 B
    / 1600 us = 0.02048 GB/s, busbw = x 2*3/4. all_gather/ring: 1 call per rank of 256 bfloat16 per rank
    (S = 256 * 2 * 4 ranks = 2048 B), 50 us from its start (queued 1000 us before): algbw = 0.04096,
    busbw = x 3/4. broadcast: a failed call counts, with no time. barrier: no bandwidth."""
    docs = []
    for r in range(4):
        docs.append(dump_doc(r, 4, [
            entry(1, 1, issued=T0, duration=100, shm=6144),
            entry(2, 2, issued=T0 + 1000, duration=300, shm=6144),
            entry(3, 3, "all_gather", issued=T0 + 2000, started=T0 + 3000, duration=50, dtype="bfloat16",
                  count=256, op=None, shm=1536, tcp=10),
            entry(4, 4, "barrier", issued=T0 + 4000, duration=20, count=0, op=None, algorithm=None, shm=0),
            entry(5, 5, "broadcast", issued=T0 + 5000, root=0, state="failed" if r == 3 else "completed",
                  duration=40, algorithm=None, count=10, shm=0, wire_ratio=0.25),
        ]))
    stats = {(row["kind"], row["algorithm"]): row for row in analyze_docs(tmp_path, docs)["stats"]}
    ar = stats[("all_reduce", "ring")]
    assert (ar["calls"], ar["completed"], ar["failed"], ar["bytes"]) == (8, 8, 0, 8 * 6144)
    assert ar["time_us"] == {"total": 1600, "mean": 200, "max": 300}
    assert ar["algbw_gbps"] == pytest.approx(0.02048)
    assert ar["busbw_gbps"] == pytest.approx(0.02048 * 1.5)
    ag = stats[("all_gather", "ring")]
    assert (ag["calls"], ag["bytes"], ag["time_us"]["mean"]) == (4, 4 * 1546, 50)
    assert ag["algbw_gbps"] == pytest.approx(0.04096)
    assert ag["busbw_gbps"] == pytest.approx(0.04096 * 0.75)
    barrier = stats[("barrier", None)]
    assert (barrier["calls"], barrier["algbw_gbps"], barrier["busbw_gbps"]) == (4, None, None)
    bc = stats[("broadcast", None)]
    assert (bc["calls"], bc["completed"], bc["failed"], bc["time_us"]["total"]) == (4, 3, 1, 120)
    # 3 completed calls of 10 float32 in 40 us each: 120 B / 120 us; broadcast's factor is 1
    assert bc["algbw_gbps"] == pytest.approx(0.001) and bc["busbw_gbps"] == pytest.approx(0.001)
    assert bc["wire_ratio_mean"] == 0.25


def test_chrome_export_structure(tmp_path):
    """A process per rank named after it, a track per thread, one complete event per call with its
    fields; an unfinished call drawn to its dump with its state in the name; two overlapping calls
    of one thread on two tracks, so that no track holds overlapping slices."""
    docs = hang_docs()
    docs[0]["entries"].append(entry(9, None, "send", issued=T0 + 9000, peer=2, op=None, algorithm=None,
                                    thread="7"))
    # Async calls of rank 2's thread 4242: seq 8 (started, open to the dump) overlaps this one.
    docs[2]["entries"].append(entry(9, None, "recv", issued=T0 + 8500, peer=0, op=None, algorithm=None))
    docs[0]["recorded"] = docs[2]["recorded"] = 9
    for doc in docs:
        write(tmp_path, doc)
    trace = json.loads(json.dumps(to_chrome(load(tmp_path))))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == [f"rank {r} (host 0: node-{r})" for r in range(3)]
    pid_of = {int(name.split()[1]): pid for pid, name in names.items()}
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == sum(len(d["entries"]) for d in docs)
    for e in slices:
        assert set(e["args"]) >= {"seq", "kind", "dtype", "count", "op", "algorithm", "bytes", "state",
                                  "error"}
        assert e["dur"] >= 0
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert set(threads.values()) == {"thread 4242", "thread 7", "thread 4242 (overlapping calls 2)"}
    assert all((e["pid"], e["tid"]) in threads for e in slices)
    origin = trace["otherData"]["time_origin_us"]
    open_call = next(e for e in slices if e["pid"] == pid_of[2] and e["args"]["seq"] == 8)
    assert open_call["name"] == "all_reduce (started)"
    assert open_call["ts"] + open_call["dur"] == docs[2]["dumped_us"] - origin
    failed = next(e for e in slices if e["pid"] == pid_of[0] and e["args"]["seq"] == 8)
    assert failed["name"] == "all_reduce (failed)" and failed["args"]["error"].startswith("CommTimeout")
    for track in threads:
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if (e["pid"], e["tid"]) == track)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), track


def test_several_communicators(tmp_path, capsys):
    """A directory with two communicators' dumps: each is analyzed apart (the command prints one
    report, or one JSON line, per communicator); analyze() refuses a mix."""
    for doc in hang_docs() + [dump_doc(r, 2, collectives(range(1, 4)), comm_id="other") for r in range(2)]:
        write(tmp_path, doc)
    groups = communicators(load(tmp_path))
    assert sorted(groups) == [COMM, "other"]
    assert analyze(groups["other"])["first_divergence"] is None
    with pytest.raises(ValueError, match="one communicator"):
        analyze(load(tmp_path))
    assert main(["analyze", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"communicator {COMM}: 3 ranks" in text and "communicator other: 2 ranks" in text
    assert main(["analyze", str(tmp_path), "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["comm_id"] for line in lines] == [COMM, "other"]


def test_nothing_to_read(tmp_path):
    """A directory without dumps and a path that does not exist are TraceFileErrors naming them."""
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(TraceFileError, match="no dump files"):
        load(tmp_path)
    with pytest.raises(TraceFileError, match="no such file or directory"):
        load(tmp_path / "absent")


def test_extra_keys_are_tolerated(tmp_path):
    """A later writer of version 1 may add keys, at the top and in entries."""
    doc = hang_docs()[0]
    doc["gpu"] = "H100"
    doc["entries"][0]["stream"] = 7
    doc["entries"][0]["bytes"]["rdma"] = 5
    write(tmp_path, doc)
    (dump,) = load(tmp_path)
    assert dump.entries[0].total_bytes == 4096 + 5


def _truncated(path, doc):
    text = json.dumps(doc)
    path.write_text(text[: len(text) // 2])


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def mutate(path, doc):
        target = doc
        for key in keys[:-1]:
            target = target[key]
        if value is KeyError:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
        path.write_text(json.dumps(doc))
    return mutate


BAD_FILES = [
    ("truncated", _truncated, "truncated JSON"),
    ("garbage", lambda path, doc: path.write_bytes(b"\x00\xff\xfe garbage"), "invalid JSON"),
    ("not json", lambda path, doc: path.write_text("rank 0 was here"), "invalid JSON"),
    ("empty", lambda path, doc: path.write_text(""), "empty file"),
    ("array", lambda path, doc: path.write_text("[1, 2]"), "top level is an array"),
    ("other format", _set("format", "chrome-trace"), '"format" is "chrome-trace"'),
    ("other version", _set("version", 2), "version 2 is not supported"),
    ("no version", _set("version", KeyError), "version is missing"),
    ("missing key", _set("entries", 0, "state", KeyError), "entries[0].state is missing"),
    ("count a string", _set("entries", 1, "count", "1024"),
     'entries[1].count should be an integer >= 0, got "1024"'),
    ("rank a boolean", _set("rank", True), "rank should be an integer >= 0, got true"),
    ("bad state", _set("entries", 0, "state", "done"), "entries[0].state should be one of"),
    ("entries not a list", _set("entries", {}), "entries should be a list"),
    ("hosts too short", _set("hosts", [0]), "hosts has 1 entries, expected one per rank (3)"),
    ("rank out of range", _set("rank", 3), "rank 3 is not below world_size 3"),
    ("duplicate seq", _set("entries", 1, "seq", 1), "two entries have seq 1"),
    ("completed without time", _set("entries", 0, "completed_us", None), "completed_us is null"),
]


@pytest.mark.parametrize("mutate,expected", [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_bad_file_names_file_and_problem(tmp_path, mutate, expected):
    """Each kind of bad file raises TraceFileError (a ValueError) naming the file and the problem."""
    path = tmp_path / f"braid-trace-{COMM}-rank0.json"
    mutate(path, copy.deepcopy(hang_docs()[0]))
    with pytest.raises(TraceFileError) as caught:
        load(tmp_path)
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(str(path) + ": ")
    assert expected in str(caught.value)


@pytest.mark.parametrize("ascii_only", [True, False], ids=["escaped", "utf8"])
def test_truncation_anywhere_is_said(ascii_only):
    """A dump cut at any byte (the writer died mid-file) is called truncated, not invalid: cuts inside
    numbers, null, strings, a non-ASCII character's escape or its UTF-8 bytes included."""
    doc = dump_doc(0, 1, [entry(1, 1, issued=T0, wire_ratio=0.125, stack="caf\u00e9 -1.5e-3")])
    text = json.dumps(doc, ensure_ascii=ascii_only).encode()
    for cut in range(1, len(text)):
        with pytest.raises(TraceFileError, match="truncated JSON"):
            parse(text[:cut], "dump.json")
    assert parse(text, "dump.json").entries[0].stack == "caf\u00e9 -1.5e-3"


def test_stray_byte_in_a_string_is_tolerated():
    """Bytes that are not UTF-8 inside a stack (a C++ message cut mid-character) cost that character,
    not the dump."""
    doc = dump_doc(0, 1, [entry(1, 1, issued=T0, stack="STACK")])
    raw = json.dumps(doc).encode().replace(b"STACK", b"at \xe2\x82 here")
    assert parse(raw, "dump.json").entries[0].stack == "at \ufffd here"


def test_missing_rank_with_a_queued_collective(tmp_path):
    """A writer numbers a collective when it starts: a rank whose seq 3 is queued behind a stuck call
    is missing from seq 3, and the report says it has a collective queued."""
    r0 = collectives(range(1, 4))
    r1 = collectives(range(1, 3)) + [
        entry(3, None, "recv", issued=T0 + 2500, state="started", peer=0, op=None),
        entry(4, None, issued=T0 + 3000, state="issued")]
    result = analyze_docs(tmp_path, [dump_doc(0, 2, r0), dump_doc(1, 2, r1)])
    (missing,) = result["first_divergence"]["missing"]
    assert (missing["rank"], missing["last_seq"], missing["queued_collectives"]) == (1, 2, 1)
    assert missing["last_call"]["state"] == "issued"
    text = render(result)
    assert "is still\n      queued (issued, not started)" in text
    assert "(1 collective(s) issued but queued, not started" in text


def test_layout_disagreement_and_duplicate_rank(tmp_path):
    """Two dumps of one communicator with different world sizes, or of the same rank, are refused."""
    docs = hang_docs()
    docs[2]["world_size"], docs[2]["hosts"] = 4, [0, 0, 0, 0]
    for doc in docs:
        write(tmp_path, doc)
    with pytest.raises(TraceFileError, match="world_size 4 .* world_size 3"):
        load(tmp_path)
    write(tmp_path, hang_docs()[2])
    write(tmp_path, hang_docs()[2], name=f"braid-trace-{COMM}-rank2-copy.json")
    with pytest.raises(TraceFileError, match="a second dump of rank 2"):
        load(tmp_path)


ODD_VALUES = [None, True, -1, 0, 2**70, 1.5, float("nan"), "", "x", [], {}, [1, "a"], {"a": 1}, 10**16]
# Values of the right type that make odd dumps: the analyzer must cope with what validation passes.
PLAUSIBLE = {int: [0, 1, 2, 3, 7, 8, 9, T0, T0 + 10**9, 2**62], str: ["", "x", "all_reduce", "broadcast",
             "all_to_all_v", "send", "issued", "started", "completed", "failed", "float64", COMM]}


def _damage(doc, rng):
    """Replaces (by a value of another type or an odd one of the same type) or drops one to three
    keys of the dump or of its entries."""
    for _ in range(rng.randint(1, 3)):
        entries = doc.get("entries")
        entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
        target = doc if rng.random() < 0.3 or not entries else rng.choice(entries)
        if not target:
            continue
        key = rng.choice(sorted(target))
        roll = rng.random()
        if roll < 0.1:
            del target[key]
        elif roll < 0.6 and type(target[key]) in PLAUSIBLE:
            target[key] = rng.choice(PLAUSIBLE[type(target[key])])
        else:
            target[key] = rng.choice(ODD_VALUES)


def test_fuzzed_files_never_crash(tmp_path):
    """Random damage to valid dumps (values replaced by other types, keys dropped, bytes cut):
    either a TraceFileError or a dump the analyzer, the report and the export all handle."""
    rng = random.Random(20251126)
    outcomes = {"refused": 0, "analyzed": 0}
    for trial in range(300):
        docs = copy.deepcopy(hang_docs())
        _damage(rng.choice(docs), rng)
        folder = tmp_path / str(trial)
        folder.mkdir()
        for i, doc in enumerate(docs):
            write(folder, doc, name=f"braid-trace-fuzz-rank{i}.json")
        if rng.random() < 0.2:
            victim = folder / f"braid-trace-fuzz-rank{rng.randrange(len(docs))}.json"
            victim.write_bytes(victim.read_bytes()[: rng.randint(0, 400)])
        try:
            dumps = load(folder)
        except TraceFileError:
            outcomes["refused"] += 1
            continue
        for group in communicators(dumps).values():
            render(json.loads(json.dumps(analyze(group))))
        json.dumps(to_chrome(dumps))
        outcomes["analyzed"] += 1
    # Both paths must have been taken for the test to mean something.
    assert outcomes["refused"] > 20 and outcomes["analyzed"] > 20, outcomes


def test_cli_json_and_comm_prefix(tmp_path, capsys):
    """--json prints one object with the documented keys; --comm takes a unique prefix."""
    for doc in hang_docs():
        write(tmp_path, doc)
    assert main(["analyze", str(tmp_path), "--json", "--comm", COMM[:4]]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"ranks", "world_size", "missing_dumps", "first_divergence", "slowest", "stats"}
    assert set(result["first_divergence"]) >= {"seq", "kind", "issued_by", "missing_ranks", "mismatch"}
    assert (result["ranks"], result["first_divergence"]["missing_ranks"]) == ([0, 1, 2], [1])
    with pytest.raises(SystemExit) as exited:
        main(["analyze", str(tmp_path), "--comm", "nope"])
    assert exited.value.code == 2
    assert "no communicators match --comm nope" in capsys.readouterr().err


def _run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "braid.trace", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})


def test_cli_from_repo_root_analyze_and_export(tmp_path):
    """From the repository root, whose trace/ folder shadows the standard library's trace module:
    the command runs, prints the divergence in words and writes a Chrome trace that loads."""
    for doc in hang_docs():
        write(tmp_path, doc)
    done = _run_cli("analyze", str(tmp_path), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "First divergence: all_reduce seq 8" in done.stdout
    out = tmp_path / "out" / "trace.json"
    out.parent.mkdir()
    done = _run_cli("export", str(tmp_path), "--chrome", str(out), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: 23 calls of 3 ranks" in done.stdout
    assert sum(e["ph"] == "X" for e in json.loads(out.read_text())["traceEvents"]) == 23


def test_cli_bad_file_named_and_the_others_analyzed(tmp_path):
    """A truncated dump among three: exit status 2, one line on stderr naming the file and why, no
    traceback, and the other two dumps still analyzed, the bad one's rank said to have left an
    unreadable dump rather than none."""
    for doc in hang_docs():
        write(tmp_path, doc)
    bad = tmp_path / f"braid-trace-{COMM}-rank1.json"
    bad.write_text(bad.read_text()[:100])
    done = _run_cli("analyze", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"python -m braid.trace: error: {bad}: not a braid-trace dump: "
                                  "truncated JSON")
    assert f"communicator {COMM}: 3 ranks on 1 host, dumps from ranks 0, 2" in done.stdout
    assert (f"rank 1 (host 0) left a dump that cannot be read, left out: {bad}: not a braid-trace dump: "
            "truncated JSON") in done.stdout
    assert "left no dump" not in done.stdout
    assert "Unfinished: all_reduce seq 8: rank 2 still waiting" in done.stdout


def test_corrupt_dump_costs_only_itself(tmp_path, capsys):
    """load() with ``bad``: unreadable files are collected there, each with its TraceFileError, and
    the rest returned; the command analyzes every communicator it can read (one JSON line each),
    names each bad file, says a dump was bad by its exit status, and exports the rest too."""
    for doc in hang_docs() + [dump_doc(r, 2, collectives(range(1, 4)), comm_id="other") for r in range(2)]:
        write(tmp_path, doc)
    broken = tmp_path / "braid-trace-other-rank1.json"
    broken.write_text("rank 1 was here")
    stray = tmp_path / "braid-trace-stray.json"
    stray.write_text("")
    with pytest.raises(TraceFileError, match="invalid JSON"):
        load(tmp_path)
    bad = {}
    dumps = load(tmp_path, bad)
    assert sorted(bad) == [str(broken), str(stray)]
    assert "invalid JSON" in str(bad[str(broken)]) and "empty file" in str(bad[str(stray)])
    assert [(d.comm_id, d.rank) for d in dumps] == [(COMM, 0), (COMM, 1), (COMM, 2), ("other", 0)]

    assert main(["analyze", str(tmp_path), "--json"]) == 2
    out, err = capsys.readouterr()
    results = {r["comm_id"]: r for r in map(json.loads, out.splitlines())}
    assert results[COMM]["unreadable_dumps"] == {} and results[COMM]["first_divergence"]["seq"] == 8
    assert results["other"]["ranks"] == [0] and results["other"]["missing_dumps"] == [1]
    assert list(results["other"]["unreadable_dumps"]) == ["1"]
    assert results["other"]["unreadable_dumps"]["1"].startswith(f"{broken}: not a braid-trace dump")
    assert err.splitlines() == [f"python -m braid.trace: error: {bad[str(broken)]}",
                                f"python -m braid.trace: error: {bad[str(stray)]}"]

    chrome = tmp_path / "out.json"
    assert main(["export", str(tmp_path), "--chrome", str(chrome)]) == 2
    assert "calls of 4 ranks" in capsys.readouterr().out
    assert len({e["pid"] for e in json.loads(chrome.read_text())["traceEvents"]}) == 4  # a process per rank

    for path in tmp_path.glob("braid-trace-*.json"):
        if path not in (broken, stray):
            path.unlink()
    assert main(["analyze", str(tmp_path)]) == 2  # nothing readable: only the errors
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 2
