"""What trains: the model, the LightningModule, and the callbacks the recipe adds to Lightning's.

* `model` - the decoder-only transformer (`GPT`, `GPTConfig`); never imports `torch.distributed`;
* `module` - `PretrainModule` (loss, perplexity, AdamW with warmup and cosine decay; `OptimConfig`);
* `callbacks` - one checkpoint series per run (`RunCheckpoint`), SLURM requeue (`SlurmRequeue`: before a
  time limit, and after a peer failure, `peer_failure`, exit status `EXIT_PEER_FAILURE`), the tokenizer
  copied into the run directory (`TokenizerCopy`);
* `lineage` - which checkpoint of a run's series is complete and newest (what a resume continues);
* `throughput`, `progress`, `plot` - tokens/s and MFU, the progress bar, the loss curves;
* `trace` - a Chrome trace of a few training steps per rank (`StepTrace`, `callbacks=trace`).

Nothing here knows Hydra or the data's source: `recipes.config` builds these objects from the config,
`recipes.checkpoints` reads their checkpoints back. Other packages import these names from
`recipes.training`; modules inside the package import their siblings.
"""

from __future__ import annotations

from recipes.training.callbacks import (
    EXIT_PEER_FAILURE,
    RunCheckpoint,
    SlurmRequeue,
    StopAgreement,
    TokenizerCopy,
    peer_failure,
    requeued_resume_path,
)
from recipes.training.lineage import is_complete, newest_checkpoint
from recipes.training.model import GPT, GPTConfig
from recipes.training.module import OptimConfig, PretrainModule
from recipes.training.plot import LossPlot
from recipes.training.progress import RefreshProgressBar
from recipes.training.throughput import TokenThroughput
from recipes.training.trace import StepTrace

__all__ = [
    "EXIT_PEER_FAILURE",
    "GPT",
    "GPTConfig",
    "LossPlot",
    "OptimConfig",
    "PretrainModule",
    "RefreshProgressBar",
    "RunCheckpoint",
    "SlurmRequeue",
    "StepTrace",
    "StopAgreement",
    "TokenThroughput",
    "TokenizerCopy",
    "is_complete",
    "newest_checkpoint",
    "peer_failure",
    "requeued_resume_path",
]
