"""Open MPI peer of the collectives benchmark: mpi4py on numpy buffers, timed and checked like braid.

When mpi4py and mpirun are available, the collectives benchmark starts its ranks under

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np N \\
        python -m braid.bench.mpi_rank PORT

(PORT: the launching process's TCPStore on the loopback, which also holds the run's settings),
so that Open MPI runs in the same processes as braid, gloo and DeepSpeed and its timed batches
alternate with theirs at each op and size: a slow phase of the machine falls on all of them.
Calls: Allreduce in place (MPI.IN_PLACE), Reduce_scatter_block, Allgather, Bcast, all with
MPI.SUM where they reduce; Alltoall and Alltoallv for all_to_all and all_to_allv, Sendrecv for
send_recv. MPI has no
float16 or bfloat16 datatype: those dtypes leave Open MPI out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from . import protocol

DTYPES = ("float32", "float64", "int32", "int64")


class MpiBackend:
    """protocol.Backend over an mpi4py communicator."""

    name = "mpi"

    def __init__(self, comm):
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = comm

    def bind(self, op: str, send: np.ndarray, out_count: int | None
             ) -> tuple[Callable[[], None], Callable[[], np.ndarray]]:
        MPI, c = self._mpi, self._comm
        out = send if out_count is None else np.empty(out_count, send.dtype)
        rank, n = c.Get_rank(), c.Get_size()
        sends, recvs = ((), ())
        if op in ("all_to_all", "all_to_allv"):
            sends, recvs = protocol.split_counts(op, rank, n, len(send))
        sdispls, rdispls = np.cumsum((0,) + sends[:-1]), np.cumsum((0,) + recvs[:-1])
        calls = {
            "all_reduce": lambda: c.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM),
            "reduce_scatter": lambda: c.Reduce_scatter_block(send, out, op=MPI.SUM),
            "all_gather": lambda: c.Allgather(send, out),
            "broadcast": lambda: c.Bcast(out, root=protocol.ROOT),
            "all_to_all": lambda: c.Alltoall(send, out),
            "all_to_allv": lambda: c.Alltoallv([send, (list(sends), list(sdispls))],
                                               [out, (list(recvs), list(rdispls))]),
            "send_recv": lambda: c.Sendrecv(send, (rank + 1) % n, recvbuf=out, source=(rank - 1) % n),
        }
        return calls[op], lambda: out

    def barrier(self) -> None:
        self._comm.Barrier()

    def reduce(self, values: Sequence[float], how: str) -> list[float]:
        buf = np.array(values, dtype=np.float64)
        self._comm.Allreduce(self._mpi.IN_PLACE, buf, op=self._mpi.MAX if how == "max" else self._mpi.SUM)
        return buf.tolist()


def library_version() -> str:
    """The first line of MPI.Get_library_version()."""
    from mpi4py import MPI

    return MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
