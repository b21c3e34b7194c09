"""braid.comm.tp: tensor-parallel layers and regions on braid collectives (Megatron style).

    from braid.comm import tp
    up = tp.ColumnParallelLinear(d, 4 * d, group=c)      # weight split by output features
    down = tp.RowParallelLinear(4 * d, d, group=c)       # split by input features, all-reduced
    model = tp.parallelize(model, c, {"mlp.up": "colwise", "mlp.down": "rowwise"})
    loss = tp.vocab_parallel_cross_entropy(logits_slice, target, c)  # logits split by vocabulary

The group may be a braid Communicator ``c``, any torch.distributed ProcessGroup (an NCCL group on
GPUs, a DeviceMesh dimension's group for TP inside DP) or None, the default group:

    fc = tp.ColumnParallelLinear.from_dense(nn.Linear(d, 4 * d, device="cuda"), dist.group.WORLD)
"""
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy
from .plan import mark_sequence_parallel, parallelize
from .regions import (copy_to_region, gather_from_region, gather_from_sequence_region, reduce_from_region,
                      reduce_scatter_to_sequence_region, scatter_to_region, scatter_to_sequence_region)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "parallelize",
           "vocab_parallel_cross_entropy",
           "mark_sequence_parallel", "copy_to_region", "reduce_from_region", "scatter_to_region",
           "gather_from_region", "scatter_to_sequence_region", "gather_from_sequence_region",
           "reduce_scatter_to_sequence_region"]
