"""The analyzer's result in words: what ``python -m braid.trace analyze`` prints."""
from __future__ import annotations

from typing import Optional

# Ranks described one by one (missing ranks, rows of the slowest-ranks table); --json has them all.
RANKS_SHOWN = 8


def render(result: dict) -> str:
    """The text report of one communicator's analysis (``analysis.analyze``'s result)."""
    lines: list = []
    _header(result, lines)
    divergence, stuck = result["first_divergence"], result["stuck"]
    if divergence is not None:
        _divergence(divergence, lines)
    elif len(result["ranks"]) == 1:
        lines.append(f"Only rank {result['ranks'][0]} dumped: no comparison between ranks.")
    elif result["window"]["last_seq"] is None:
        lines.append("No collective recorded: nothing to compare.")
    else:
        lines.append(f"No divergence: the ranks agree on every collective they recorded "
                     f"(up to seq {result['window']['last_seq']}).")
    # The stuck collective adds to a divergence only where it is another one.
    if stuck is not None and (divergence is None or stuck["seq"] != divergence["seq"]):
        _stuck(stuck, lines)
    _window(result, lines)
    _slowest(result, lines)
    _stats(result, lines)
    return "\n".join(lines) + "\n"


def duration(us: float) -> str:
    """A duration for people: 850 us, 1.25 ms, 3.4 s."""
    if abs(us) < 1e3:
        return f"{us:.0f} us"
    if abs(us) < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.1f} s"


def _ranks(ranks: list) -> str:
    """rank 3; ranks 0-2, 5 (runs of consecutive ranks as ranges, for 64-rank jobs)."""
    runs: list = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _grouped(by_rank: dict) -> list:
    """[(value, [ranks])] from {rank: value} (ranks as strings, as in the analysis), by first rank:
    64 ranks that agree make one line."""
    groups: dict = {}
    for rank, value in sorted(by_rank.items(), key=lambda item: int(item[0])):
        groups.setdefault(value, []).append(int(rank))
    return list(groups.items())


def _call_name(call: dict) -> str:
    """all_reduce seq 7 (call #9), send to 3 (call #12)."""
    where = f" seq {call['seq']}" if call["seq"] is not None else ""
    if call["peer"] is not None:
        where += f" {'to' if call['kind'] == 'send' else 'from'} rank {call['peer']}"
    return f"{call['kind']}{where} (call #{call['id']})"


def _doing(call: Optional[dict]) -> str:
    """What a rank was doing when it dumped, from its last call."""
    if call is None:
        return "it recorded no call at all"
    name = _call_name(call)
    if call["state"] == "completed":
        return (f"its last call, {name}, completed {duration(call['finished_before_dump_s'] * 1e6)} before "
                f"its dump:\n      it is busy outside braid (computing, loading data, or on a code path "
                f"without this collective)")
    if call["state"] == "failed":
        return (f"its last call, {name}, failed {duration(call['finished_before_dump_s'] * 1e6)} before its "
                f"dump:\n      {call['error'] or 'no error message'}")
    state = "queued (issued, not started)" if call["state"] == "issued" else "in progress (started, not done)"
    return (f"its last call, {name}, issued {duration(call['issued_before_dump_s'] * 1e6)} before its dump, "
            f"is still\n      {state}: it is waiting inside braid")


def _stack(call: Optional[dict], lines: list, indent: str) -> None:
    if call is not None and call["stack"]:
        lines.append(f"{indent}stack of that call:")
        lines.extend(f"{indent}  {line}" for line in call["stack"].rstrip("\n").split("\n"))


def _header(result: dict, lines: list) -> None:
    hosts = result["hosts"]
    lines.append(f"communicator {result['comm_id']}: {result['world_size']} ranks on {len(set(hosts))} "
                 f"host{'s' if len(set(hosts)) != 1 else ''}, dumps from {_ranks(result['ranks'])}")
    by_reason: dict = {}
    for d in result["dumps"]:
        by_reason.setdefault(d["reason"] or "no reason given", []).append(d["rank"])
    for reason, ranks in by_reason.items():
        lines.append(f"  {_ranks(ranks)} dumped for: {reason}")
    # A dump that exists but cannot be read says nothing of its rank's state, only why.
    unreadable = result["unreadable_dumps"]
    for rank, why in sorted(unreadable.items(), key=lambda item: int(item[0])):
        lines.append(f"  rank {rank} (host {hosts[int(rank)]}) left a dump that cannot be read, left out: "
                     f"{why}")
    # By host: a host whose ranks all left no dump may be down as a whole.
    for host in sorted(set(hosts)):
        missing = [r for r in result["missing_dumps"] if hosts[r] == host and str(r) not in unreadable]
        if not missing:
            continue
        they = "it" if len(missing) == 1 else "they"
        whole_host = len(missing) == hosts.count(host) > 1
        whole = "; all of this host's ranks: the host may be down" if whole_host else ""
        lines.append(f"  {_ranks(missing)} (host {host}) left no dump: {they} may have died (killed, out of "
                     f"memory, crashed) before dumping, or dumped elsewhere{whole}")
    lines.append("")


