"""The one base class of the data package's errors, so callers catch "the data cannot be used" once.

Each module keeps its own subclass, whose message names the setting or file and what would be valid:
`CorpusError` (`recipes.data.corpus`: what `data.path` designates; `SourceError`, an input that cannot be
read as documents, is one), `ShardError` (`recipes.data.shards`: a token directory), `TokenizerError`
(`recipes.data.tokenizer`), `PrepareError` (`recipes.data.preparation.plan`: a preparation that cannot
run). A `DataError` itself is a setting that does not fit the data it names (a data source's own check).
"""

from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be used as configured; the message names the setting and what would be valid."""
