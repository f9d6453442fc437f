"""Reading a trained run back: its checkpoint, module and tokenizer, its loss, a Hugging Face copy.

* `locate` - which checkpoint and run config a path means (a run directory: its newest complete one);
* `load` - the `PretrainModule` of a checkpoint (file or sharded directory) and the tokenizer it was
  trained with (`LoadError`);
* `evaluation` - loss and perplexity of a checkpoint on a split of its data, after every check;
* `hf` - the conversion to a `transformers` Llama directory (`ExportError`);
* `cli` - the `key=value` argument style of the commands.

The commands `recipes.export`, `recipes.generate` and `recipes.evaluate` are thin over these names,
which other packages import from `recipes.checkpoints`; modules inside import their siblings. Builds on
`recipes.training` (the module, which checkpoint of a series is complete) and `recipes.data`.
"""

from __future__ import annotations

from recipes.checkpoints.cli import hydra_style
from recipes.checkpoints.evaluation import Evaluation, evaluate_loss, load_checked
from recipes.checkpoints.hf import ExportError, export, hf_tokenizer, llama_config
from recipes.checkpoints.load import (
    LoadError,
    check_vocabulary,
    find_tokenizer,
    load_module,
    require_checkpoint,
)
from recipes.checkpoints.locate import resolve_checkpoint, run_config

__all__ = [
    "Evaluation",
    "ExportError",
    "LoadError",
    "check_vocabulary",
    "evaluate_loss",
    "export",
    "find_tokenizer",
    "hf_tokenizer",
    "hydra_style",
    "llama_config",
    "load_checked",
    "load_module",
    "require_checkpoint",
    "resolve_checkpoint",
    "run_config",
]
