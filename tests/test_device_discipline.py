"""Device discipline of the library, checked from its source without a GPU: tensors a layer makes
live on its input's device, and every read of device data by the host is deliberate.

An ``ast`` walk over braid's library code (comm/, kernels/, trace/; not bench/ or tests/) flags:

- a tensor factory (``torch.zeros``, ``torch.arange``, ``torch.tensor``, ... the full list below,
  checked against torch's own operator schemas) called without ``device=``: it makes a CPU tensor
  whatever its neighbours' device. ``torch.zeros_like(x)``, ``x.new_zeros(...)`` follow ``x``;
- ``device="cpu"``, ``torch.device("cpu")``, ``.to("cpu")``, ``.cpu()``: a host copy or tensor;
- ``.item()``, ``.tolist()``, ``.numpy()``, ``int()`` / ``float()`` / ``bool()`` of a torch call or
  of a reduction (``.max()``, ``.all()``, ...), and such a reduction as the condition of an
  ``if`` / ``while`` / ``assert``: the host reads device data (a stream sync on CUDA);
- ``torch.nonzero`` / ``.nonzero()`` and one-argument ``torch.where``: the output's size depends
  on the data, so the host waits for the device (``as_tuple`` changes the output's shape, not the
  wait; ``nonzero_static(x, size=...)`` does not wait and is not flagged);
- ``torch.from_numpy`` / ``torch.frombuffer``: host tensors by construction.

A finding is legitimate only with a reason: ``ALLOWED`` maps (file, function, call) to one line
saying why that host tensor or host read is right there. A finding outside it fails the test of
its file, naming file:line and the call; an entry that matches nothing fails too, so the list
cannot outlive the code it excuses. The checker itself is tested on a synthetic source holding
each pattern.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("comm", "kernels", "trace")

# Every torch function that makes a tensor (or, for Generator, a random state bound to a device)
# from sizes or Python data and takes ``device=`` (torch 2.13; test_factory_list_is_complete
# compares it with torch's operator schemas). ``normal`` is a factory only in its ``size`` form.
FACTORIES = frozenset({
    "Generator", "arange", "as_tensor", "asarray", "bartlett_window", "blackman_window", "empty",
    "empty_permuted", "empty_quantized", "empty_strided", "eye", "from_file", "full", "hamming_window",
    "hann_window", "kaiser_window", "linspace", "logspace", "normal", "ones", "rand", "randint", "randn",
    "randperm", "range", "scalar_tensor", "sparse_coo_tensor", "tensor", "tril_indices", "triu_indices",
    "zeros",
})
HOST_ONLY = frozenset({"from_numpy", "frombuffer"})  # no device argument: always host memory
HOST_READS = frozenset({"item", "tolist", "numpy"})
# Tensor methods whose result, turned into a Python bool / int / float, is read by the host.
REDUCTIONS = frozenset({"all", "any", "sum", "max", "min", "amax", "amin", "norm", "mean", "prod",
                        "count_nonzero"})
# torch functions that answer a Python bool, or a tensor the condition of an ``if`` reads.
HOST_ANSWERS = frozenset({"all", "any", "equal", "allclose", "is_nonzero"})


class Finding(NamedTuple):
    file: str  # relative to the repository root
    line: int
    function: str  # qualified name inside the file ("Class.method", "outer.inner"), "<module>" at top
    call: str  # what was called, in the ALLOWED key's spelling

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}: {self.call}"


def _is_cpu_literal(node: ast.AST) -> bool:
    """``"cpu"`` or ``torch.device("cpu")`` written in the source."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value == "cpu" or node.value.startswith("cpu:")
    if isinstance(node, ast.Call) and _dotted(node.func) in ("torch.device", "device") and node.args:
        return _is_cpu_literal(node.args[0])
    return False


