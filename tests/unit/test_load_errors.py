"""Issue 39, item 6: what a user sees when a model cannot be initialized from the meta device, or a
checkpoint directory has no ``meta.pt`` (an interrupted save, an empty directory): the package's own
error, on every path, as the last thing raised. Before, the ``DeferredInitError`` was masked by the
strategy's teardown (``NotImplementedError: Cannot copy out of meta tensor``), and a directory without
``meta.pt`` reached Lightning's loader (``IsADirectoryError``). One process, ``devices=1``, run as a
script (a Trainer inside the pytest process would keep its state for the tests after it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.launch import launch_env

SCRIPT = r"""
import sys, tempfile
import lightning as L, torch
import lightning_zero
from lightning.pytorch.demos.boring_classes import BoringModel

empty = tempfile.mkdtemp()

class Raw(torch.nn.Module):  # a tensor on the meta device and no reset_parameters(): cannot be replayed
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(32))

class Adam(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

class Model(Adam):
    def __init__(self):
        super().__init__()
        self.raw = Raw()

def trainer(stage="zero3"):
    return L.Trainer(strategy=stage, accelerator="cpu", devices=1, max_steps=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=empty)

def outcome(call):
    try:
        call()
    except BaseException as error:  # the last exception the user sees
        return f"{type(error).__name__}: {str(error).splitlines()[0][:400]}"
    return "no error"

t = trainer()
with t.init_module(empty_init=True):
    meta = Model()
print("DEFERRED:", outcome(lambda: t.fit(meta)))
print("FIT:", outcome(lambda: trainer().fit(Adam(), ckpt_path=empty)))
print("VALIDATE:", outcome(lambda: trainer("zero").validate(Adam(), ckpt_path=empty)))
print("LOAD:", outcome(lambda: Adam.load_from_checkpoint(empty)))
fabric = L.Fabric(strategy="zero", accelerator="cpu", devices=1)
fabric.launch()
module = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(module.parameters())
module, optimizer = fabric.setup(module, optimizer)
print("FABRIC:", outcome(lambda: fabric.load(empty, {"model": module, "optimizer": optimizer})))
print("FABRIC_RAW:", outcome(lambda: fabric.load_raw(empty, torch.nn.Linear(4, 4))))
"""


def test_the_package_s_own_error_is_the_last_one_raised(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert done.returncode == 0, done.stderr[-3000:]
    assert lines["DEFERRED"].startswith("DeferredInitError: "), lines["DEFERRED"]
    assert "raw (Raw: scale)" in lines["DEFERRED"]
    for key in ("FIT", "VALIDATE", "LOAD", "FABRIC", "FABRIC_RAW"):
        assert lines[key].startswith("CheckpointError: ") and "meta.pt does not exist" in lines[key], (
            key,
            lines[key],
        )
