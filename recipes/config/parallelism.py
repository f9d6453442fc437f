"""`parallelism.tensor=T` checked against the strategy, the model, the data and the machine before any
process starts (`recipes.config.validation.validate` calls `check_tensor_parallel`).

One setting: `parallelism.tensor` reaches the strategy as `tensor_parallel_size` by interpolation in
the lightning-zero strategy files (`conf/strategy/zero*.yaml`), so a strategy whose
`tensor_parallel_size` differs (set by hand, or a strategy file without the interpolation) is
refused rather than left to disagree with the model's plan. Under `T > 1`, every refusal names the
setting and the value it needs:

  * a strategy without tensor parallelism (`strategy=ddp`);
  * `T` not dividing `model.n_head`, the key/value heads, the MLP width or the vocabulary
    (`GPTConfig.check_tensor_parallel`: each rank keeps whole heads and equal slices);
  * `T` not dividing `data.seq_len` (sequence parallelism gives each rank `seq_len / T` positions
    of the norms' activations) or `trainer.devices` (a tensor-parallel group is `T` consecutive
    ranks of one node);
  * `model.compile_blocks`: a compiled block body over `DTensor` activations is not tested here.
"""

from __future__ import annotations

from omegaconf import DictConfig

from recipes.data import DataConfig
from recipes.training import GPTConfig

STRATEGY_ARGUMENT = "tensor_parallel_size"


def check_tensor_parallel(cfg: DictConfig, model: GPTConfig, data: DataConfig) -> None:
    """Refuse a `parallelism.tensor` this run cannot train with (see the module docstring).

    Raises:
        ValueError: naming the setting and what would be valid (`validate` raises it as a `ConfigError`).
    """
    tensor = cfg.parallelism.tensor
    strategy = cfg.strategy
    if STRATEGY_ARGUMENT not in strategy:
        if tensor > 1:
            raise ValueError(
                f"parallelism.tensor={tensor} needs a lightning-zero strategy (strategy=zero|zero1|zero2|"
                f"zero3); strategy._target_={strategy.get('_target_')} has no tensor parallelism"
            )
        return
    if strategy[STRATEGY_ARGUMENT] != tensor:
        raise ValueError(
            f"strategy.{STRATEGY_ARGUMENT}={strategy[STRATEGY_ARGUMENT]} differs from parallelism.tensor="
            f"{tensor}: set parallelism.tensor={strategy[STRATEGY_ARGUMENT]} instead (the strategy files "
            f"take {STRATEGY_ARGUMENT} from it; the model's plan follows the same value)"
        )
    model.check_tensor_parallel(tensor)
    if tensor == 1:
        return
    devices = cfg.trainer.devices
    if isinstance(devices, int) and devices % tensor != 0:
        raise ValueError(
            f"parallelism.tensor={tensor} does not divide trainer.devices={devices}: a tensor-parallel "
            f"group is {tensor} ranks of one node; use trainer.devices={tensor}, {2 * tensor}, ..."
        )
    if data.seq_len % tensor != 0:
        raise ValueError(
            f"parallelism.tensor={tensor} does not divide data.seq_len={data.seq_len}: sequence "
            f"parallelism gives each rank data.seq_len / {tensor} positions; use a multiple of {tensor}"
        )
    if model.compile_blocks:
        raise ValueError(
            f"model.compile_blocks=true with parallelism.tensor={tensor}: compiled blocks over "
            "tensor-parallel (DTensor) activations are not tested yet; use model.compile_blocks=false"
        )
