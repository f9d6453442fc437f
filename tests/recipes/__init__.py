"""Tests of the pretraining recipe: model, data, module, validation and the command line."""
