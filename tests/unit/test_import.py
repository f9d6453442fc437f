"""``import lightning_zero`` does not import Lightning, yet registers the strategies once Lightning is
imported, in either order (:mod:`lightning_zero.integrations.autoregister`). Fresh interpreters."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK_REGISTERED = """
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
import lightning.pytorch.core.saving as saving
from lightning_zero import ZeroFabricStrategy, ZeroStrategy
for name, stage in (("zero", 2), ("zero1", 1), ("zero2", 2)):
    assert StrategyRegistry[name]["strategy"] is ZeroStrategy, name
    assert StrategyRegistry[name]["init_params"] == {"stage": stage}, name
    assert STRATEGY_REGISTRY[name]["strategy"] is ZeroFabricStrategy, name
assert getattr(saving.pl_load, "_lightning_zero_loader", False), "load_from_checkpoint not routed"
import lightning.pytorch as pl
trainer = pl.Trainer(strategy="zero1", accelerator="cpu", devices=1, logger=False)
assert type(trainer.strategy) is ZeroStrategy and trainer.strategy.zero_config.stage == 1
"""


def _run(code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_standalone_optimizer_does_not_import_lightning_and_the_strategies_register_after() -> None:
    _run(
        """
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
        + CHECK_REGISTERED
    )


def test_the_strategies_register_at_once_when_lightning_came_first() -> None:
    _run("import lightning.pytorch\nimport lightning.fabric\nimport lightning_zero\n" + CHECK_REGISTERED)


def test_importing_only_fabric_registers_the_fabric_strategy() -> None:
    _run(
        """
        import sys
        import lightning_zero
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        assert "zero" in STRATEGY_REGISTRY and "zero1" in STRATEGY_REGISTRY
        """
    )
