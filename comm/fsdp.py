"""braid.comm.fsdp: the names this module gave before braid.comm was arranged by layer, kept so
that scripts written against it run unchanged. braid's ZeRO wrapper (``shard``, stages 1-3)
lives in :mod:`braid.comm.zero`, the FSDP2 custom collectives (``fsdp2_comms``,
``use_braid_comms``) in :mod:`braid.comm.fsdp2`; new code imports those.

    from braid.comm import fsdp
    model = fsdp.shard(model, c, stage=3)     # = braid.comm.zero.shard
    ag, rs = fsdp.fsdp2_comms(c)              # = braid.comm.fsdp2.fsdp2_comms
"""
from .fsdp2 import BraidAllGather, BraidReduceScatter, BraidWork, fsdp2_comms, use_braid_comms
from .zero import MixedPrecision, ShardedModule, shard

# A package path, so that the old submodule names (braid.comm.fsdp.sharded, ...) reach the
# finder of _aliases.py, which maps them to their modules in braid.comm.zero and braid.comm.fsdp2.
__path__: list = []

__all__ = ["fsdp2_comms", "use_braid_comms", "BraidAllGather", "BraidReduceScatter", "BraidWork",
           "shard", "ShardedModule", "MixedPrecision"]
