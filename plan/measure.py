"""Links measured among the ranks a command runs on (``python -m braid.plan --measure``).

Every rank takes part. The ranks are grouped by host (braid's host identity: same machine boot and
/dev/shm, or ``BRAID_HOST_ID``), then two rounds time simultaneous exchanges, each at several sizes:

- *in a host*: local ranks 2k and 2k+1 of every host swap a buffer (``send_recv``), all pairs at
  once;
- *between hosts*: the rank of local index i on host h swaps with the rank of local index i on
  host h xor 1, all pairs at once.

Every pair exchanging at once is the planner's definition of a link's bandwidth: the rate one
device sends at in one direction while every other device does the same (plan/cluster.py). Each
size's time is the median of the repeats on each rank, then the slowest rank's (a layout waits for
its slowest pair). Latency and bandwidth are fitted as Adaptive compression fits the links it
times (``fit_link``): a least-squares intercept, held within [0, the fastest time], then the bytes
over the time left. A level no pair crosses (one
rank per host, or one host) is not measured: the planner keeps the value given for it, or the
preset's.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 23)  # 4 KiB to 8 MiB per exchange
REPEATS = 5
WARMUP = 2


@dataclass(frozen=True)
class MeasuredLinks:
    """What :func:`measure_links` found: the cluster's shape from the ranks, and each level's link
    (None where no pair crossed that level). ``samples``: per level, (bytes, seconds) per size."""

    hosts: int
    devices_per_host: int
    intra_bandwidth: Optional[float] = None
    intra_latency: Optional[float] = None
    inter_bandwidth: Optional[float] = None
    inter_latency: Optional[float] = None
    samples: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)

    def cluster_fields(self) -> Dict[str, Any]:
        """The fields of a :class:`~braid.plan.cluster.Cluster` this measurement gives."""
        out: Dict[str, Any] = {"hosts": self.hosts, "devices_per_host": self.devices_per_host}
        for name in ("intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def describe(self) -> str:
        """One line per measured level: bandwidth, latency and the sizes timed."""

        def level(name: str, bw: Optional[float], lat: Optional[float]) -> str:
            if bw is None:
                return f"{name}: not measured (no pair of ranks crosses it)"
            sizes = ", ".join(f"{b >> 10} KiB {t * 1e6:.0f} us" for b, t in self.samples.get(name, []))
            return f"{name}: {bw / 1e9:.3g} GB/s, {lat * 1e6:.1f} us per message ({sizes})"

        return "\n".join([
            f"measured on {self.hosts} host{'s' if self.hosts > 1 else ''} x {self.devices_per_host} ranks",
            level("in a host", self.intra_bandwidth, self.intra_latency),
            level("between hosts", self.inter_bandwidth, self.inter_latency),
        ])


def fit(samples: Sequence[Tuple[int, float]]) -> Tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``samples`` ((bytes, seconds) per size), fitted as
    Adaptive compression fits the links it times (``fit_link``: a least-squares intercept held
    within [0, the fastest time], then the bytes over the time left)."""
    from braid.comm.compression.adaptive.model import IN_HOST, fit_link

    latency, bandwidth = fit_link([(b, 0, 1, t) for b, t in samples])
    return latency, bandwidth[IN_HOST]


def _host_key(identity: str) -> int:
    """A host identity as an int64 (for an all-gather of one number per rank)."""
    return int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "little", signed=True)


def _pairs(hosts: List[int]) -> Tuple[Dict[int, int], Dict[int, int]]:
    """({rank: partner in its host}, {rank: partner on the paired host}) for ranks in host order."""
    members: Dict[int, List[int]] = {}
    for r, h in enumerate(hosts):
        members.setdefault(h, []).append(r)
    intra: Dict[int, int] = {}
    for ranks in members.values():
        for i in range(0, len(ranks) - 1, 2):
            intra[ranks[i]], intra[ranks[i + 1]] = ranks[i + 1], ranks[i]
    inter: Dict[int, int] = {}
    for h, ranks in members.items():
        other = members.get(h ^ 1)
        if other is None:
            continue
        for i, r in enumerate(ranks):
            if i < len(other):
                inter[r] = other[i]
    return intra, inter