def _dotted(node: ast.AST) -> Optional[str]:
    """``a.b.c`` for a chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class _Checker(ast.NodeVisitor):
    def __init__(self, file: str):
        self.file = file
        self.scope: list[str] = []
        self.torch_names = {"torch"}  # names bound to the torch module
        self.torch_functions: dict[str, str] = {}  # local name -> torch function (from torch import x)
        self.findings: list[Finding] = []

    def _add(self, node: ast.AST, call: str) -> None:
        self.findings.append(Finding(self.file, node.lineno, ".".join(self.scope) or "<module>", call))

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "torch":
                self.torch_names.add(alias.asname or "torch")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "torch" and not node.level:
            for alias in node.names:
                self.torch_functions[alias.asname or alias.name] = alias.name

    def _torch_function(self, func: ast.AST) -> Optional[str]:
        """The torch function ``func`` names (``torch.zeros``, ``t.zeros``, an imported ``zeros``)."""
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            return func.attr if func.value.id in self.torch_names else None
        if isinstance(func, ast.Name):
            return self.torch_functions.get(func.id)
        return None

    def _tensor_answer(self, node: ast.AST) -> bool:
        """``node`` computes a tensor the host would have to read: a torch call, or a reduction
        method (``x.max()``, ``(a == b).all()``), under any ``not``."""
        while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            node = node.operand
        if not isinstance(node, ast.Call):
            return False
        name = self._torch_function(node.func)
        if name is not None:
            return True
        return isinstance(node.func, ast.Attribute) and node.func.attr in REDUCTIONS

    def _condition(self, node) -> None:
        test = node.test
        while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test = test.operand
        parts = test.values if isinstance(test, ast.BoolOp) else [test]
        for part in parts:
            if isinstance(part, ast.Call) and self._tensor_answer(part):
                name = self._torch_function(part.func)
                if name is None or name in HOST_ANSWERS:
                    self._add(part, "tensor as a condition")
        self.generic_visit(node)

    visit_If = visit_While = visit_Assert = _condition

    def visit_Call(self, node: ast.Call) -> None:
        keywords = {k.arg: k.value for k in node.keywords if k.arg is not None}
        name = self._torch_function(node.func)
        if name in FACTORIES and "device" not in keywords:
            if name != "normal" or "size" in keywords or len(node.args) >= 3:
                self._add(node, f"torch.{name} without device=")
        elif name in HOST_ONLY:
            self._add(node, f"torch.{name}")
        elif name == "nonzero":
            self._add(node, "torch.nonzero")
        elif name == "where" and len(node.args) == 1 and not node.keywords:
            self._add(node, "torch.where(condition)")
        elif name == "device" and node.args and _is_cpu_literal(node.args[0]):
            self._add(node, 'torch.device("cpu")')
        if "device" in keywords and _is_cpu_literal(keywords["device"]) and name != "device":
            self._add(node, 'device="cpu"')
        converts = isinstance(node.func, ast.Name) and node.func.id in ("bool", "int", "float")
        if converts and len(node.args) == 1 and self._tensor_answer(node.args[0]):
            self._add(node, f"{node.func.id}(tensor)")
        if isinstance(node.func, ast.Attribute) and name is None:
            method = node.func.attr
            if method == "cpu" and not node.args:
                self._add(node, ".cpu()")
            elif method in HOST_READS and not node.args:
                self._add(node, f".{method}()")
            elif method == "nonzero":
                self._add(node, ".nonzero()")
            elif method == "to" and node.args and _is_cpu_literal(node.args[0]):
                self._add(node, '.to("cpu")')
        self.generic_visit(node)


def check_source(source: str, file: str) -> list[Finding]:
    """The findings in one file's source."""
    checker = _Checker(file)
    checker.visit(ast.parse(source, file))
    return checker.findings


def _library_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for folder in LIBRARY for p in (ROOT / folder).rglob("*.py"))


