"""What sharded checkpoints cannot honour is refused before any work, never accepted and ignored:
a ``CheckpointIO`` plugin other than the default (sharded files are written by every rank with
``torch.save``), ``storage_options``, and a URL that would become a local path (``s3://b/r`` ->
``s3:/b/r``). ``file://`` URLs are local paths. With ``sharded_checkpoint=False`` the plugin is used."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_zero.integrations.arguments import check_sharded_path, local_path

ROOT = Path(__file__).resolve().parents[2]


class CustomIO(TorchCheckpointIO):
    """A user's plugin (e.g. one that uploads to object storage)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        raise AssertionError("not reached in these tests")


@pytest.mark.parametrize("strategy", ["ZeroStrategy", "ZeroFabricStrategy"])
def test_a_custom_checkpoint_io_is_refused_for_sharded_checkpoints(strategy: str) -> None:
    import lightning_zero

    cls = getattr(lightning_zero, strategy)
    with pytest.raises(ValueError, match="checkpoint_io=CustomIO is not used by sharded checkpoints"):
        cls(checkpoint_io=CustomIO())
    assert cls(checkpoint_io=CustomIO(), sharded_checkpoint=False).checkpoint_io.__class__ is CustomIO
    cls(checkpoint_io=TorchCheckpointIO())  # the default plugin is what sharded saves do anyway


def test_a_url_is_refused_and_a_file_url_is_a_path() -> None:
    for url in ("s3://bucket/run/last.ckpt", "gs://b/x", "memory://ckpt"):
        with pytest.raises(ValueError, match="written to a local or shared file system path, got the URL"):
            check_sharded_path(url)
    check_sharded_path("file:///tmp/run/last.ckpt")
    assert local_path("file:///tmp/run/last.ckpt") == "/tmp/run/last.ckpt"
    assert local_path(Path("/tmp/run")) == Path("/tmp/run")


FIT = """
import sys
import torch
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_zero import ZeroStrategy

class Model(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        assert False, "training started"

def fit(**kwargs):
    args = dict(strategy=ZeroStrategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[1])
    args.update(kwargs)
    try:
        pl.Trainer(**args).fit(Model())
    except ValueError as err:
        return str(err)
    return "no error"

print("PLUGIN:", fit(plugins=[AsyncCheckpointIO()]))
print("URL:", fit(callbacks=[ModelCheckpoint(dirpath="memory://bucket/run")]))
"""


def test_a_fit_refuses_an_io_plugin_and_a_url_before_training(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FIT), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert "PLUGIN: ZeroStrategy: checkpoint_io=AsyncCheckpointIO is not used by sharded" in out, (
        out + result.stderr
    )
    assert "URL: sharded checkpoints are written to a local or shared file system path, got the URL" in out, (
        out + result.stderr
    )
    assert "training started" not in out + result.stderr
