"""The package's shape: its parts reachable from ``braid.comm``, no import cycles, no private
names taken from another module, and tests that take from braid.bench only what it shares with them.

Two modules import each other when either names the other in an import statement anywhere (at
its top level or deferred into a function, which only hides the knot); the check covers braid's
own modules (braid.comm, braid.kernels, braid.bench and their subpackages), read from the source
with ``ast``. A package's ``__init__`` making its parts attributes on first use (``comm.ddp``) is
the package reaching down, not a cycle: attribute-driven imports are not import statements."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"braid.comm": ROOT / "comm", "braid.kernels": ROOT / "kernels", "braid.bench": ROOT / "bench",
            "braid.trace": ROOT / "trace", "braid.optim": ROOT / "optim", "braid.ft": ROOT / "ft",
            "braid.plan": ROOT / "plan"}
# What the benchmarks and the tests share: the small models (and how they are split across ranks),
# the simulated hosts and braid.ft's replica process. They hold no benchmark logic and import no
# benchmark module; the tests take nothing else from braid.bench, except test_bench.py, which
# tests the benchmarks themselves.
SHARED_WITH_TESTS = ("braid.bench.models", "braid.bench.simhosts", "braid.bench.ft_replica")


def _modules() -> dict:
    """{module name: path} for every braid module."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _import_statements(name: str, path: Path, modules: dict) -> list:
    """(line, module, name or None) for every import statement of module ``name``, at its top level
    or inside its functions (relative imports resolved; imports only for type checkers left out):
    ``import a.b`` gives (line, "a.b", None), ``from a import x`` (line, "a", "x")."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = []

    def body(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(node, ast.Import):
                found.extend((node.lineno, alias.name, None) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    prefix = base[: len(base) - (node.level - 1)]
                    target = ".".join(prefix + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                found.extend((node.lineno, target, alias.name) for alias in node.names)
            elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                body(node.body)
            elif hasattr(node, "body") and isinstance(node.body, list):
                body(node.body)
                body(getattr(node, "orelse", []) or [])
                for handler in getattr(node, "handlers", []) or []:
                    body(handler.body)
                body(getattr(node, "finalbody", []) or [])

    body(tree.body)
    return found


def _imports(name: str, path: Path, modules: dict) -> set:
    """The braid modules `name` imports (see _import_statements)."""
    found = set()
    for _, target, imported in _import_statements(name, path, modules):
        # `from . import x` imports the module x where x is one (the compiled _C included), else
        # it takes a name from `target`, which is imported.
        if imported is not None and f"{target}.{imported}" in modules:
            found.add(f"{target}.{imported}")
        elif imported != "_C":
            found.add(target)
    return {m for m in found if m in modules and m != name}


def import_cycles() -> list:
    """Every cycle of module-level imports among braid's modules, each as a list of names."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def private_imports() -> list:
    """Every import of an underscore name from another braid module ("module:line takes
    other._name"); the compiled extension ``_C`` is the package's, so it is not counted. Modules
    share what they share through public names."""
    modules = _modules()
    found = []
    for name, path in sorted(modules.items()):
        for line, target, imported in _import_statements(name, path, modules):
            if (target in modules and target != name and imported is not None
                    and imported.startswith("_") and imported != "_C"):
                found.append(f"{name}:{line} takes {target}.{imported}")
    return found


def bench_imports_of_tests() -> list:
    """Every import of a braid.bench module other than the shared ones by a test or a test helper
    ("path:line takes module"), test_bench.py aside; and every import of another braid.bench
    module by a shared one."""
    modules = _modules()
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "test_bench.py":
            continue
        for line, target, imported in _import_statements(f"tests.{path.stem}", path, modules):
            module = f"{target}.{imported}" if f"{target}.{imported}" in modules else target
            if module.split(".")[:2] == ["braid", "bench"] and module not in SHARED_WITH_TESTS:
                found.append(f"{path.relative_to(ROOT)}:{line} takes {module}")
    for shared in SHARED_WITH_TESTS:
        for module in sorted(_imports(shared, modules[shared], modules)):
            if module.startswith("braid.bench"):
                found.append(f"{shared} takes {module}")
    return list(dict.fromkeys(found))  # one entry per statement


# braid.comm by floor, bottom first: a module imports modules of its own floor or below, and a
# parallel layer none of the other layers (each builds on the core and compression only); the
# package itself, and the old module names kept importing, sit on top.
COMM_FLOORS = (("braid.comm.core",), ("braid.comm.compression",),
               ("braid.comm.ddp", "braid.comm.zero", "braid.comm.fsdp2", "braid.comm.tp", "braid.comm.cp",
                "braid.comm.moe"),
               ("braid.comm", "braid.comm._aliases", "braid.comm.fsdp"))


def _floor(module: str) -> tuple:
    """(floor, unit) of a braid.comm module: the unit is the entry of COMM_FLOORS it falls under."""
    for level, units in enumerate(COMM_FLOORS):
        for unit in units:
            if module == unit or (unit != "braid.comm" and module.startswith(unit + ".")):
                return level, unit
    raise AssertionError(f"{module} is on no floor of COMM_FLOORS")


