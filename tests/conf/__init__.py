"""Tests of the Hydra configs in conf/: every YAML composes against the schema and instantiates."""
