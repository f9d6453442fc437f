"""Hydra-configured pretraining recipes for GPT-style language models.

`python -m recipes.pretrain` (run from the repository root) composes `conf/pretrain.yaml`, validates it
against the schema in `recipes.schema`, and trains with Lightning. The model (`recipes.model`) and the
data pipeline (`recipes.data`, `recipes.tokenizer`) know nothing about distribution: the Lightning
strategy chosen under `conf/strategy/` applies parallelism from outside. `python -m recipes.prepare`
tokenizes a corpus once into a directory of token shards (`recipes.shards`, `recipes.sources`) that the
recipe reads with `data=tokens data.path=DIR`.
"""
