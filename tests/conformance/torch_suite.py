"""PyTorch's own distributed test suite (``DistributedTest._DistTestBase`` from
``torch/testing/_internal/distributed/distributed_test.py``) bound to one backend, as PyTorch's
``test/distributed/test_distributed_spawn.py`` binds it, for ``tests/conformance/run.py`` to drive.

The environment chooses the backend and world size: ``BACKEND`` (``braid`` or ``gloo``) and
``WORLD_SIZE``. Importing braid registers its backend here and in every spawned rank (the ranks
import this module again).

``CONFORMANCE_GATES_AS=gloo`` runs braid under gloo's name gates, for the tests the suite skips
on braid by name alone (run.py selects them): the suite decides what to skip, and which branch of
a test to take, from ``BACKEND``, so the suite sees ``gloo`` throughout while the default process
group every test creates (``init_process_group(backend="gloo")``) is made braid's. Groups a test
asks for by name with ``new_group(backend=...)`` stay what they ask for.
"""
import multiprocessing
import os
import sys

import torch.distributed as dist

import braid.comm.core.backend  # noqa: F401 - registers the "braid" backend (here and in the ranks)

_backend = os.environ.get("BACKEND")
if _backend is None or "WORLD_SIZE" not in os.environ:
    raise RuntimeError("tests/conformance/torch_suite.py needs BACKEND and WORLD_SIZE in the environment")
_gates = os.environ.get("CONFORMANCE_GATES_AS")
if _gates:
    os.environ["BACKEND"] = _gates
    _init_process_group = dist.init_process_group

    def _init_as_backend(*args, backend=None, **kwargs):
        if backend == _gates:
            backend = _backend
        return _init_process_group(*args, backend=backend, **kwargs)

    dist.init_process_group = _init_as_backend

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

if not dist.is_available():
    raise RuntimeError("torch.distributed is not available in this torch build")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """The suite's tests, each in fresh rank processes. test_distributed_spawn.py spawns them;
    forking the test runner (which has made no process group and run no parallel torch op) gives
    the same fresh ranks without re-importing torch and the suite in each, about 3 s less per
    rank and test."""

    def setUp(self):
        super().setUp()
        start = os.environ.get("CONFORMANCE_START", "fork")
        self._start_processes(multiprocessing.get_context(start).Process)


if __name__ == "__main__":
    sys.exit(run_tests())

