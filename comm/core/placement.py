"""Where the ranks of a group sit (:class:`Placement`): the host of each rank and, with the group
split by host, its index there, gathered once over the group. The MoE dispatch across hosts and
the ZeRO wrapper's hierarchical reduce-scatter read it; adaptive compression's model takes only
its counts (compression/adaptive/model.py's ``Layout``)."""
from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch

from .group import Group, as_group
from .group_carrier import HostGroups
from .hosts import host_identity, host_numbers


def metadata_device(group: Any, device: torch.device) -> torch.device:
    """Where ``group``'s exchanges of host metadata run: in host memory where the group takes CPU
    tensors (a Communicator, gloo: no copy to the device and back), else on ``device``, the
    tokens' (an NCCL group takes CUDA tensors only). A duck-typed group is taken to hold CPU."""
    host = torch.device("cpu")
    if isinstance(group, Group) and group.device_problem(host) is not None:
        return torch.device(device)
    return host


class Placement:
    """Where the ranks of a group sit, the one record of it every layer uses: each rank's host
    (numbered from 0, as braid's communicator tells hosts apart) or, with the group split by host
    (``hosts``, a HostGroups), its host and its index there (``hosts.inter``'s rank and
    ``hosts.intra``'s, checked to cover every pair once), and one integer more per rank when
    asked (``tokens``: the MoE layer's token counts, for its padded mode's check). One all-gather
    over the group on the metadata device (:func:`metadata_device`), read on the host once;
    tensors of it are kept per device (:meth:`on`, :meth:`local_major`)."""

    def __init__(self, group: Any, device: torch.device, hosts: Optional[HostGroups] = None, tokens: int = 0):
        n = group.world_size
        self.inter = self.intra = None
        if hosts is not None:
            self.intra = as_group(hosts.intra.group, "hosts")
            self.inter = as_group(hosts.inter.group, "hosts")
            h, local = self.inter.world_size, self.intra.world_size
            if h * local != n:
                raise ValueError(f"hosts: {h} hosts x {local} ranks do not make the group's {n} ranks")
            mine = [self.inter.rank, self.intra.rank, tokens]
        else:  # a hash of the host identity: equal on ranks that share a host
            digest = hashlib.sha256(host_identity().encode()).digest()[:8]
            mine = [int.from_bytes(digest, "little", signed=True), 0, tokens]
        rows = [mine]
        if n > 1:
            where = metadata_device(group, device)
            table = torch.empty(3 * n, dtype=torch.int64, device=where)
            group.all_gather(table, torch.tensor(mine, dtype=torch.int64, device=where))
            flat = table.tolist()  # the layout's one read on the host
            rows = [flat[3 * r:3 * r + 3] for r in range(n)]
        self.tokens = [row[2] for row in rows]
        if hosts is None:
            self.hosts, self.locals = host_numbers([str(row[0]) for row in rows]), None
        else:
            self.hosts, self.locals = [row[0] for row in rows], [row[1] for row in rows]
            if sorted(zip(self.hosts, self.locals)) != [(a, b) for a in range(h) for b in range(local)]:
                raise ValueError(f"hosts: the HostGroups are not this group's split by host (every rank must "
                                 f"be rank i of its host's intra group and rank h of its inter group; got "
                                 f"(host, local) {list(zip(self.hosts, self.locals))})")
        self.num_hosts = max(self.hosts) + 1
        self._on: dict = {}  # device -> on()'s tensors
        self._local_major: dict = {}  # device -> local_major()'s tensor

    def local_major(self, device: torch.device) -> torch.Tensor:
        """With ``hosts``: the group's ranks local index by local index, each index's ranks in host
        order (``hosts.inter``'s rank order): entry ``i * hosts + h`` is the rank with local index i
        on host h. What a host sends its local rank i to exchange across hosts (the ZeRO
        wrapper's hierarchical reduce-scatter). An int64 tensor on ``device``, made once."""
        if self.locals is None:
            raise ValueError("local_major needs the group split by host (hosts)")
        found = self._local_major.get(device)
        if found is None:
            order = [0] * len(self.hosts)
            for rank, (h, i) in enumerate(zip(self.hosts, self.locals)):
                order[i * self.num_hosts + h] = rank
            found = self._local_major[device] = torch.tensor(order, dtype=torch.int64, device=device)
        return found

    def on(self, device: torch.device) -> tuple:
        """(host of each rank, local index of each rank or None without ``hosts``) as int64
        tensors on ``device``, made at the first call for that device."""
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = tuple(
                None if v is None else torch.tensor(v, dtype=torch.int64, device=device)
                for v in (self.hosts, self.locals))
        return found
