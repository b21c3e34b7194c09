"""Open MPI peer of the collectives benchmark: mpi4py on numpy buffers, timed and checked like braid.

The collectives benchmark launches it under its own mpirun after braid and gloo have finished:

    mpirun --allow-run-as-root --oversubscribe -np N python -m braid.bench.mpi_peer \\
        --ops all_reduce,broadcast --sizes 4096,16384 --dtype float32 --json OUT.json

Calls: Allreduce in place (MPI.IN_PLACE), Reduce_scatter_block, Allgather, Bcast, all with
MPI.SUM where they reduce; Alltoall and Alltoallv for all_to_all and all_to_allv. Timing and
check follow protocol.py, so the numbers compare with braid's and gloo's. Rank 0 draws the
progress bar and writes OUT.json: ``{"mpi_library": first line of
MPI.Get_library_version(), "records": [...]}`` (records as in collectives.py). MPI has no
float16 or bfloat16 datatype: those dtypes are refused.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence

import numpy as np

from . import protocol, report

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
        if op in protocol.EXTRA_OPS:
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
        }
        return calls[op], lambda: out

    def barrier(self) -> None:
        self._comm.Barrier()

    def reduce(self, values: Sequence[float], how: str) -> list[float]:
        buf = np.array(values, dtype=np.float64)
        self._comm.Allreduce(self._mpi.IN_PLACE, buf, op=self._mpi.MAX if how == "max" else self._mpi.SUM)
        return buf.tolist()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m braid.bench.mpi_peer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", required=True, help="comma-separated: " + ",".join(protocol.ALL_OPS))
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes S in bytes")
    parser.add_argument("--dtype", required=True, choices=DTYPES)
    parser.add_argument("--json", required=True, metavar="PATH", help="where rank 0 writes the records")
    protocol.add_timing_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    if not set(ops) <= set(protocol.ALL_OPS):
        parser.error(f"--ops: unknown op in {args.ops!r}; choose from {', '.join(protocol.ALL_OPS)}")
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    timing = protocol.timing_from_args(args, parser)

    # Imported here, not at the top: collectives.py imports this module where mpi4py may be absent.
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    try:
        progress = report.Progress(len(ops) * len(sizes), enabled=rank == 0)
        records = protocol.run_suite([MpiBackend(comm)], ops, sizes, args.dtype, rank, world_size,
                                     timing, progress)
        progress.close()
        if rank == 0:
            library = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
            report.write_json(args.json, {"mpi_library": library, "records": records})
    except BaseException:  # noqa: BLE001 -- any failure on one rank would leave the others
        # waiting in a collective forever: abort the whole job instead.
        sys.stderr.write(f"braid.bench.mpi_peer: rank {rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.Abort(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
