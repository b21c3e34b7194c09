"""A latency-bandwidth (alpha-beta) model of braid's all_reduce algorithms between hosts, fitted to
what ``python -m braid.bench multihost --hosts ...`` measured, to explain the algorithm table at
scales this machine cannot run (16 to 1,024 hosts, 1 to 100 Gbit).

Each algorithm's time for S bytes among H hosts (one leader per host): ``alpha`` per message
latency on its critical path, ``gamma`` per message a leader sends (each costs the sender and
the receiver their handling, concurrent or not), and the bytes a leader's uplink carries over the
link rate:

- one-shot: every leader sends its S bytes to the H - 1 others at once: alpha + (H - 1) S / rate;
- recursive doubling: log2 p exchanges of S bytes (p the largest power of two <= H), two more when
  H is not a power of two (the extras fold in and get the result back), each alpha + S / rate;
- ring: 2 (H - 1) steps of S / H bytes: 2 (H - 1) (alpha + S / (H rate));
- leaders' direct exchange: two phases of H - 1 messages of S / H bytes each way from every
  leader at once: 2 (alpha + (H - 1) S / (H rate)), the same bytes as the ring in two latencies;

each plus gamma times its messages per leader (one-shot H - 1, doubling its rounds, ring and
direct 2 (H - 1)).

``fit`` finds alpha and gamma (relative least squares over the measurements, the rate known) and
a contention factor per algorithm that sends to several peers at once (the ratio of measured to
modelled time of its large messages, capturing what the alpha-beta model leaves out: many flows sharing one
uplink lose to one flow per direction). The fitted model is printed beside the measurements and
extrapolated; it is a model, its predictions are not measurements.

``scored_report`` tests that extrapolation where it can be checked: fitted on the measurements of
some link settings, the model is scored on those of the others (its relative error, and whether it
names the measured fastest algorithm), since a model scored on the points it was fitted to says
little about a link it never saw.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

ALGORITHMS = ("oneshot", "doubling", "ring", "leaders")
# Algorithms whose leaders talk to several peers at once.
CONCURRENT = ("oneshot", "leaders")


def rounds(algorithm: str, hosts: int) -> int:
    """Message latencies on the critical path of one all_reduce among ``hosts`` leaders."""
    if hosts < 2:
        return 0
    if algorithm == "oneshot":
        return 1
    if algorithm == "doubling":
        p = 1 << (hosts.bit_length() - 1)
        return int(math.log2(p)) + (2 if p != hosts else 0)
    if algorithm == "ring":
        return 2 * (hosts - 1)
    if algorithm == "leaders":
        return 2
    raise ValueError(f"unknown algorithm {algorithm!r}")


def messages(algorithm: str, hosts: int) -> int:
    """Messages one leader sends in one all_reduce among ``hosts`` leaders."""
    if hosts < 2:
        return 0
    if algorithm == "oneshot":
        return hosts - 1
    if algorithm == "doubling":
        return rounds("doubling", hosts)
    if algorithm in ("ring", "leaders"):
        return 2 * (hosts - 1)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def uplink_bytes(algorithm: str, hosts: int, nbytes: float) -> float:
    """Bytes one leader's uplink carries on the critical path."""
    if hosts < 2:
        return 0.0
    if algorithm == "oneshot":
        return (hosts - 1) * nbytes
    if algorithm == "doubling":
        return rounds("doubling", hosts) * nbytes
    if algorithm in ("ring", "leaders"):
        return 2 * (hosts - 1) / hosts * nbytes
    raise ValueError(f"unknown algorithm {algorithm!r}")


@dataclass
class Model:
    alpha: float                  # seconds per message latency on the critical path
    gamma: float = 0.0            # seconds per message a leader sends
    contention: dict = field(default_factory=dict)  # algorithm -> factor on its bytes' time

    def time(self, algorithm: str, hosts: int, nbytes: float, rate_bytes_s: float) -> float:
        """Modelled seconds of one all_reduce."""
        wire = uplink_bytes(algorithm, hosts, nbytes) / rate_bytes_s * self.contention.get(algorithm, 1.0)
        return rounds(algorithm, hosts) * self.alpha + messages(algorithm, hosts) * self.gamma + wire

    def best(self, hosts: int, nbytes: float, rate_bytes_s: float) -> str:
        return min(ALGORITHMS, key=lambda a: self.time(a, hosts, nbytes, rate_bytes_s))


