"""``import lightning_zero`` does not import Lightning, yet registers the strategies once Lightning is
imported, in either order (:mod:`lightning_zero.integrations.autoregister`). Fresh interpreters."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHECK_REGISTERED = """
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
import lightning.pytorch as pl
import lightning.pytorch.core.saving as saving
# read the registries before touching lightning_zero's lazy names (importing those registers too)
for name, stage in (("zero", 2), ("zero1", 1), ("zero2", 2)):
    assert StrategyRegistry[name]["strategy"].__name__ == "ZeroStrategy", name
    assert StrategyRegistry[name]["init_params"] == {"stage": stage}, name
    assert STRATEGY_REGISTRY[name]["strategy"].__name__ == "ZeroFabricStrategy", name
assert getattr(saving.pl_load, "_lightning_zero_loader", False), "load_from_checkpoint not routed"
trainer = pl.Trainer(strategy="zero1", accelerator="cpu", devices=1, logger=False)
from lightning_zero import ZeroFabricStrategy, ZeroStrategy
assert type(trainer.strategy) is ZeroStrategy and trainer.strategy.zero_config.stage == 1
assert STRATEGY_REGISTRY["zero"]["strategy"] is ZeroFabricStrategy
"""


def _run(code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error:lightning-zero could not register", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_standalone_optimizer_does_not_import_lightning_and_the_strategies_register_after() -> None:
    standalone = """
        import sys
        import torch
        import lightning_zero
        from lightning_zero import ShardedAdamW, ZeroConfig
        model = torch.nn.Linear(4, 2)
        opt = ShardedAdamW(model.parameters(), lr=0.1, config=ZeroConfig(stage=1))
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
        assert not loaded, loaded
        """
    _run(textwrap.dedent(standalone) + CHECK_REGISTERED)


def test_the_strategies_register_at_once_when_lightning_came_first() -> None:
    _run("import lightning.pytorch\nimport lightning.fabric\nimport lightning_zero\n" + CHECK_REGISTERED)


def test_the_strategy_modules_register_when_imported_first() -> None:
    """``from lightning_zero import ZeroStrategy`` imports Lightning from inside the strategy module:
    the registration must still happen (at the module's end), not fail on the half-imported module."""
    _run("from lightning_zero import ZeroStrategy\n" + CHECK_REGISTERED)
    _run("from lightning_zero import ZeroFabricStrategy\n" + CHECK_REGISTERED)


def test_the_communication_package_imported_before_torch_prepares_torch_too() -> None:
    """``import lightning_zero.comm`` imports torch from inside ``comm/backends.py``: autoregister's
    step after torch's import must not fail on the half-imported module (it warned "could not ...
    prepare after torch"), and torch.distributed.nn is imported before any process group exists."""
    _run("import sys\nimport lightning_zero.comm\nassert 'torch.distributed.nn' in sys.modules\n")


PROCESS_GROUP_FREED = """
import sys, tempfile
import torch.distributed as dist
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
group = dist.distributed_c10d._get_default_group()
from lightning_zero import ShardedAdamW, ZeroConfig  # the engine's first import: after the group exists
model = torch.nn.Linear(4, 2)
opt = ShardedAdamW(model.parameters(), lr=0.1, config=ZeroConfig(stage=3), module=model)
model(torch.ones(3, 4)).sum().backward()
opt.step()
dist.destroy_process_group()
held = sys.getrefcount(group) - 2  # less this name and the call's argument
assert held == 0, f"{held} references keep the destroyed world group (and gloo's threads) alive"
"""


@pytest.mark.parametrize("first", ["torch", "lightning_zero"])
def test_a_destroyed_process_group_is_freed_when_the_engine_is_imported_after_it(first: str) -> None:
    """torch.distributed.nn captures the world group in default arguments when imported after
    init_process_group (our engine imports it, through torch._dynamo): the group then outlives
    destroy_process_group and gloo's threads can abort the exit. Imported with torch, it cannot."""
    order = ["torch", "lightning_zero"] if first == "torch" else ["lightning_zero", "torch"]
    _run("".join(f"import {name}\n" for name in order) + PROCESS_GROUP_FREED)
