"""Layer 4, the optimizer: :class:`ShardedAdamW` (torch's optimizer protocol on the engine), the
Adam/AdamW update rule, and conversion between shards and torch's full optimizer state."""

from lightning_zero.optim.sharded_adam import ShardedAdamW

__all__ = ["ShardedAdamW"]
