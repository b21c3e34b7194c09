"""Two ranks that set up a communicator and use it, for tests/test_shm_limits.py, which runs this
script in a private mount namespace whose /dev/shm is only a few MiB.

    python small_shm_ranks.py OUT.json

Each rank records what its steps did (all_reduce of 16 MB through the slots, then an all-to-all
with split sizes that needs the point-to-point mailboxes); the parent writes every rank's record
and exit code to OUT.json. A rank killed by SIGBUS shows up as exit code -7.
"""
import json
import os
import sys
import tempfile
import time
from datetime import timedelta


def rank_main(rank, store_path, queue):
    import torch
    import torch.distributed as dist
    from braid import comm

    steps = []

    def step(name, fn):
        start = time.monotonic()
        try:
            fn()
            steps.append({"step": name, "error": None})
            return True
        except Exception as e:  # noqa: BLE001 - reported to the test
            steps.append({"step": name, "error": type(e).__name__, "message": str(e),
                          "seconds": time.monotonic() - start})
            return False

    store = dist.FileStore(store_path, 2)
    box = {}
    if step("init", lambda: box.update(c=comm.Communicator(store, rank, 2, timeout=timedelta(seconds=30)))):
        c = box["c"]
        t = torch.ones(4 << 20)
        if step("all_reduce", lambda: c.all_reduce(t)):
            steps[-1]["value"] = t[0].item()
        splits = [1 << 20, 2 << 20] if rank == 0 else [2 << 20, 1 << 20]  # 8 MB to the peer
        x = torch.ones(3 << 20)
        step("uneven_all_to_all", lambda: c.all_to_all(torch.empty_like(x), x, input_split_sizes=splits,
                                                       output_split_sizes=splits))
        c.close()
    queue.put((rank, steps))


def main():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store_path = tempfile.mktemp(prefix="braid-small-shm-")
    procs = [ctx.Process(target=rank_main, args=(r, store_path, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    records = {}
    while not queue.empty():
        rank, steps = queue.get()
        records[rank] = steps
    out = {"ranks": [{"exit": p.exitcode, "steps": records.get(r)} for r, p in enumerate(procs)],
           "shm_mib": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize >> 20}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
