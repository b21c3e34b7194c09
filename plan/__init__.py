"""braid.plan: a parallel-layout planner for decoder-only transformers.

    from braid.plan import Cluster, Constraints, TransformerShape, plan
    model = TransformerShape.preset("llama3-70b")
    cluster = Cluster.preset("h100x8:64")
    best = plan(model, cluster, top=5)[0]
    print(best.label(), best.step, best.mfu, best.memory.total)
    print(best.snippet)

From the shell: ``python -m braid.plan --model llama3-70b --cluster h100x8:64``; under torchrun,
``--measure`` times the links among the launched ranks (``braid.plan.measure``). The formulas are
in docs/usage/plan.md.
"""

from .cluster import CLUSTER_PRESETS, Cluster, parse_bytes
from .cost import Assumptions, Candidate, Comm, Memory, StepTime
from .model import MODEL_PRESETS, ModuleProfile, TransformerShape, profile_module
from .search import Constraints, Layout, NoLayoutFits, PlanResult, candidates, evaluate, plan, search

__all__ = [
    "plan",
    "search",
    "candidates",
    "evaluate",
    "TransformerShape",
    "Cluster",
    "Constraints",
    "Assumptions",
    "Layout",
    "PlanResult",
    "Candidate",
    "Memory",
    "StepTime",
    "Comm",
    "NoLayoutFits",
    "profile_module",
    "ModuleProfile",
    "parse_bytes",
    "MODEL_PRESETS",
    "CLUSTER_PRESETS",
]