def fit(points: Sequence[tuple]) -> Model:
    """A model from measured (algorithm, hosts, bytes, rate bytes/s, seconds) points: each
    concurrent algorithm's contention factor from its largest messages (median ratio of measured
    time to the pure bandwidth term), then alpha by relative least squares on what the bytes
    leave over."""
    contention = {}
    for algo in CONCURRENT:
        big = [(h, s, r, t) for a, h, s, r, t in points if a == algo and s >= 1 << 20]
        ratios = sorted(t / (uplink_bytes(algo, h, s) / r) for h, s, r, t in big
                        if uplink_bytes(algo, h, s) > 0)
        if ratios:
            contention[algo] = max(1.0, ratios[len(ratios) // 2])
    model = Model(0.0, 0.0, contention)
    # Relative least squares (minimizing the sum of (modelled / measured - 1)^2): the small
    # messages, whose time is mostly latency, weigh as much as the large ones. Normal equations
    # of the two unknowns; a negative one is dropped and the other refitted alone.
    rows = [(rounds(a, h) / t, messages(a, h) / t, 1 - model.time(a, h, s, r) / t)
            for a, h, s, r, t in points]

    def solve(use_alpha: bool, use_gamma: bool) -> tuple:
        aa = sum(x * x for x, _, _ in rows) if use_alpha else 0.0
        gg = sum(y * y for _, y, _ in rows) if use_gamma else 0.0
        ag = sum(x * y for x, y, _ in rows) if use_alpha and use_gamma else 0.0
        ab = sum(x * z for x, _, z in rows) if use_alpha else 0.0
        gb = sum(y * z for _, y, z in rows) if use_gamma else 0.0
        det = aa * gg - ag * ag
        if use_alpha and use_gamma:
            return ((ab * gg - gb * ag) / det, (gb * aa - ab * ag) / det) if det else (0.0, 0.0)
        return (ab / aa if aa else 0.0, 0.0) if use_alpha else (0.0, gb / gg if gg else 0.0)

    alpha, gamma = solve(True, True)
    if alpha < 0 or gamma < 0:
        alpha, gamma = solve(True, False) if gamma < 0 else solve(False, True)
    model.alpha, model.gamma = max(0.0, alpha), max(0.0, gamma)
    return model


def points_of(records: Sequence[dict]) -> list:
    """(algorithm, hosts, bytes, rate bytes/s, seconds) of the records of a ``multihost --hosts``
    run whose braid all-reduce was forced to one of the modelled algorithms (the algorithm the
    record reports; braid's own choice repeats one of them and is left out, so that no measurement
    counts twice), between two hosts or more. The rate is the record's ``rate_bytes_s`` (on an
    unshaped link what one TCP stream carried between two of its hosts), else the shaped link's;
    records of an unshaped link without one are left out."""
    points = []
    for r in records:
        rate = r.get("rate_bytes_s") or r["link_mbit"] * 1e6 / 8
        if r["impl"] != "braid" and r.get("algorithm") in ALGORITHMS and r["hosts"] >= 2 and rate:
            points.append((r["algorithm"], r["hosts"], r["bytes"], rate, r["time_us"] / 1e6))
    return points


def errors(model: Model, points: Sequence[tuple]) -> list:
    """|modelled / measured - 1| of each point."""
    return [abs(model.time(a, h, s, r) / t - 1) for a, h, s, r, t in points]


def fastest_named(model: Model, points: Sequence[tuple]) -> tuple:
    """(cells, right): of the (hosts, bytes, rate) cells where two algorithms or more were measured,
    how many the model names the measured fastest of them in."""
    cells = {}
    for a, h, s, r, t in points:
        cells.setdefault((h, s, r), {})[a] = t
    cells = {k: v for k, v in cells.items() if len(v) > 1}
    right = sum(min(v, key=v.get) == min(v, key=lambda a, k=k: model.time(a, *k)) for k, v in cells.items())
    return len(cells), right


def splits(settings: Sequence[str]) -> list:
    """(fitted on, scored on) tuples of link settings: each setting alone against all the others,
    and, from three settings on, all the others against it."""
    out = []
    for one in settings:
        rest = tuple(x for x in settings if x != one)
        out.append(((one,), rest))
        if len(rest) > 1:
            out.append((rest, (one,)))
    return out


def scored_report(groups: dict) -> str:
    """The model fitted on some link settings and scored on the others: ``groups`` maps a
    setting's name (e.g. "100 Mbit") to its points (``points_of``). For each split, the fitted
    parameters, then per setting (the fitted ones first, marked "fit") the median and worst
    relative error and the cells whose fastest algorithm the model names."""
    groups = {k: v for k, v in groups.items() if v}
    if len(groups) < 2:
        return ("cost model scored on other links: not done (it needs measurements at two link settings "
                "or more: --scale-link 100,1000,0, or --from-json of such a run)")
    lines = ["Cost model fitted on some link settings, scored on the others (error: |modelled / measured "
             "- 1|; fastest: cells (hosts, size) where the model names the measured fastest algorithm):",
             f"{'fitted on':<20} {'alpha':>7} {'gamma':>7}  {'contention':<30} {'scored on':<16} "
             f"{'points':>6} {'median':>7} {'worst':>6} {'fastest':>8}"]
    for fitted_on, scored_on in splits(list(groups)):
        fitting = [p for name in fitted_on for p in groups[name]]
        if len({p[0] for p in fitting}) < 2:
            lines.append(f"{', '.join(fitted_on):<20} not fitted (fewer than two algorithms measured)")
            continue
        m = fit(fitting)
        head = (f"{', '.join(fitted_on):<20} {m.alpha * 1e6:>4.0f} us {m.gamma * 1e6:>4.0f} us  "
                + f"{', '.join(f'{a} {c:.2f}x' for a, c in m.contention.items()) or '-':<30}")
        for i, name in enumerate((*fitted_on, *scored_on)):
            errs = sorted(errors(m, groups[name]))
            cells, right = fastest_named(m, groups[name])
            label = name + (" (fit)" if name in fitted_on else "")
            lines.append(f"{head if i == 0 else ' ' * len(head)} {label:<16} {len(errs):>6} "
                         f"{errs[len(errs) // 2] * 100:>6.0f}% {errs[-1] * 100:>5.0f}% "
                         f"{f'{right} of {cells}':>8}")
    return "\n".join(lines)


def report(records: Sequence[dict], hosts=(16, 64, 256, 1024), gbits=(1, 10, 100),
           sizes=(4 << 10, 8 << 20)) -> str:
    """The fitted model: its parameters, its error on the measurements, and the algorithm it
    predicts fastest (with its time) past what was run."""
    points = points_of(records)
    if len({p[0] for p in points}) < 2:
        return ("cost model: not fitted (it needs measurements of two algorithms or more between hosts: "
                "--algos)")
    m = fit(points)
    errs = sorted(errors(m, points))
    lines = [f"Cost model (fitted to {len(points)} measurements): alpha {m.alpha * 1e6:.0f} us per latency, "
             f"gamma {m.gamma * 1e6:.0f} us per message sent; contention "
             + (", ".join(f"{a} {c:.2f}x" for a, c in m.contention.items()) or "none (no 1 MiB message)")
             + f"; error on the measurements it was fitted to: median {errs[len(errs) // 2] * 100:.0f}%, "
             f"worst {errs[-1] * 100:.0f}%",
             "Predicted fastest (model, not measured): " + f"{'hosts':>6} {'link':>8} "
             + " ".join(f"{_size(s):>22}" for s in sizes)]
    for h in hosts:
        for g in gbits:
            rate = g * 1e9 / 8
            cells = []
            for s in sizes:
                a = m.best(h, s, rate)
                cells.append(f"{a} {m.time(a, h, s, rate) * 1e3:.2f} ms".rjust(22))
            lines.append(" " * 41 + f"{h:>6} {str(g) + ' Gbit':>8} " + " ".join(cells))
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
