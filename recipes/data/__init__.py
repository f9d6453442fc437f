"""Token data for pretraining: sources, tokenizers, token shards, preparation, sampling and resume.

Every source goes through prepared token shards, read by every rank. Where to look:

* `sources` - THE data-source interface: `DataSource`, one class per kind of `data.path` (a prepared
  token directory, one `.bin` of token ids, text to tokenize), chosen in one place (`data_source`);
* `config` - `DataConfig`, the recipe's `data` settings (the target of `conf/data/*.yaml`);
* `corpus` - what a text `data.path` designates (the embedded stdlib subset, user files, globs);
* `tokenizer` - byte, Hugging Face, SentencePiece and tiktoken tokenizers, BPE training;
* `shards` - the token directory format: index, shard writer, memory-mapped reader;
* `preparation/` - text -> token shards (`python -m recipes.prepare`, and the text sources' cache);
* `module` - the Lightning data module and the windows it serves (imports Lightning);
* `sampling`, `resume` - the global-batch sample order and its exact resume (`resume` imports Lightning).

This package's face, below, imports numpy only, never torch or Lightning, so `python -m
recipes.prepare` and its pool workers start in a fraction of a second: other packages import these
names from `recipes.data`, and the Lightning parts from their modules (`recipes.data.module`,
`recipes.data.resume`). Modules inside the package import their siblings, never this face. Every
error is a `DataError`.
"""

from __future__ import annotations

from recipes.data.config import DataConfig, check_token_count
from recipes.data.corpus import Corpus, CorpusError
from recipes.data.errors import DataError
from recipes.data.preparation import PrepareConfig, PrepareError, PrepareSummary, prepare
from recipes.data.shards import ShardError, verify_shards
from recipes.data.sources import DataSource, data_source
from recipes.data.tokenizer import (
    END_OF_TEXT,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer_spec,
    resolve_tokenizer,
)

__all__ = [
    "END_OF_TEXT",
    "BPETokenizer",
    "ByteTokenizer",
    "Corpus",
    "CorpusError",
    "DataConfig",
    "DataError",
    "DataSource",
    "PrepareConfig",
    "PrepareError",
    "PrepareSummary",
    "ShardError",
    "Tokenizer",
    "TokenizerError",
    "check_token_count",
    "data_source",
    "load_tokenizer_spec",
    "prepare",
    "resolve_tokenizer",
    "verify_shards",
]
