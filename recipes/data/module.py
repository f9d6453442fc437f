"""The Lightning side of the data: windows of tokens and the data module every rank builds.

The data module asks its `DataSource` (`recipes.data.sources`, chosen from `data.path`) to prepare on
local rank 0 of each node (`prepare_data`: a text source is tokenized into the cache on first use), then
on every rank for the tokenizer and the token streams of both splits (`setup`); every rank opens the
index and memory-maps lazily only the shards it reads (`recipes.data.shards`). Training and validation
samples are non-overlapping windows of `seq_len + 1` tokens of the split's token stream
(`TokenWindows`). The training order is `recipes.data.sampling`'s: a permutation per epoch from
`(data.seed, epoch)`, cut into global batches of `devices x num_nodes x accumulate_grad_batches x
batch_size` windows, each rank training its part of every global batch; the position (the optimizer's
step count) is saved in checkpoints and a resume continues with the next unseen global batch, also on
another world size with the same global batch (`recipes.data.resume`). Validation windows are split
over ranks by Lightning's `DistributedSampler`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.data.config import DataConfig, check_token_count
from recipes.data.resume import TrainDataResume, pipeline_stages
from recipes.data.shards import TokenStream
from recipes.data.sources import DataSource, data_source
from recipes.data.tokenizer import Tokenizer

__all__ = ["PretrainDataModule", "TokenWindows"]


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows `(x, y)` of `seq_len` tokens at offsets `i * seq_len`, `y` = `x` shifted by one token.

    `tokens` is a `TokenStream` or a 1-D array; the order of the windows is the sampler's business.
    """

    def __init__(self, tokens: TokenStream | np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))  # (T + 1,)
        return window[:-1], window[1:]


class PretrainDataModule(pl.LightningDataModule):
    """Prepares text sources once per node, then serves train/val windows of token shards on every rank."""

    def __init__(self, config: DataConfig, source: DataSource | None = None) -> None:
        """`source`: the one `data_source(config)` chooses, if the caller already has it (validated)."""
        super().__init__()
        self.config = config
        self.source = data_source(config) if source is None else source
        self.tokenizer: Tokenizer | None = None
        self.directory: Path | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self.train_resume = TrainDataResume()

    def prepare_data(self) -> None:
        """Local rank 0 of each node: tokenize a text source into the cache (a no-op when it is there)."""
        summary = self.source.prepare()
        if summary is not None and summary.new_tokens:  # first use: say where the shards went (once per node)
            print(summary.line(), flush=True)

    def setup(self, stage: str) -> None:
        self.tokenizer = self.source.tokenizer()
        train, val = self.source.open("train"), self.source.open("val")
        self.directory = self.source.directory
        check_token_count(len(train), len(val), self.config)
        self.train_set = TokenWindows(train, self.config.seq_len)
        self.val_set = TokenWindows(val, self.config.seq_len)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        assert self.train_set is not None, "setup() must run first"
        return self.train_resume.loader(
            self.trainer,
            self.train_set,
            micro_batch_size=self.config.batch_size,
            seed=self.config.seed,
            num_workers=self.config.num_workers,
        )

    def state_dict(self) -> dict[str, Any]:
        """The training data position, saved in every checkpoint (see `recipes.data.resume`)."""
        return self.train_resume.state_dict(self.trainer) if self.trainer is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_resume.load_state_dict(state_dict)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        assert self.val_set is not None, "setup() must run first"
        # a pipeline cuts every batch into equal micro-batches: a last short batch is left out
        pipelined = self.trainer is not None and pipeline_stages(self.trainer) > 1
        return self._loader(self.val_set, shuffle=False, drop_last=pipelined)

    def _loader(
        self, dataset: Dataset[tuple[torch.Tensor, torch.Tensor]], shuffle: bool, drop_last: bool = False
    ) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            shuffle=shuffle,
            drop_last=shuffle or drop_last,
            num_workers=self.config.num_workers,
            persistent_workers=self.config.num_workers > 0,
            generator=torch.Generator().manual_seed(self.config.seed) if shuffle else None,
        )