# (file, function, call) -> why the host tensor or host read is right there.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("kernels/attention_varlen.py", "_read_bounds", ".tolist()"):
        "flash_attention_varlen's check of the caller's cu_seqlens (from 0, non-decreasing, ending at the "
        "token counts, within max_seqlen): one read per new pair of tensors, reused while they are unchanged",
    ("comm/compression/adaptive/controller.py", "_probe", "float(tensor)"):
        "the codec probe: timed around explicit device synchronizations, its error read once per probe",
    ("comm/compression/adaptive/controller.py", "_cpu_layout", "float(tensor)"):
        "float of torch.get_num_threads(), a Python int (no tensor is read)",
    ("comm/compression/adaptive/controller.py", "Adaptive._layout_of", "torch.tensor without device="):
        "host identities (Python data), gathered once through the group's device by gather",
    ("comm/compression/adaptive/controller.py", "Adaptive._layout_of", "torch.empty without device="):
        "the host copy of that gather's result, read once per Adaptive",
    ("comm/compression/adaptive/controller.py", "Adaptive._layout_of", ".tolist()"):
        "reads the host copy (no device read): which ranks share a host, once per Adaptive",
    ("comm/compression/adaptive/controller.py", "Adaptive._round", "torch.tensor without device="):
        "the measurement vector is host data (timings, sizes), made once per decision round",
    ("comm/compression/adaptive/controller.py", "Adaptive._round", "torch.empty without device="):
        "the host copy of the round's gathered measurements",
    ("comm/compression/adaptive/controller.py", "Adaptive._round", ".tolist()"):
        "reads the host copy (no device read): every rank's measurements, once per decision round",
    ("comm/compression/adaptive/controller.py", "Adaptive._gather_on_group", ".cpu()"):
        "brings the round's small gathered vector back to the host that decides, once per round",
    ("comm/compression/adaptive/controller.py", "_gather_on", ".cpu()"):
        "brings the round's small gathered vector back to the host that decides, once per round",
    ("comm/compression/compressors.py", "<module>", 'torch.device("cpu")'):
        "residual_for's default: the fused Communicator paths are CPU-only; callers on a device pass it",
    ("comm/compression/compressors.py", "TopK.encode", "bool(tensor)"):
        "CPU tensors only (the branch above it): the flag is already in host memory; devices mask instead",
    ("comm/cp.py", "_Ring.all_gather", ".cpu()"):
        "staged through host memory only where the group cannot carry the tensor's device (device_problem)",
    ("comm/core/group.py", "_row_splits", ".tolist()"):
        "split sizes handed as a tensor: torch's all_to_all_single takes them as host ints",
    ("comm/core/group.py", "ProcessGroupAdapter._issue", ".cpu()"):
        "the one place a device tensor is staged through host memory: the group's backend for it is gloo",
    ("comm/core/group.py", "ProcessGroupAdapter._issue", "torch.empty without device="):
        "the host buffer of that staging, copied back to the caller's device when the call is done",
    ("comm/tp/layers.py", "VocabParallelEmbedding._check_ids", "int(tensor)"):
        "CPU ids only (the branch above it); on a device the check is an assertion the device raises",
    ("comm/core/communicator.py", "_splits", ".tolist()"):
        "split sizes are Python ints the caller chose; a tensor of them is read once per call by contract",
    ("comm/core/communicator.py", "Communicator.empty", "torch.empty without device="):
        "registered buffers are host memory by definition: shared-memory segments the host's ranks map",
    ("comm/core/communicator.py", "_device", 'torch.device("cpu")'):
        "the constructor's default device: the CPU when none is named",
    ("comm/core/communicator.py", "_HostStaging.host", 'device="cpu"'):
        "the fallback path's pinned host buffers for CUDA tensors (no device-to-device path there)",
    ("comm/core/placement.py", "metadata_device", 'torch.device("cpu")'):
        "layout metadata goes through host memory where the group takes CPU tensors (no device round trip)",
    ("comm/core/placement.py", "Placement.__init__", ".tolist()"):
        "the placement, read on the host once per group and kept (MoE: docs/usage/moe.md; the ZeRO "
        "wrapper's hierarchical reduce-scatter: once when the sharded module is built)",
    ("comm/tp/loss.py", "vocab_parallel_cross_entropy", "bool(tensor)"):
        "the check that targets lie in the vocabulary, done for CPU logits only (a CUDA check would "
        "wait for the device; torch's own device asserts cover it there)",
    ("comm/zero/layout.py", "fill", '.to("cpu")'):
        "offload_optimizer: the master shard lives in host memory by design (ZeRO-Offload)",
    ("comm/zero/schedule.py", "Schedule._to_host", "torch.empty without device="):
        "offload_optimizer: the pinned host buffer the reduced gradient streams into",
    ("comm/zero/sharded.py", "ShardedModule.clip_grad_norm_", 'torch.device("cpu")'):
        "offload_optimizer: the shard gradients are host tensors; their partial norm travels to the device",
    ("comm/moe/dispatch.py", "_flat_dispatch", ".tolist()"):
        "dropless/capacity: the counts that size the uneven exchange, one read per hop (docs/usage/moe.md)",
    ("comm/moe/dispatch.py", "dispatch_tokens", ".tolist()"):
        "the same counts across hosts, one read per hop (padded mode never reaches it)",
    ("comm/moe/dispatch.py", "_check_dispatch", ".tolist()"):
        "dispatch()'s range check of the caller's expert_ids, one read (the layer's own path skips it)",
    ("comm/moe/layer.py", "MoE.stats", ".tolist()"):
        "statistics read on request, off the training path",
}


