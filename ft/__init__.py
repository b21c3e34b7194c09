"""Training that survives a lost replica (``braid.ft``): data parallelism over replicas whose
membership is agreed per step through the store; a replica that dies is dropped at the step it
died in (every survivor discards that step alike), training goes on with the others, and a
restarted or new replica joins at the next step boundary, receiving the state from a healthy one
over braid (no checkpoint file).

    manager = braid.ft.Manager(state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
                               load_state_dict=load, min_replicas=1, store=store)
    model = braid.ft.DistributedDataParallel(manager, model)
    optimizer = braid.ft.Optimizer(manager, opt)

See docs/usage/ft.md.
"""

from .ddp import DistributedDataParallel, Optimizer
from .manager import Manager
from .quorum import FTError
from .transfer import load_local_shards

__all__ = ["DistributedDataParallel", "FTError", "Manager", "Optimizer", "load_local_shards"]
