"""Weight averaging: the update equals ``AveragedModel.update_parameters``; Lightning's
``WeightAveraging`` under ``"zero"`` writes and reads a standard checkpoint file as under ``"ddp"``
(``sharded_checkpoint=False``; a file written by ``"ddp"`` resumes under ``"zero"``); two averaging
callbacks are refused before training. (Sharded runs against ``"ddp"``: the conformance cases
``ema_*``/``swa_weight_averaging_buffers``; the shards against ``AveragedModel``:
``tests/distributed/test_weight_average.py``.)"""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from lightning_zero.engine.averaging import average_into
from tests.launch import run_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"avg_fn": get_ema_avg_fn(0.9)}, {"multi_avg_fn": get_ema_multi_avg_fn(0.7)}],
    ids=["swa", "ema", "ema_multi"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_average_into_is_averaged_models_update(kwargs: dict[str, Any], dtype: torch.dtype) -> None:
    """Parameters and buffers (an integer one too) after 4 updates, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).to(dtype)
    reference = AveragedModel(model, use_buffers=True, **kwargs)
    mine = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    for n in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(5, 4, dtype=dtype))  # running statistics and num_batches_tracked move
        reference.update_parameters(model)
        average_into(mine, [*model.parameters(), *model.buffers()], n, **kwargs)
    expected = [*reference.module.parameters(), *reference.module.buffers()]
    assert len(mine) == len(expected)
    for a, b in zip(mine, expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_average_into_refuses_two_functions() -> None:
    with pytest.raises(ValueError, match="avg_fn or multi_avg_fn, not both"):
        average_into([torch.zeros(1)], [torch.ones(1)], 1, get_ema_avg_fn(), get_ema_multi_avg_fn())


SCRIPT = """
import sys
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_zero import ZeroStrategy

class Model(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

def fit(strategy, root, steps, callbacks, ckpt_path=None):
    torch.manual_seed(0)
    model = Model()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                         val_check_interval=2, default_root_dir=root, callbacks=callbacks)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model

root = sys.argv[1]
if sys.argv[2] == "two":
    try:
        fit("zero", root, 1, [EMAWeightAveraging(), WeightAveraging()])
    except ValueError as err:
        print("REFUSED:", err)
    sys.exit(0)
if sys.argv[2] == "reseed":  # a file without an average: the average starts from its weights
    fit("ddp", f"{root}/plain", 3, [ModelCheckpoint(dirpath=f"{root}/plain", save_last=True)])
    for name in ("ddp", "zero"):  # no update before step 100: the end copies the re-seeded average
        model = fit(name, f"{root}/{name}", 5, [EMAWeightAveraging(update_starting_at_step=100)],
                    ckpt_path=f"{root}/plain/last.ckpt")
        torch.save(model.state_dict(), f"{root}/reseed-{name}.pt")
    print("DONE")
    sys.exit(0)
if sys.argv[2] == "again":  # the callback from configure_callbacks, validate then fit: one stand-in
    class WithCallback(Model):
        def configure_callbacks(self):
            return [EMAWeightAveraging(decay=0.5)]
    torch.manual_seed(0)
    model = WithCallback()
    trainer = pl.Trainer(strategy="zero", accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.validate(model, verbose=False)
    trainer.fit(model)
    print("AFTER:", sorted(type(c).__name__ for c in trainer.callbacks if "Averaging" in type(c).__name__))
    sys.exit(0)
for name, strategy in (("ddp", "ddp"), ("zero", ZeroStrategy(sharded_checkpoint=False))):
    model = fit(strategy, f"{root}/{name}", 4, [EMAWeightAveraging(decay=0.5),
                ModelCheckpoint(dirpath=f"{root}/{name}", save_last=True)])
    torch.save(model.state_dict(), f"{root}/{name}-final.pt")
# a file "ddp" wrote, resumed under "zero" (and under "ddp") for 2 more steps
for name, strategy in (("ddp", "ddp"), ("zero", ZeroStrategy(sharded_checkpoint=False))):
    model = fit(strategy, f"{root}/resumed-{name}", 6, [EMAWeightAveraging(decay=0.5)],
                ckpt_path=f"{root}/ddp/last.ckpt")
    torch.save(model.state_dict(), f"{root}/resumed-{name}.pt")
print("DONE")
"""


def _run(tmp_path: Path, what: str) -> str:
    """SCRIPT in a process of its own (a warm interpreter's fork: ``tests/zygote.py``)."""
    script = tmp_path / "averaging.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result = run_script([sys.executable, str(script), str(tmp_path), what], 1, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _same(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=1e-6), (where, key)


def test_a_standard_file_has_weight_averagings_layout_and_resumes_across_strategies(tmp_path: Path) -> None:
    assert "DONE" in _run(tmp_path, "files")
    ddp = torch.load(tmp_path / "ddp" / "last.ckpt", weights_only=True)
    zero = torch.load(tmp_path / "zero" / "last.ckpt", weights_only=True)
    for key in ("state_dict", "current_model_state", "averaging_state"):
        _same(zero[key], ddp[key], key)
    assert any(
        not torch.equal(ddp["state_dict"][k], ddp["current_model_state"][k]) for k in ddp["state_dict"]
    )
    _same(torch.load(tmp_path / "zero-final.pt"), torch.load(tmp_path / "ddp-final.pt"), "final")
    resumed = torch.load(tmp_path / "resumed-zero.pt")
    _same(resumed, torch.load(tmp_path / "resumed-ddp.pt"), "resumed from a ddp file")
    assert any(not torch.equal(resumed[k], ddp["state_dict"][k]) for k in resumed)  # it trained on


def test_a_file_without_an_average_starts_it_from_its_weights(tmp_path: Path) -> None:
    """Resumed with the callback from a standard file written without one: the average starts at the
    loaded weights (not at the model's initialization), as under "ddp"; with no update before the
    end, the end copies exactly those."""
    assert "DONE" in _run(tmp_path, "reseed")
    zero, ddp = torch.load(tmp_path / "reseed-zero.pt"), torch.load(tmp_path / "reseed-ddp.pt")
    _same(zero, ddp, "re-seeded average")


def test_the_users_callback_is_back_after_each_run(tmp_path: Path) -> None:
    """validate, then fit, with the callback from ``configure_callbacks``: the stand-in is replaced by
    the user's callback at teardown, so the next run replaces it once (no "2 callbacks")."""
    out = _run(tmp_path, "again")
    assert "AFTER: ['EMAWeightAveraging']" in out, out


def test_a_subclass_overriding_a_hook_is_refused() -> None:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_zero.integrations.trainer.weight_averaging import ShardedWeightAveraging

    class Swaps(EMAWeightAveraging):
        def _swap_models(self, pl_module: Any) -> None:
            pass

        def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
            return True

    with pytest.raises(ValueError, match=r"Swaps overrides \['_swap_models'\].*only should_update"):
        ShardedWeightAveraging(Swaps(), lambda: None, lambda: True)


def test_two_weight_averaging_callbacks_are_refused_before_training(tmp_path: Path) -> None:
    out = _run(tmp_path, "two")
    assert "REFUSED: 2 WeightAveraging callbacks were given" in out, out


def test_the_callback_keeps_the_users_schedule_and_state_key() -> None:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_zero.integrations.trainer.weight_averaging import replace_weight_averaging

    user = EMAWeightAveraging(decay=0.5, update_starting_at_step=3)
    callbacks: list[Any] = [copy.copy(user)]
    replaced = replace_weight_averaging(callbacks, lambda: None, lambda: True)
    assert replaced == callbacks and replaced[0].state_key == user.state_key
    assert replaced[0].user.should_update(step_idx=2) is False and replaced[0].user.should_update(step_idx=3)
    assert replace_weight_averaging(callbacks, lambda: None, lambda: True) == replaced  # idempotent