@pytest.mark.parametrize("file", _library_files())
def test_device_discipline(file):
    findings = check_source((ROOT / file).read_text(), file)
    keys = {(f.file, f.function, f.call) for f in findings}
    unexplained = [str(f) for f in findings if (f.file, f.function, f.call) not in ALLOWED]
    stale = [f"{k[1]}: {k[2]}" for k in ALLOWED if k[0] == file and k not in keys]
    assert not unexplained, ("tensors made off the input's device, or host reads of device data, "
                             "without a reason in ALLOWED:\n  " + "\n  ".join(unexplained))
    assert not stale, f"ALLOWED entries of {file} that match nothing (remove them):\n  " + "\n  ".join(stale)


def test_allowed_names_library_files():
    files = set(_library_files())
    assert not [k for k in ALLOWED if k[0] not in files], "ALLOWED names a file the walk does not cover"
    assert all(reason.strip() for reason in ALLOWED.values())


_SYNTHETIC = '''
import torch
import torch as th
from torch import zeros as z, arange


def bad(x):
    a = torch.empty(3)  # flag: torch.empty without device=
    b = th.ones(2, dtype=torch.float32)  # flag: torch.ones without device=
    c = z(4)  # flag: torch.zeros without device=
    d = arange(5)  # flag: torch.arange without device=
    e = torch.tensor([1, 2])  # flag: torch.tensor without device=
    f = torch.normal(0.0, 1.0, size=(3,))  # flag: torch.normal without device=
    g = torch.Generator()  # flag: torch.Generator without device=
    h = x.cpu()  # flag: .cpu()
    i = x.sum().item()  # flag: .item()
    j = x.tolist()  # flag: .tolist()
    k = x.numpy()  # flag: .numpy()
    m = torch.nonzero(x)  # flag: torch.nonzero
    n = x.nonzero(as_tuple=True)  # flag: .nonzero()
    o = x.to("cpu")  # flag: .to("cpu")
    p = torch.device("cpu")  # flag: torch.device("cpu")
    q = torch.zeros(2, device="cpu")  # flag: device="cpu"
    r = torch.where(x > 0)  # flag: torch.where(condition)
    s = torch.from_numpy(k)  # flag: torch.from_numpy
    t = int(x.max())  # flag: int(tensor)
    u = float(torch.linalg.norm(x))  # flag: float(tensor)
    if not (x > 0).all():  # flag: tensor as a condition
        pass
    assert torch.equal(x, x)  # flag: tensor as a condition
    return a, b, c, d, e, f, g, h, i, j, m, n, o, p, q, r, s, t, u


class Layer:
    def forward(self, x):
        def inner():
            return torch.randn(2)  # flag: torch.randn without device=
        return inner()


def good(x):
    a = torch.empty(3, device=x.device)
    b = torch.zeros_like(x)
    c = x.new_zeros(4)
    d = torch.normal(x, 1.0)
    e = torch.where(x > 0, x, 0)
    f = x.to(x.device)
    g = torch.nonzero_static(x, size=4)
    h = torch.arange(5, device=x.device, dtype=torch.int64)
    i = int(x.shape[0])
    j = float(len(x))
    if x.is_cuda and x.numel():
        pass
    return a, b, c, d, e, f, g, h, i, j
'''


def test_checker_flags_each_pattern():
    """The checker on a source holding each pattern once (each flagged line says what it must be
    flagged for), and look-alikes it must leave alone."""
    found = [(f.line, f.call) for f in check_source(_SYNTHETIC, "synthetic.py")]
    expected = [(i, line.split("# flag: ")[1]) for i, line in enumerate(_SYNTHETIC.splitlines(), 1)
                if "# flag: " in line]
    assert found == expected
    functions = {f.function for f in check_source(_SYNTHETIC, "synthetic.py")}
    assert functions == {"bad", "Layer.forward.inner"}


def test_failure_names_file_line_and_call():
    (finding,) = check_source("import torch\n\n\ndef f():\n    return torch.ones(2)\n", "comm/x.py")
    assert str(finding) == "comm/x.py:5 in f: torch.ones without device="


def test_factory_list_is_complete():
    """Every torch function whose operator schema makes a tensor from sizes or data and takes a
    device is in FACTORIES (a torch upgrade that adds one fails here, not silently)."""
    from_schemas = set()
    for name in dir(torch):
        if name.startswith("_") or name.endswith("_like"):
            continue
        for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
            takes_device = any(a.name == "device" for a in schema.arguments)
            tensor_positionals = [a for a in schema.arguments if not a.kwarg_only and "Tensor" in str(a.type)]
            if takes_device and not tensor_positionals:
                from_schemas.add(name)
    assert from_schemas <= FACTORIES, sorted(from_schemas - FACTORIES)