def _divergence(div: dict, lines: list) -> None:
    mismatch = div["mismatch"]
    what = f": {mismatch['field']} differs" if mismatch else ""
    lines.append(f"First divergence: {div['kind']} seq {div['seq']}{what}")
    never = f"; not by {_ranks(div['missing_ranks'])}" if div["missing_ranks"] else ""
    lines.append(f"  issued by {_ranks(div['issued_by'])}{never}")
    for m in div["missing"][:RANKS_SHOWN]:
        stopped = f"stopped at seq {m['last_seq']}" if m["last_seq"] is not None else "started no collective"
        lines.append(f"  rank {m['rank']} {stopped}: {_doing(m['last_call'])}")
        if m["queued_collectives"]:
            lines.append(f"    ({m['queued_collectives']} collective(s) issued but queued, not started: "
                         f"a collective gets its seq when it starts)")
        _stack(m["last_call"], lines, "    ")
    if len(div["missing"]) > RANKS_SHOWN:
        lines.append(f"  ({len(div['missing']) - RANKS_SHOWN} more ranks never issued it: --json says what "
                     f"each is doing)")
    if mismatch:
        for value, ranks in _grouped(mismatch["values"]):
            lines.append(f"  {mismatch['field']} = {value} on {_ranks(ranks)}")
        if mismatch["also_differ"]:
            lines.append(f"  ({', '.join(mismatch['also_differ'])} also differ)")
    if div["evicted_ranks"]:
        lines.append(f"  ({_ranks(div['evicted_ranks'])} no longer hold seq {div['seq']}: "
                     f"evicted from the buffer)")
    states = "; ".join(f"{state} on {_ranks(ranks)}" for state, ranks in _grouped(div["states"]))
    lines.append(f"  state at seq {div['seq']}: {states}")
    _errors(div["errors"], lines)
    lines.append("")


def _errors(errors: dict, lines: list) -> None:
    for error, ranks in _grouped(errors):
        lines.append(f"  error on {_ranks(ranks)}: {error}")


def _stuck(stuck: dict, lines: list) -> None:
    parts = []
    if stuck["waiting"]:
        longest = max(stuck["waiting_s"].values())
        parts.append(f"{_ranks(stuck['waiting'])} still waiting (up to {duration(longest * 1e6)} "
                     f"at the dumps)")
    if stuck["failed"]:
        parts.append(f"failed on {_ranks(stuck['failed'])}")
    if stuck["completed_by"]:
        parts.append(f"completed by {_ranks(stuck['completed_by'])}")
    lines.append(f"Unfinished: {stuck['kind']} seq {stuck['seq']}: " + "; ".join(parts))
    _errors(stuck["errors"], lines)
    lines.append("")


def _window(result: dict, lines: list) -> None:
    window = result["window"]
    if not window["limited_by_eviction"]:
        return
    for start, ranks in _grouped(window["evicted_before"]):
        if start is None:
            lines.append(f"The buffers of {_ranks(ranks)} hold no collective (point-to-point calls filled "
                         f"them): left out of the comparison.")
        else:
            lines.append(f"The buffers of {_ranks(ranks)} no longer hold seqs below {start} (evicted).")
    if window["first_seq"] is not None and len(result["ranks"]) > 1:
        lines.append(f"Every rank is compared from seq {window['first_seq']} on; earlier seqs only among the "
                     f"ranks that still hold them.")
    lines.append("")


def _slowest(result: dict, lines: list) -> None:
    window = result["slowest_window"]
    if window is None:
        return
    lines.append(f"Slowest to arrive: the last {window['collectives']} collectives every rank recorded "
                 f"(seqs {window['first_seq']}..{window['last_seq']}), lateness after the first rank's issue")
    lines.append(f"  {'rank':>6}  {'last at':>9}  {'mean late':>10}  {'max late':>10}")
    rows = result["slowest"]
    for row in rows[:RANKS_SHOWN]:
        last = f"{row['times_last']}/{window['collectives']}"
        lines.append(f"  {row['rank']:>6}  {last:>9}  {duration(row['mean_lateness_us']):>10}  "
                     f"{duration(row['max_lateness_us']):>10}")
    if len(rows) > RANKS_SHOWN:
        lines.append(f"  ({len(rows) - RANKS_SHOWN} more ranks, less often last: --json lists them)")
    if result["slowest_rank"] is not None:
        lines.append(f"  slowest: rank {result['slowest_rank']}")
    else:
        lines.append("  no rank was last: every rank issued each of them at the same microsecond")
    if window["across_hosts"]:
        lines.append("  (the ranks span hosts: lateness between hosts includes their clocks' offset)")
    lines.append("")


def _stats(result: dict, lines: list) -> None:
    if not result["stats"]:
        return
    lines.append("Calls of every dumped rank, by kind and algorithm (time: completed calls)")
    lines.append(f"  {'kind':<15} {'algorithm':<13} {'calls':>6} {'failed':>6} {'bytes sent':>12} "
                 f"{'mean time':>10} {'max time':>10} {'algbw GB/s':>10} {'busbw GB/s':>10}")
    for row in result["stats"]:
        t = row["time_us"]
        mean, longest = (duration(t["mean"]), duration(t["max"])) if t else ("-", "-")
        lines.append(
            f"  {row['kind']:<15} {row['algorithm'] or '-':<13} {row['calls']:>6} {row['failed']:>6} "
            f"{row['bytes']:>12} {mean:>10} {longest:>10} "
            f"{_gbps(row['algbw_gbps']):>10} {_gbps(row['busbw_gbps']):>10}")


def _gbps(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"
