"""Layer 1, pure layout math: which parameter lives where in which bucket, and which rank owns what.

``partition`` (shard ranges and the pieces of parameters each rank owns), ``buckets`` (the bucket
plan every rank builds identically) and ``flat`` (parameters as views into one flat buffer per
dtype). No ``torch.distributed`` and no Lightning here (``tests/unit/test_layering.py``).
"""
