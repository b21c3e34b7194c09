"""Test session setup: a hermetic environment for the ranks and the end of the worker pool."""
import os

import pytest
from helpers.ranks import shutdown_pool

# The ranks inherit this environment when they are spawned: BRAID_* knobs from the shell would
# change algorithms and thresholds under the tests, which set every tunable they rely on.
for _name in [n for n in os.environ if n.startswith("BRAID_")]:
    del os.environ[_name]


@pytest.fixture(scope="session", autouse=True)
def _rank_pool():
    """Stops the pooled rank processes when the session ends."""
    yield
    shutdown_pool()
