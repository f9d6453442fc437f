"""Data preparation: text documents -> a directory of token shards (`python -m recipes.prepare`).

* `documents` - the inputs (files by format, or a `datasets` source) as documents, cut into units of
  work that do not depend on the worker count;
* `plan` - what a directory is prepared from (`PrepareConfig`, `.plan.json`), claiming it, and putting
  the tokenizer in it (copied, or BPE trained there);
* `units` - one unit: read, tokenize, write its train and val shards (runs in pool workers);
* `pipeline` - `prepare()`: all of it, idempotent, the same bytes for any number of processes.

The text sources of the recipe (`recipes.data.sources.TextTokens`) prepare into their cache with the
same code. Everything here imports numpy, never torch: pool workers and the command start fast.
"""

from __future__ import annotations

from recipes.data.preparation.pipeline import PrepareSummary, prepare
from recipes.data.preparation.plan import PrepareConfig, PrepareError

__all__ = ["PrepareConfig", "PrepareError", "PrepareSummary", "prepare"]
