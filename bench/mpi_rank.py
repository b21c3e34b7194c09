"""A rank of the collectives benchmark started under mpirun, so that Open MPI (bench/mpi_peer.py)
runs in the same processes as braid, gloo and DeepSpeed:

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np N \\
        python -m braid.bench.mpi_rank PORT

PORT is the launching process's TCPStore on the loopback, which holds the run's settings.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from . import collectives, launch


def main(argv: Sequence[str] | None = None) -> int:
    """A rank of the collectives benchmark started by mpirun (see the module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1 or not args[0].isdigit():
        sys.stderr.write("usage: python -m braid.bench.mpi_rank STORE_PORT (started by the collectives "
                         "benchmark under mpirun)\n")
        return 2
    # Imported here: mpi4py initializes MPI on import.
    from mpi4py import MPI

    port = int(args[0])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    config = collectives.Config.from_json(store.get(collectives.MPIRUN_CONFIG_KEY))
    world = MPI.COMM_WORLD
    rank, world_size = world.Get_rank(), world.Get_size()
    # Placement and DeepSpeed's peer read these, as under torchrun.
    os.environ.setdefault("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", str(rank)))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", str(world_size)))
    status = launch.run_rank_reporting(collectives.run_rank, rank, world_size, port, config)
    if status not in (0, launch.EXIT_FINDINGS):
        # The others may wait in an MPI collective, which has no deadline: end the whole job.
        world.Abort(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
