"""The "With your trainer" recipes (docs/usage/communicator.md), run as their programs run under torchrun.

Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...)
and meets the others through the env:// rendezvous, as a launched script does. Every recipe trains
the same model on gloo and on braid from the same weights and batches and compares the parameters
bitwise: at two ranks both backends sum the same two terms, and the rest is the framework's own
arithmetic, so any difference is a wrong reduction. DeviceMesh and the plain script need only
torch and run in CI; Lightning and accelerate are not in requirements-dev.txt, and their tests are
skipped where the package is missing.
"""
from __future__ import annotations

import copy
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from helpers import SmallMLP
from helpers.ranks import STORE_TIMEOUT, FreshRanks, environment, listen_ports, run_ranks


def _torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun sets for a rank of a single-host job (Lightning recognises a launched
    process by RANK, GROUP_RANK, LOCAL_RANK and LOCAL_WORLD_SIZE)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size)}


def _batches(rank: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [torch.randn(8, 12, generator=g) for _ in range(steps)]


def _train(model: torch.nn.Module, rank: int, steps: int = 3) -> list[torch.Tensor]:
    """SGD with momentum on this rank's batches; the parameters after the last step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x in _batches(rank, steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _device_mesh(rank: int, world_size: int, store_path: str, ports: list[int]) -> dict[str, Any]:
    """init_device_mesh alone makes a gloo default group (torch maps "cpu" to gloo, and importing
    braid.comm does not change that); after init_process_group("braid") the mesh is braid's, and
    FSDP2 and DTensor tensor parallelism on it end bitwise where they end on the gloo mesh. The gloo
    group init_device_mesh makes has torch's default timeout: run_ranks' deadline bounds it here."""
    from braid import comm  # noqa: F401  (registers "braid")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def run_both(mesh) -> dict[str, list[torch.Tensor]]:
        torch.manual_seed(0)
        base = SmallMLP()
        start = [p.detach().clone() for p in base.parameters()]
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        tp = parallelize_module(copy.deepcopy(base), mesh, plan)
        trained = {"fsdp2": _train(fully_shard(base, mesh=mesh), rank),
                   "tp": _train(tp, 0)}  # TP ranks hold slices of one model: the same batches
        assert not _equal(trained["fsdp2"], start), "the model did not train"
        return trained

    out: dict[str, Any] = {}
    with environment(_torchrun_env(rank, world_size, ports[0])):
        mesh = init_device_mesh("cpu", (world_size,))
        out["alone"] = dist.get_backend_config(mesh.get_group())
        gloo = run_both(mesh)
        dist.destroy_process_group()
    with environment(_torchrun_env(rank, world_size, ports[1])):
        dist.init_process_group("braid", timeout=STORE_TIMEOUT)
        mesh = init_device_mesh("cpu", (world_size,))
        out["after"] = dist.get_backend_config(mesh.get_group())
        braid = run_both(mesh)
        dist.destroy_process_group()
    out["equal"] = {name: _equal(braid[name], gloo[name]) for name in gloo}
    return out


def _script(rank: int, world_size: int, store_path: str, ports: list[int]) -> bool:
    """A nanoGPT-style script: init_process_group(backend=backend) from torchrun's environment,
    then DDP(model); with backend="braid" (braid.comm imported) it trains as with "gloo"."""
    from braid import comm  # noqa: F401  (registers "braid")
    from torch.nn.parallel import DistributedDataParallel as DDP

    trained = {}
    for backend, port in zip(("gloo", "braid"), ports):
        with environment(_torchrun_env(rank, world_size, port)):
            dist.init_process_group(backend=backend, timeout=STORE_TIMEOUT)
            assert dist.get_backend() == backend
            torch.manual_seed(0)
            trained[backend] = _train(DDP(SmallMLP()), rank)
            dist.destroy_process_group()
    return _equal(trained["braid"], trained["gloo"])


def _in_fresh_ranks(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn`` on new processes: Lightning and accelerate keep process-wide state (accelerate's
    PartialState is a singleton) that must not reach a pooled worker's next call."""
    with FreshRanks(world_size) as ranks:
        ranks.start(fn, *args)
        outcomes = ranks.outcomes()
    failed = {r: o for r, o in outcomes.items() if o[0] != "ok"}
    assert not failed, "\n".join(f"rank {r}: {kind}\n{value}" for r, (kind, value) in failed.items())
    return [outcomes[r][1] for r in range(world_size)]


def _lightning(rank: int, world_size: int, store_path: str, ports: list[int]) -> dict[str, Any]:
    """Lightning's DDPStrategy on gloo, then on braid, braid's int8 hook registered in on_fit_start
    (on CPU Lightning ignores DDPStrategy(ddp_comm_hook=...): it registers hooks on CUDA only)."""
    import lightning as L
    from braid import comm  # noqa: F401  (registers "braid")
    from braid.comm import ddp
    from lightning.pytorch.strategies import DDPStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = SmallMLP()
            self.hook_state = None

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return self.net(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def on_fit_start(self) -> None:
            self.hook_state, hook = ddp.comm_hook(None, "int8", min_compress_bytes=0)
            self.trainer.strategy.model.register_comm_hook(self.hook_state, hook)

    data = torch.randn(64, 12, generator=torch.Generator().manual_seed(5))
    runs = {}
    for backend, port in zip(("gloo", "braid"), ports):
        module = Module()
        with environment(_torchrun_env(rank, world_size, port)), tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(accelerator="cpu", devices=world_size, num_nodes=1, max_steps=4,
                                strategy=DDPStrategy(process_group_backend=backend, timeout=STORE_TIMEOUT),
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=root)
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
            runs[backend] = {"backend": dist.get_backend(),
                             "params": [p.detach().clone() for p in module.parameters()],
                             "sent": module.hook_state.compression.wire_total.sent}
            dist.destroy_process_group()
    return runs


def _accelerate(rank: int, world_size: int, store_path: str, port: int, backend: str) -> dict[str, Any]:
    """accelerate's Accelerator on ``backend``. On CPU (``cpu=True``: without it, under torchrun on
    a machine without a GPU, accelerate does not distribute) it refuses any backend but gloo
    (InitProcessGroupKwargs(backend="braid") raises ValueError) and adopts a default group made
    before it."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from braid import comm  # noqa: F401  (registers "braid")

    with environment(_torchrun_env(rank, world_size, port)):
        if backend == "braid":
            dist.init_process_group("braid", timeout=STORE_TIMEOUT)
        acc = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=STORE_TIMEOUT)])
        used = dist.get_backend()
        torch.manual_seed(0)
        model = SmallMLP()
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for x in _batches(rank, 3):
            opt.zero_grad()
            acc.backward(model(x).square().mean())
            opt.step()
        params = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
        dist.destroy_process_group()
    return {"backend": used, "params": params}


def test_device_mesh_after_init_process_group_braid():
    """DeviceMesh and DTensor: init_process_group("braid") first, then init_device_mesh("cpu", ...)."""
    results = run_ranks(_device_mesh, 2, listen_ports(2))
    for r in results:
        assert r["alone"] == "cpu:gloo", r
        assert r["after"] == "cpu:braid", r
        assert r["equal"] == {"fsdp2": True, "tp": True}, r


def test_script_with_backend_braid():
    """A script that takes its backend by name: backend="braid" once braid.comm is imported."""
    assert run_ranks(_script, 2, listen_ports(2)) == [True, True]


@pytest.mark.slow
def test_lightning_ddp_strategy_on_braid():
    """Lightning: DDPStrategy(process_group_backend="braid") after importing braid.comm, and a
    comm hook registered in on_fit_start; bitwise the same run on gloo, the hook compressing."""
    pytest.importorskip("lightning")
    for runs in _in_fresh_ranks(_lightning, 2, listen_ports(2)):
        braid, gloo = runs["braid"], runs["gloo"]
        assert (braid["backend"], gloo["backend"]) == ("braid", "gloo")
        assert _equal(braid["params"], gloo["params"])
        assert braid["sent"] == gloo["sent"] > 0


@pytest.mark.slow
def test_accelerate_adopts_a_braid_group():
    """accelerate: init_process_group("braid") before Accelerator; bitwise the same run on gloo."""
    pytest.importorskip("accelerate")
    runs = {backend: _in_fresh_ranks(_accelerate, 2, port, backend)
            for backend, port in zip(("gloo", "braid"), listen_ports(2))}
    for rank in range(2):
        braid, gloo = runs["braid"][rank], runs["gloo"][rank]
        assert (braid["backend"], gloo["backend"]) == ("braid", "gloo")
        assert _equal(braid["params"], gloo["params"])
