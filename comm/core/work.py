"""Handles of braid's async collectives (``Work``) and the timeouts their waits take."""
from __future__ import annotations

import numbers
from datetime import timedelta
from typing import Optional, Union

import torch

import braid.comm._C as _C  # the extension module itself (not the package)

# Longer timeouts (inf included) mean "wait for ever" and are cut to this, as the core does
# (csrc/core/errors.h's kMaxTimeoutSeconds).
MAX_TIMEOUT_S = _C.MAX_TIMEOUT_S


def seconds(timeout: Union[timedelta, float, int], name: str = "timeout", zero_ok: bool = False) -> float:
    """Seconds of a timedelta or a real number, positive (or 0 with ``zero_ok``), at most
    MAX_TIMEOUT_S; a TypeError or ValueError naming ``name`` otherwise."""
    if isinstance(timeout, timedelta):
        secs = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        secs = float(timeout)
    else:
        raise TypeError(f"{name} must be a number of seconds or a datetime.timedelta, got {timeout!r}")
    if not (secs > 0 or (zero_ok and secs == 0)):
        raise ValueError(f"{name} must be {'0 or more' if zero_ok else 'positive'}, got {timeout!r}")
    return min(secs, MAX_TIMEOUT_S)


class Work:
    """Handle of an async call: ``wait(timeout)``, ``is_completed()``, ``is_success()``,
    ``get_future()``, ``describe()``. The one handle class of braid in Python: a communicator's
    calls return this class itself; a group's calls (``GroupWork``, core/group.py) and a
    compressed all-reduce (``CompressedWork``, compression/compressors.py) return subclasses that
    add what runs when the call completes (a division, a copy back, decoding). (FSDP2's custom
    collectives wrap one in ``fsdp2.BraidWork``, the ``torch.distributed.Work`` FSDP2 requires.)
    """

    __slots__ = ("_w", "_what")

    def __init__(self, w, what: str):
        self._w = w
        self._what = what

    def wait(self, timeout: Optional[Union[float, timedelta]] = None) -> bool:
        """Blocks until the collective is done; raises its error. With ``timeout`` (seconds or a
        timedelta) returns False if it is still running then; a timeout of 0 only polls (True
        when done, the error raised when it failed)."""
        secs = None if timeout is None else seconds(timeout, zero_ok=True)
        if secs == 0:
            return self._w.is_completed() and self._w.wait(None)
        return self._w.wait(secs)

    def is_completed(self) -> bool:
        return self._w.is_completed()

    def is_success(self) -> bool:
        return self._w.is_success()

    def completed_at(self) -> Optional[float]:
        """When the collective completed, in ``time.perf_counter()``'s seconds; None before."""
        return self._w.completed_at()

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed by braid's progress thread with the list of output
        tensors (as ``torch.distributed``'s Work), or with the error."""
        return self._w.get_future()

    def describe(self) -> str:
        """The collective and its state: "all_reduce running", "broadcast done",
        "all_reduce failed: PeerError: ..."."""
        if not self._w.is_completed():
            return f"{self._what} running"
        if self._w.is_success():
            return f"{self._what} done"
        return f"{self._what} failed: {self._w.exception_message()}"

    def __repr__(self) -> str:
        return f"<braid.comm.Work {self.describe()}>"
