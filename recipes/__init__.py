"""Hydra-configured pretraining recipes for GPT-style language models.

Commands (run from the repository root), each a thin module at this level:

* `python -m recipes.pretrain [overrides]` - compose `conf/pretrain.yaml`, validate, train with Lightning;
* `python -m recipes.prepare INPUT... --out DIR` - tokenize a corpus once into a directory of token
  shards, which the recipe reads with `data=tokens data.path=DIR`;
* `python -m recipes.sbatch [overrides]` - a ready sbatch script for the same overrides;
* `python -m recipes.export`, `recipes.generate`, `recipes.evaluate` - use a trained checkpoint.

The library below them, by concern (each package's docstring maps its modules):

* `recipes.data` - token data: the data-source interface (`recipes.data.sources`), tokenizers, token
  shards, preparation, the Lightning data module, the sample order and its exact resume;
* `recipes.training` - the model, the LightningModule and the callbacks the recipe adds;
* `recipes.config` - the Hydra side: resolvers, schema, composition, validation, building a run;
* `recipes.checkpoints` - reading a trained run back: checkpoint, module, tokenizer, loss, Hugging Face.

Arrows go one way: `data` and `training` import no other recipe package; `checkpoints` and `config` build
on both; the commands import the packages, never each other (`tests/recipes/test_import_graph.py`).
The model and the data know nothing about distribution: the Lightning strategy chosen under
`conf/strategy/` applies parallelism from outside.
"""
