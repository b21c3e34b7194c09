"""Adaptive gradient compression: per bucket, the choice among exact, bf16, int8, int4 and top-k that
braid's own measurements (link per level, codec cost on this device, overlap window) predict to
make the step shortest, within an error budget, identical on every rank.

    q = comm.Adaptive()                                  # candidates, error_budget=0.3, interval=8
    state, hook = ddp.comm_hook(c, compression="auto")   # or compression=q
    state.decisions()                                    # {bucket: Decision(choice, reason, ...)}
    model = zero.shard(model, c, grad_compression=q)     # the sharding's gradient reduce-scatters
    q.decisions()

In two parts: model.py, a pure function of :class:`Measurements` (:func:`decide`), and
controller.py, the compressor :class:`Adaptive` that measures, exchanges the measurements and
runs each bucket through its choice. docs/design/compression.md ("Adaptive compression") gives
the model and its reasons.
"""
from .controller import Adaptive, DeviceMarks
from .model import (EXACT, CANDIDATES, DEFAULT_CANDIDATES, IN_HOST, ACROSS_HOSTS, LEVELS, ALL_REDUCE,
                    REDUCE_SCATTER, OTHER, OTHER_IN_HOST, COLLECTIVE_CANDIDATES, CODEC_PASSES, ROUNDINGS,
                    ROUNDS, ONE_HOST_REASON, DEFAULT_LATENCY_S, PROBE_ELEMS, MIN_GAIN_S, CALL_CPU_S,
                    CPU_FIELDS, Level, Layout, BucketMeasure, Measurements, Decision, piece_bytes,
                    level_bytes, transfer_s, host_cpu_s, codec_s, plan_cost, carried, admissible, decide,
                    fit_levels, fit_link, contention)

__all__ = ['Adaptive', 'DeviceMarks', 'EXACT', 'CANDIDATES', 'DEFAULT_CANDIDATES', 'IN_HOST', 'ACROSS_HOSTS',
           'LEVELS', 'ALL_REDUCE', 'REDUCE_SCATTER', 'OTHER', 'OTHER_IN_HOST', 'COLLECTIVE_CANDIDATES',
           'CODEC_PASSES', 'ROUNDINGS', 'ROUNDS', 'ONE_HOST_REASON', 'DEFAULT_LATENCY_S', 'PROBE_ELEMS',
           'MIN_GAIN_S', 'CALL_CPU_S', 'CPU_FIELDS', 'Level', 'Layout', 'BucketMeasure', 'Measurements',
           'Decision', 'piece_bytes', 'level_bytes', 'transfer_s', 'host_cpu_s', 'codec_s', 'plan_cost',
           'carried', 'admissible', 'decide', 'fit_levels', 'fit_link', 'contention']