def _default_device() -> torch.device:
    """CUDA where the ranks have a GPU (the current one), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(run: Callable[[Any], Any], repeats: int, device: torch.device,
                    setup: Callable[[], Any]) -> float:
    """The median seconds of ``run(setup())`` over ``repeats`` runs after ``WARMUP`` untimed ones,
    ``setup`` untimed before each, the device's queue drained at the end of each."""
    times = []
    for i in range(WARMUP + repeats):
        arg = setup()
        began = time.perf_counter()
        run(arg)
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _time_level(g: Any, partner: Optional[int], sizes: Sequence[int], repeats: int,
                device: torch.device) -> List[Tuple[int, float]]:
    """Each size's time: median of this rank's repeats, then the slowest rank's (a collective: every
    rank calls it, with or without a partner)."""
    out = []
    for size in sizes:
        send = torch.ones(size // 4, dtype=torch.float32, device=device)
        recv = torch.empty_like(send)

        def exchange(_: Any, send: torch.Tensor = send, recv: torch.Tensor = recv) -> None:
            if partner is not None:
                g.send_recv(send, partner, recv, partner).wait()

        # every rank takes part in the barriers, a rank without a partner times nothing
        timed = _median_seconds(exchange, repeats, device, g.barrier)
        mine = timed if partner is not None else 0.0
        slowest = torch.tensor([mine], dtype=torch.float64, device=device)
        g.all_reduce(slowest, op="max")
        out.append((size, float(slowest[0])))
    return out


def measure_links(group: Any = None, *, sizes: Sequence[int] = SIZES, repeats: int = REPEATS,
                  device: Optional[torch.device] = None) -> MeasuredLinks:
    """Measures the links among the ranks of ``group`` (a braid Communicator, a ProcessGroup, or
    None: the default group; every rank calls it) as this module's docstring describes; tensors on
    ``device`` (default: CUDA where the group's ranks have a GPU, else the CPU). Raises ValueError
    when hosts hold different numbers of ranks (the planner's clusters are uniform)."""
    from braid.comm.core.group import as_group
    from braid.comm.core.hosts import host_identity, host_numbers

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    sizes = sorted(set(int(s) for s in sizes))
    if len(sizes) < 2 or sizes[0] < 4:
        raise ValueError(f"sizes must hold two sizes or more, each at least 4 bytes, got {sizes}")
    g = as_group(group, "group", "measure_links")
    device = device or _default_device()
    n = g.world_size
    mine = torch.tensor([_host_key(host_identity())], dtype=torch.int64, device=device)
    every = torch.empty(n, dtype=torch.int64, device=device)
    g.all_gather(every, mine)
    hosts = host_numbers([str(k) for k in every.tolist()])
    counts = [hosts.count(h) for h in range(max(hosts) + 1)]
    if len(set(counts)) != 1:
        raise ValueError(f"measure_links: the hosts hold different numbers of ranks ({counts}); the "
                         "planner's cluster has the same number of devices on every host")
    intra, inter = _pairs(hosts)
    fields: Dict[str, Any] = {"hosts": len(counts), "devices_per_host": counts[0], "samples": {}}
    for name, pairs, prefix in (("in a host", intra, "intra"), ("between hosts", inter, "inter")):
        if not pairs:
            continue
        samples = _time_level(g, pairs.get(g.rank), sizes, repeats, device)
        latency, bandwidth = fit(samples)
        fields[f"{prefix}_latency"], fields[f"{prefix}_bandwidth"] = latency, bandwidth
        fields["samples"][name] = samples
    return MeasuredLinks(**fields)


def measure_overlap(group: Any, compute: Callable[[Any], Any], nbytes: int, *,
                    prepare: Optional[Callable[[], Any]] = None, bucket_bytes: int = 4 << 20,
                    repeats: int = REPEATS, device: Optional[torch.device] = None) -> Dict[str, float]:
    """How much of ``compute`` a gradient exchange hides behind here: the planner's ``overlap``
    (``Assumptions.overlap``), measured. Every rank of ``group`` calls it.

    Three timings, each the median of ``repeats`` on every rank, then the slowest rank's (after
    warm-up; ``prepare()``, when given, runs untimed before each and its result is ``compute``'s
    argument, e.g. the forward whose backward is timed): ``compute`` alone; all-reduces of
    ``nbytes`` in buckets of ``bucket_bytes`` alone (queued at once, as DDP queues its buckets);
    and both, the all-reduces queued just before ``compute`` and waited after it. The hidden time
    is alone + alone - both; the planner charges a collective ``max(0, comm - overlap x
    compute)``, so ``overlap`` = hidden / compute, held within [0, 1]. Where the exchange hid
    (nearly) whole, the figure is a lower bound (``"bound": 1``): size ``nbytes`` to the largest
    exchange the layouts make (the whole gradient). Returns ``overlap``, ``compute_s``,
    ``comm_s``, ``both_s`` and ``bound``."""
    from braid.comm.core.group import as_group

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"nbytes must be an int of at least 4, got {nbytes!r}")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 4:
        raise ValueError(f"bucket_bytes must be an int of at least 4, got {bucket_bytes!r}")
    g = as_group(group, "group", "measure_overlap")
    device = device or _default_device()
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    buckets = list(buf.split(max(1, bucket_bytes // 4)))

    def exchange() -> list:
        return [g.all_reduce(b, async_op=True) for b in buckets]

    def timed(run: Callable[[Any], None]) -> float:
        def setup() -> Any:
            arg = prepare() if prepare is not None else None
            _sync(device)
            g.barrier()
            return arg

        mine = _median_seconds(run, repeats, device, setup)
        slowest = torch.tensor([mine], dtype=torch.float64, device=device)
        g.all_reduce(slowest, op="max")
        return float(slowest[0])

    def comm_alone(_: Any) -> None:
        for w in exchange():
            w.wait()

    def both(arg: Any) -> None:
        works = exchange()
        compute(arg)
        for w in works:
            w.wait()

    return overlap_of(timed(compute), timed(comm_alone), timed(both))


def overlap_of(compute_s: float, comm_s: float, both_s: float) -> Dict[str, float]:
    """:func:`measure_overlap`'s figure from its three times: hidden = compute + comm - both,
    overlap = hidden / compute within [0, 1]; ``bound`` 1 where the exchange hid (nearly) whole."""
    hidden = compute_s + comm_s - both_s
    overlap = min(1.0, max(0.0, hidden / compute_s)) if compute_s > 0 else 0.0
    return {"overlap": overlap, "compute_s": compute_s, "comm_s": comm_s, "both_s": both_s,
            "bound": float(hidden >= 0.95 * comm_s)}


OVERLAP_BYTES = 1 << 24  # the exchange --measure hides behind matrix products (16 MiB)


def measure_matmul_overlap(group: Any = None, nbytes: int = OVERLAP_BYTES, *, repeats: int = REPEATS,
                           device: Optional[torch.device] = None) -> Dict[str, float]:
    """:func:`measure_overlap` with matrix products standing in for a backward (what
    ``python -m braid.plan --measure`` times, knowing no model): square products (bfloat16 of
    4096 on a GPU, float32 of 256 on the CPU), as many as last about as long as the exchange of
    ``nbytes`` alone (the most rank's count), so that the figure is neither capped by a short
    exchange nor by a short compute. Every rank of ``group`` calls it; returns
    :func:`measure_overlap`'s dict with ``products``, the count."""
    from braid.comm.core.group import as_group

    g = as_group(group, "group", "measure_matmul_overlap")
    device = device or _default_device()
    size, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    a = torch.randn(size, size, dtype=dtype, device=device)

    def synced() -> None:  # nothing of the last run still queued
        _sync(device)

    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    one = _median_seconds(lambda _: a @ a, repeats, device, synced)
    g.barrier()
    exchange = _median_seconds(lambda _: g.all_reduce(buf), repeats, device, synced)
    count = torch.tensor([max(1, round(exchange / max(one, 1e-9)))], dtype=torch.float64, device=device)
    g.all_reduce(count, op="max")
    products = int(min(count[0], 100_000))

    def compute(_: Any) -> None:
        for _ in range(products):
            a @ a

    out = measure_overlap(g, compute, nbytes, repeats=repeats, device=device)
    out["products"] = float(products)
    return out
