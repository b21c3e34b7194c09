"""The module paths braid.comm had before it was arranged by layer, kept importing: a script that
imports ``braid.comm.communicator``, ``braid.comm.adaptive`` or ``braid.comm.fsdp.sharded`` gets the
module that now holds that code (the same module object, so patching and ``isinstance`` behave
as before). The table is the one place that knows the old names; docs/design/index.md
("The source, by layer") describes the arrangement.

Installed by braid.comm's ``__init__`` as a finder at the end of ``sys.meta_path``: it answers only
for the names in :data:`MOVED`, which no file provides any more, and never shadows a real module.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Optional

_CORE = ("errors", "wire", "work", "build_info", "vocabulary", "hosts", "launch_env", "device_kernels",
         "group", "group_carrier", "bootstrap", "communicator", "backend")

# old module name -> the module that holds its code now
MOVED = {
    **{f"braid.comm.{m}": f"braid.comm.core.{m}" for m in _CORE},
    "braid.comm.adaptive": "braid.comm.compression.adaptive",
    "braid.comm.fsdp.sharded": "braid.comm.zero.sharded",
    "braid.comm.fsdp.schedule": "braid.comm.zero.schedule",
    "braid.comm.fsdp.layout": "braid.comm.zero.layout",
    "braid.comm.fsdp.state": "braid.comm.zero.state",
    "braid.comm.fsdp.fsdp2": "braid.comm.fsdp2",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module that now holds its code."""

    def __init__(self, target: str):
        self.target = target
        self._spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system stamped the old name's spec on the module; it keeps its own.
        module.__spec__ = self._spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED`."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Adds the finder once (a reloaded braid.comm does not add a second)."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(AliasFinder())


def resolve(name: str):
    """The module an old attribute name of braid.comm (``comm.communicator``) stands for, or None."""
    new = MOVED.get(f"braid.comm.{name}")
    return None if new is None else importlib.import_module(new)