def layering_violations() -> list:
    """Every import of a braid.comm module that climbs a floor or crosses between layers."""
    modules = _modules()
    found = []
    for name, path in sorted(modules.items()):
        if not name.startswith("braid.comm"):
            continue
        level, unit = _floor(name)
        for target in sorted(_imports(name, path, modules)):
            if not target.startswith("braid.comm"):
                continue
            t_level, t_unit = _floor(target)
            if t_level > level or (t_level == level == 2 and t_unit != unit):
                found.append(f"{name} imports {target}")
    return found


def test_comm_is_arranged_by_layer():
    assert layering_violations() == []


def test_parts_and_old_module_paths_in_a_fresh_interpreter():
    """In one fresh interpreter (an import costs seconds here), in this order: the parts of
    braid.comm are its attributes before anything else imported them; then scripts written
    against braid.comm's module paths before its arrangement by layer keep running: every old
    name imports (as a module, a submodule or an attribute of braid.comm) the very module that
    holds its code now, which keeps its own name; braid.comm.fsdp gives the ZeRO wrapper's and
    FSDP2's names."""
    code = ("from braid import comm\n"
            "assert callable(comm.ddp.comm_hook) and comm.zero and comm.fsdp2 and comm.fsdp and comm.tp\n"
            "assert callable(comm.moe.MoE)\n"
            "assert callable(comm.cp.ring_attention)\n"
            "try:\n    comm.no_such_part\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
            "import importlib\n"
            "from braid.comm._aliases import MOVED\n"
            "for old, new in MOVED.items():\n"
            "    m = importlib.import_module(old)\n"
            "    assert m is importlib.import_module(new) and m.__name__ == new == m.__spec__.name, old\n"
            "    if old.count('.') == 2:\n"
            "        assert getattr(comm, old.rsplit('.', 1)[1]) is m, old\n"
            "import braid.comm.fsdp.sharded as s\n"
            "from braid.comm import fsdp, fsdp2, zero\n"
            "from braid.comm.adaptive import Adaptive, decide\n"
            "assert s is zero.sharded and fsdp.shard is zero.shard\n"
            "assert fsdp.fsdp2_comms is fsdp2.fsdp2_comms\n"
            "assert Adaptive is comm.Adaptive and decide is comm.compression.adaptive.model.decide\n"
            "try:\n    importlib.import_module('braid.comm.no_such_module')\n"
            "except ModuleNotFoundError:\n    pass\nelse:\n    raise SystemExit(1)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_import_cycles():
    assert import_cycles() == []


def test_no_private_names_cross_modules():
    assert private_imports() == []


def test_tests_take_only_shared_pieces_from_bench():
    assert bench_imports_of_tests() == []


def test_python_tables_match_the_core():
    """The Python side's reduce ops are the core's (csrc/core/dtype.h, read from the binding), each
    spelled as torch.distributed spells it and meaning the same op, and the algorithm names are
    tunables.h's: an op renamed or renumbered on one side would reduce with the wrong op."""
    import torch.distributed as dist
    from braid.comm import _C
    from braid.comm.core import vocabulary

    assert list(vocabulary.REDUCE_OPS) == ["sum", "avg", "max", "min", "prod", "band", "bor", "bxor"]
    assert list(vocabulary.REDUCE_OPS.values()) == list(range(len(vocabulary.REDUCE_OPS)))
    for name, code in _C.REDUCE_OPS.items():
        torch_op = getattr(dist.ReduceOp, "PRODUCT" if name == "prod" else name.upper())
        assert vocabulary.op_code(torch_op) == vocabulary.op_code(name) == code
    assert _C.ALGORITHMS == ("auto", "oneshot", "twoshot", "ring", "hierarchical", "leaders", "doubling")


def test_the_extension_uses_no_iostreams():
    """The extension's own code builds text with std::string and C stdio, never iostreams: less
    to go wrong where the C++ runtime it was built with differs from the one it runs with (see
    the next test). The C++ tests (csrc/tests) are built and run by one toolchain and may use
    streams."""
    offenders = [f"{path.relative_to(ROOT)}: {line.strip()}"
                 for folder in ("core", "binding", "cuda")
                 for path in sorted((ROOT / "csrc" / folder).rglob("*"))
                 if path.suffix in (".h", ".cc", ".cpp", ".cu")
                 for line in path.read_text().splitlines()
                 if line.strip().startswith("#include") and any(
                     f"<{h}>" in line for h in ("iostream", "sstream", "fstream", "istream", "ostream"))]
    assert offenders == []


def test_the_extension_links_the_shared_cxx_runtime():
    """The extension takes libstdc++ from the process (NEEDED libstdc++.so.6), the copy torch
    uses, never a static copy of its own: on a GPU machine whose compiler wrapper linked it
    statically, the private copy's stream code met the process's locale and crashed formatting a
    number into an error message (and, before, reading a number from sysfs). setup.py names
    -lstdc++ for that."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    from braid.comm import _C

    dynamic = subprocess.run([readelf, "-d", _C.__file__], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert any(n.startswith("libstdc++.so") for n in needed), needed
    nm = shutil.which("nm")
    if nm is not None:  # and holds no stream code of its own (what the static copy brought)
        symbols = subprocess.run([nm, "-C", _C.__file__], capture_output=True, text=True, check=True).stdout
        own = [line for line in symbols.splitlines()
               if "::_M_insert<" in line and line.split()[0] != "U"]
        assert own == [], own[:3]
