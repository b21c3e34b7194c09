"""``python -m braid.ft store --port PORT``: serves the TCPStore a fault-tolerant job's replicas
share (BRAID_FT_STORE=host:PORT), until interrupted. Run it where no replica runs, so that it
outlives any replica's host."""

import argparse
import signal
import sys
from datetime import timedelta

import torch.distributed as dist


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m braid.ft", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["store"], help="store: serve the job's TCPStore")
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on (0: any free port)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    ns = parser.parse_args(argv)
    store = dist.TCPStore(
        ns.host, ns.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    print(f"braid.ft store listening on {ns.host}:{store.port}", flush=True)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
