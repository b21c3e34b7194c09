"""What the launcher tells a rank: its rank, the world size and the store's address from torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or SLURM's, the TCPStore that
:func:`braid.comm.init` builds from them, and the address this rank listens on for the ranks of
other hosts (``BRAID_SOCKET_IFNAME``, else the interface that routes to the store's host). Which
ranks share a host is decided from published identities (hosts.py), never from this environment."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional, Union

import torch.distributed as dist

import braid.comm._C as _C  # the extension module itself (not the package)
from .work import seconds

# One TCPStore per (address, port) in a process: rank 0 hosts it, and a second init() must not try
# to listen on the port again.
_stores: dict = {}


def env_value(name: str, slurm: Optional[str] = None) -> str:
    """The launcher's ``name`` (torchrun), else ``slurm`` (srun's equivalent); a ValueError saying
    what to do where neither is set."""
    value = os.environ.get(name) or (os.environ.get(slurm) if slurm else None)
    if not value:
        also = f" (nor {slurm})" if slurm else ""
        raise ValueError(f"{name} is not set{also}: pass store, rank and world_size, initialize "
                         "torch.distributed, or launch with torchrun or srun")
    return value


def launch_rank() -> int:
    """This process's rank: RANK (torchrun), else SLURM_PROCID."""
    return int(env_value("RANK", "SLURM_PROCID"))


def launch_world_size() -> int:
    """The number of ranks: WORLD_SIZE (torchrun), else SLURM_NTASKS."""
    return int(env_value("WORLD_SIZE", "SLURM_NTASKS"))


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM node list: "node[03-05,07],gpu1" -> "node03"."""
    first = nodelist.split(",", 1)[0]
    head = first if "[" not in first else nodelist[:nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    first = ranges.rstrip("]").split(",", 1)[0].split("-", 1)[0]
    return prefix + first


def master_addr() -> str:
    """The store's host: MASTER_ADDR, else the first host of SLURM_STEP_NODELIST or
    SLURM_JOB_NODELIST."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if nodes:
        return first_slurm_host(nodes)
    return env_value("MASTER_ADDR")


def master_port() -> int:
    """The store's port: MASTER_PORT, else one derived from SLURM_JOB_ID and SLURM_STEP_ID."""
    if os.environ.get("MASTER_PORT"):
        return int(os.environ["MASTER_PORT"])
    job = os.environ.get("SLURM_JOB_ID")
    if job and job.isdigit():
        # Every task of the step derives the same port; jobs sharing a node rarely collide, and
        # steps of one job running side by side (a replica each, braid.ft) or one after another
        # (a restarted step) take ports of their own. Step 0 keeps the job's port.
        step = os.environ.get("SLURM_STEP_ID", "0")
        step = int(step) if step.isdigit() else 0
        return 20000 + (int(job) + 1009 * step) % 20000
    return int(env_value("MASTER_PORT"))


def launch_store(rank: int, world_size: int, timeout: Union[timedelta, float]) -> "dist.Store":
    """The store of the launcher's address (:func:`master_addr`, :func:`master_port`), under a
    prefix of braid's own: a TCPStore that rank 0 hosts (torchrun's agent hosts it when
    TORCHELASTIC_USE_AGENT_STORE is true), made once per address in a process with ``timeout``."""
    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    where = (master_addr(), master_port())
    tcp = _stores.get(where)
    if tcp is None:
        tcp = dist.TCPStore(where[0], where[1], world_size, is_master=(rank == 0 and not use_agent),
                            timeout=timedelta(seconds=seconds(timeout)))
        _stores[where] = tcp
    # torchrun's agent store outlives a restart of the workers: each attempt its own keys (torch's
    # own rendezvous does the same), or a restarted rank would read the last attempt's segment names.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return dist.PrefixStore("braid/" if attempt is None else f"braid/attempt{attempt}/", tcp)


def store_host(store: "dist.Store") -> Optional[str]:
    """The host of the TCPStore under ``store`` (through PrefixStores), else None."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.host if isinstance(store, dist.TCPStore) else None


def bind_address(store: "dist.Store") -> str:
    """The address this rank listens on for other hosts' ranks: BRAID_SOCKET_IFNAME's interface
    (BRAID_SOCKET_FAMILY=AF_INET6 for IPv6), else the one that routes to the store's host, else
    the first interface that is up other than loopback, else loopback."""
    spec = os.environ.get("BRAID_SOCKET_IFNAME")
    family = os.environ.get("BRAID_SOCKET_FAMILY", "AF_INET")
    if family not in ("AF_INET", "AF_INET6"):
        raise ValueError(f"BRAID_SOCKET_FAMILY must be AF_INET or AF_INET6, got {family!r}")
    if spec:
        return _C.interface_address(spec, family == "AF_INET6")
    host = store_host(store)
    if host:
        try:
            return _C.route_address(host)
        except ValueError:
            pass
    try:
        return _C.interface_address("^lo", family == "AF_INET6")
    except ValueError:
        return "::1" if family == "AF_INET6" else "127.0.0.1"
