"""A picture of the run: training and validation loss, drawn to a PNG in the run directory.

People judge a run by its curves, not by a CSV. `LossPlot` collects the losses as Lightning logs them -
the training loss at every logging step (`trainer.log_every_n_steps`, when the loggers read it anyway, so
collecting adds no host sync) and the validation loss after each validation - and rank 0 draws both
against the optimizer step at the end of training (also when a run stops early, e.g. on a SLURM
requeue), in `on_fit_end`: Lightning calls it after every callback's `on_train_end`, where the checkpoint
callbacks (which it runs last) save the final step, so a plot that fails at the end never costs the run
its last checkpoint. The series are part of the callback's checkpoint state, so after `ckpt_path=...`
the curve continues the earlier command's. matplotlib draws with its file-only Agg backend (no display
needed).

matplotlib is an optional package, needed only at the very end: the constructor imports it (and the Agg
backend) so that an environment without it fails when the callback is built - before any process
starts, in `recipes.config.validation` - never after a whole run has trained (`require_matplotlib`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from recipes.training.throughput import is_logged_step

Series = list[list[float]]
"""[[step, value], ...]: plain lists, so a checkpoint holding them loads with `weights_only=True`."""

TRAIN_COLOR = "#1f77b4"
VAL_COLOR = "#ff7f0e"


def require_matplotlib() -> None:
    """Import matplotlib and its Agg backend now, as `draw_losses` will at the end of training.

    Raises:
        ModuleNotFoundError: matplotlib (or its Agg backend) cannot be imported, naming the package.
    """
    try:
        import matplotlib.backends.backend_agg  # noqa: F401  (what `draw_losses` draws with)
    except ImportError as error:
        raise ModuleNotFoundError(
            f"LossPlot draws the loss curves with matplotlib (in the `recipes` extra), which cannot be "
            f"imported here ({error})",
            name="matplotlib",
        ) from error


def draw_losses(train: Series, val: Series, path: Path, title: str = "") -> None:
    """Write a PNG of the two loss curves (training: a line; validation: a line with markers) to `path`."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=100)
    try:
        if train:
            axes.plot(*zip(*train, strict=True), color=TRAIN_COLOR, linewidth=1.5, label="train/loss")
        if val:
            axes.plot(*zip(*val, strict=True), "o-", color=VAL_COLOR, linewidth=1.5, label="val/loss")
        axes.set_xlabel("optimizer step")
        axes.set_ylabel("cross-entropy (nats per token)")
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)


class LossPlot(Callback):
    """Collects `train_key` and `val_key` as logged; rank 0 writes the PNG at the end of training.

    Args:
        path: the PNG to write; None: `loss.png` in the trainer's `default_root_dir`.
        train_key: the logged training loss.
        val_key: the logged validation loss.

    Raises:
        ModuleNotFoundError: matplotlib cannot be imported (checked here, not when training ends).
    """

    reads_parameters_between_steps = False  # ZeroStrategy's overlapped gathers need not wait for it

    def __init__(
        self, path: str | None = None, train_key: str = "train/loss", val_key: str = "val/loss"
    ) -> None:
        require_matplotlib()
        self.path = path
        self.train_key = train_key
        self.val_key = val_key
        self.train: Series = []
        self.val: Series = []
        self.written: Path | None = None
        """The PNG written at the end of the last fit (rank 0), for the run's report."""

    def _append(self, trainer: pl.Trainer, series: Series, key: str) -> None:
        value = trainer.callback_metrics.get(key)
        if value is not None:
            series.append([trainer.global_step, float(value)])

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero and is_logged_step(trainer, batch_idx):  # the loss is read then anyway
            self._append(trainer, self.train, self.train_key)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking and trainer.state.fn == "fit":
            self._append(trainer, self.val, self.val_key)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:  # after the checkpoint callbacks' final save (see the module docstring)
            path = Path(self.path) if self.path else Path(trainer.default_root_dir) / "loss.png"
            draw_losses(self.train, self.val, path, title=Path(trainer.default_root_dir).name)
            self.written = path

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"train": self.train, "val": self.val}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train = [list(point) for point in state_dict.get("train", [])]
        self.val = [list(point) for point in state_dict.get("val", [])]
