"""Test session setup: a hermetic environment for the ranks and the end of the worker pool."""
import os

import pytest
import torch
from helpers.ranks import shutdown_pool

# Without a GPU the Triton kernels run in Triton's interpreter, which reads this variable when
# triton is first imported: it must be set before any test module imports braid.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The ranks inherit this environment when they are spawned: BRAID_* knobs from the shell would
# change algorithms and thresholds under the tests, which set every tunable they rely on.
for _name in [n for n in os.environ if n.startswith("BRAID_")]:
    del os.environ[_name]
# The GPU tests check the attention kernels' results: one fixed launch per key compiles each
# kernel once, where the autotuner compiles every candidate (minutes per head dim and causal
# flag). test_gpu_autotuned runs the search.
os.environ["BRAID_ATTENTION_AUTOTUNE"] = "0"


@pytest.fixture(scope="session", autouse=True)
def _rank_pool():
    """Stops the pooled rank processes when the session ends."""
    yield
    shutdown_pool()
