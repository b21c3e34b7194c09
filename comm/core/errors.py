"""Errors raised by braid's communication. Every one is a ``CommError`` (a ``RuntimeError``)."""


class CommError(RuntimeError):
    """A collective failed; the communicator that raised it is unusable until rebuilt."""


class CommTimeout(CommError):
    """A deadline passed while waiting for ranks; the message names the ranks that did not arrive."""


class PeerError(CommError):
    """A peer exited, closed its communicator or failed while this rank needed it."""


class CollectiveMismatch(CommError):
    """Ranks issued different collectives (kind, dtype, count, op, root or algorithm) at one step."""


class CommClosed(CommError, ValueError):
    """The communicator was used after ``close()`` (also a ``ValueError``: it is a usage error)."""


__all__ = ["CommError", "CommTimeout", "PeerError", "CollectiveMismatch", "CommClosed"]
