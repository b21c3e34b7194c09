"""braid.comm.fsdp: sharded data parallelism on braid collectives (FSDP2 custom comms, ZeRO 1-3 wrapper).

    from braid.comm import fsdp
    ag, rs = fsdp.fsdp2_comms(c)              # FSDP2 keeps its scheduling, braid moves the bytes
    module.set_custom_all_gather(ag); module.set_custom_reduce_scatter(rs)
    model = fsdp.shard(model, c, stage=3)     # braid's own ZeRO wrapper
    opt = torch.optim.AdamW(model.parameters())
"""
from .fsdp2 import BraidAllGather, BraidReduceScatter, BraidWork, fsdp2_comms, use_braid_comms
from .sharded import MixedPrecision, ShardedModule, shard

__all__ = ["fsdp2_comms", "use_braid_comms", "BraidAllGather", "BraidReduceScatter", "BraidWork",
           "shard", "ShardedModule", "MixedPrecision"]
