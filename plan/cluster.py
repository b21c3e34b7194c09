"""The machines a layout runs on: hosts of identical devices, two link levels.

Links are given (or measured among launched ranks: plan/measure.py, ``--measure``):
``intra_bandwidth`` / ``intra_latency`` between devices of one host,
``inter_bandwidth`` / ``inter_latency`` between hosts, each the rate one device sends at in one
direction while every other device does the same (one network interface share per device).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, Optional, Sequence, Tuple

GiB = 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}


def parse_bytes(value: Any, name: str = "size") -> int:
    """Bytes from an int or a string: a number with an optional unit, ``K``/``M``/``G``/``T`` (and
    ``KiB``.. ``TiB``) in powers of 1024, ``KB``/``MB``/``GB``/``TB`` in powers of 1000:
    ``"80G"`` = 80 x 2**30, ``"80GB"`` = 80 x 10**9."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string such as '80G', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a size such as '80G', '80GiB', '85.9GB' or 1024")
        number, unit = float(m.group(1)), m.group(2).lower()
    else:
        raise TypeError(f"{name} must be a number of bytes or a string such as '80G', got {value!r}")
    result = int(round(number * _UNITS[unit]))
    if result <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return result


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Cluster:
    """Hosts x devices per host, all alike.

    Args:
        hosts: machines.
        devices_per_host: accelerators per machine.
        device_memory: bytes of one device's memory (an int, or a string such as "80G").
        peak_flops: one device's peak dense FLOP/s in 16-bit (bf16) arithmetic.
        intra_bandwidth: bytes/s one device sends to another of its host (one direction).
        inter_bandwidth: bytes/s one device sends to another host (one direction, its share of
            the host's network interfaces).
        intra_latency: seconds per message inside a host (the alpha of the alpha-beta model).
        inter_latency: seconds per message between hosts.
        fp32_peak_flops: peak FLOP/s for fp32 models; default peak_flops / 2 (TF32 on A100/H100).
        name: a label for the output.
    """

    hosts: int
    devices_per_host: int
    device_memory: Any
    peak_flops: float
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 3e-6
    inter_latency: float = 10e-6
    fp32_peak_flops: Optional[float] = None
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("hosts", "devices_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value}")
        object.__setattr__(self, "device_memory", parse_bytes(self.device_memory, "device_memory"))
        for name in ("peak_flops", "intra_bandwidth", "inter_bandwidth", "intra_latency", "inter_latency"):
            object.__setattr__(self, name, _positive(getattr(self, name), name))
        if self.fp32_peak_flops is not None:
            object.__setattr__(self, "fp32_peak_flops", _positive(self.fp32_peak_flops, "fp32_peak_flops"))

    @property
    def devices(self) -> int:
        """All devices: hosts x devices_per_host."""
        return self.hosts * self.devices_per_host

    def peak_for(self, dtype: str) -> float:
        """Peak FLOP/s for a model's dtype ("bf16" or "fp32")."""
        if dtype == "fp32":
            return self.fp32_peak_flops if self.fp32_peak_flops is not None else self.peak_flops / 2
        return self.peak_flops

    def link(self, inter: bool) -> Tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the between-host link when ``inter``, else in-host."""
        if inter:
            return self.inter_bandwidth, self.inter_latency
        return self.intra_bandwidth, self.intra_latency

    def replace(self, **changes: Any) -> "Cluster":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        """The fields and the device count, JSON-ready."""
        d = dataclasses.asdict(self)
        d["devices"] = self.devices
        return d

    @classmethod
    def preset(cls, spec: str, **overrides: Any) -> "Cluster":
        """A cluster from ``"NAME:HOSTS"`` (``"h100x8:64"``: 64 hosts of 8 H100s; ``"h100x8"``: one
        host), NAME from ``CLUSTER_PRESETS``; ``overrides`` replace fields."""
        if not isinstance(spec, str):
            raise TypeError(f"cluster preset must be a string such as 'h100x8:64', got {spec!r}")
        name, _, count = spec.partition(":")
        if name not in CLUSTER_PRESETS:
            raise ValueError(
                f"unknown cluster preset {name!r} in {spec!r}; known: "
                f"{', '.join(sorted(CLUSTER_PRESETS))} (as NAME:HOSTS, e.g. h100x8:64)"
            )
        hosts = 1
        if count:
            if not count.isdigit() or int(count) <= 0:
                raise ValueError(f"cluster preset {spec!r}: the host count after ':' must be a positive int")
            hosts = int(count)
        fields = dict(CLUSTER_PRESETS[name])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        fields.setdefault("hosts", hosts)
        fields.setdefault("name", f"{name}:{fields['hosts']}")  # the hosts an override (--measure) set
        return cls(**fields)


# Nominal figures from the vendors' data sheets: bf16 dense peak; NVLink per direction (H100/H200
# NVLink 4: 900 GB/s both ways, A100 NVLink 3: 600 GB/s both ways); one 400 Gbit/s (H100/H200) or
# 200 Gbit/s (A100) network interface per GPU. Latencies are typical orders of magnitude.
CLUSTER_PRESETS: Dict[str, Dict[str, Any]] = {
    "h100x8": dict(
        devices_per_host=8,
        device_memory=80 * GiB,
        peak_flops=989e12,
        intra_bandwidth=450e9,
        inter_bandwidth=50e9,
        intra_latency=3e-6,
        inter_latency=10e-6,
    ),
    "a100x8": dict(
        devices_per_host=8,
        device_memory=80 * GiB,
        peak_flops=312e12,
        intra_bandwidth=300e9,
        inter_bandwidth=25e9,
        intra_latency=3e-6,
        inter_latency=10e-6,
    ),
}
# The H200: the H100's compute and links with 141 GB of memory.
CLUSTER_PRESETS["h200x8"] = dict(CLUSTER_PRESETS["h100x8"], device_memory=141 * 10**9)


@lru_cache(maxsize=4096)
def group_span(dims: Tuple[Tuple[int, int], ...], devices_per_host: int) -> Tuple[int, int]:
    """Where a process group sits: ``dims`` are (size, stride) pairs in global rank numbers (rank
    = sum of index x stride), the group holding rank 0 stands for all. Returns (members on the
    fullest host, hosts spanned)."""
    ranks = [0]
    for size, stride in dims:
        ranks = [r + i * stride for r in ranks for i in range(size)]
    per_host: Dict[int, int] = {}
    for r in ranks:
        per_host[r // devices_per_host] = per_host.get(r // devices_per_host, 0) + 1
    return max(per_host.values()), len(per_host)


def span_of(sizes: Sequence[Tuple[int, int]], devices_per_host: int) -> Tuple[int, int]:
    """``group_span`` with the size-1 dimensions dropped (and the result cached)."""
    return group_span(tuple((s, st) for s, st in sizes if s > 1), devices_per_host)
