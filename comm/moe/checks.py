"""The argument checks of the MoE layer and of dispatch, naming the bad argument."""
from __future__ import annotations

import math
from typing import Any



DROP_POLICIES = ("probs", "position")
COMPRESSIONS = ("int8", "fp8")


# -- argument checks -------------------------------------------------------------------------------

def positive_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


def check_experts(num_experts: int, top_k: int, world_size: int, where: str) -> None:
    positive_int(num_experts, "num_experts", where)
    positive_int(top_k, "top_k", where)
    if top_k > num_experts:
        raise ValueError(f"{where}: top_k={top_k} is larger than num_experts={num_experts}")
    if num_experts % world_size:
        raise ValueError(f"{where}: num_experts={num_experts} does not divide by the group's {world_size} "
                         "ranks (each rank holds num_experts / world_size experts)")


def check_capacity(capacity_factor: Any, drop_policy: Any, where: str) -> None:
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
                or not math.isfinite(capacity_factor) or capacity_factor <= 0:
            raise ValueError(f"{where}: capacity_factor must be None (dropless) or a positive finite number, "
                             f"got {capacity_factor!r}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"{where}: drop_policy must be one of {', '.join(map(repr, DROP_POLICIES))}, "
                         f"got {drop_policy!r}")
