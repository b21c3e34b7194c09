"""Which ranks share a host: each process's host identity, and host numbers from the ranks' identities."""
from __future__ import annotations

import os
import socket
from typing import Sequence


def host_identity() -> str:
    """What makes two processes able to share memory: same machine boot and same /dev/shm.

    ``BRAID_HOST_ID`` overrides it (as ``NCCL_HOSTID``): ranks with different values talk over TCP
    even on one machine; ranks with equal values must really share a machine."""
    forced = os.environ.get("BRAID_HOST_ID")
    if forced:
        return f"env|{forced}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        st = os.stat("/dev/shm")
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "?"
    return f"{socket.gethostname()}|{boot}|{shm}"


def host_numbers(identities: Sequence[str]) -> list:
    """Host numbers of the ranks whose host_identity() values are ``identities`` (in rank order):
    equal numbers for equal identities, numbered in order of first appearance."""
    ids: dict = {}
    return [ids.setdefault(h, len(ids)) for h in identities]
