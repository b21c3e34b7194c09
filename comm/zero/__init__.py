"""braid.comm.zero: braid's ZeRO wrapper, data parallelism with the optimizer state (ZeRO stage 1),
the gradients too (ZeRO stage 2) or the parameters as well (ZeRO stage 3) sharded over a group,
with ZeRO++'s quantized weights and gradients and hierarchical partitioning, on braid collectives
or any ProcessGroup.

    from braid.comm import zero
    model = zero.shard(model, c, stage=3)     # a Communicator, a ProcessGroup, or None (default group)
    opt = torch.optim.AdamW(model.parameters())

sharded.py is the module wrapper, schedule.py the order of its collectives, layout.py the flat
buffers and buckets, state.py the state dicts. (braid.comm.fsdp, the old name, still gives these
names and FSDP2's in braid.comm.fsdp2.)
"""
from .sharded import MixedPrecision, ShardedModule, shard

__all__ = ["shard", "ShardedModule", "MixedPrecision"]
