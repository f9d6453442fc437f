"""LightningModule for next-token pretraining: loss, perplexity, AdamW with warmup + cosine.

Optimizer: a plain `torch.optim.AdamW` with two parameter groups - weight decay on matrices, none on
norm weights, biases and (unless `optim.decay_embeddings`) the embedding table, which with tied
embeddings is also the head. A ZeRO strategy turns this ordinary optimizer into its sharded form; the
module never sees the difference. The learning rate follows a `LambdaLR` stepped every optimizer step:
linear warmup over `optim.warmup_steps`, then a cosine from `optim.lr` down to
`optim.lr * optim.min_lr_ratio` at the trainer's last step.

Throughput and MFU are not the module's business: `recipes.training.throughput.TokenThroughput` (a
callback in the recipe's default callbacks) measures them with Lightning's tools; the module states its
tokens, FLOPs per token and activation bytes (`tokens_in_batch`, `flops_per_token`, `activation_bytes`)
for lightning-zero's step profile (`strategy.profile_steps=[first,last]`). The module logs
`train/loss` as a device tensor without `prog_bar` (Lightning reads every `prog_bar` tensor to the host
after every batch;
`recipes.training.progress.RefreshProgressBar` shows it when it redraws, the loggers read it every
`log_every_n_steps`), so no step waits for the device; and `lr`, a Python number.

Pipeline parallelism (`parallelism.pipeline=P`, lightning-zero's `pipeline_parallel_size`): the module
gives the strategy its layers (`pipeline_layers`: one per block of `GPT.layers`, the embedding grouped
with the first block and the final norm and the head with the last), runs one of them
(`pipeline_forward`, with the rotary tables and activation checkpointing of `GPT.forward`) and the loss
of a micro-batch (`pipeline_loss`, `_loss`), as `docs/pipeline.md` asks. The strategy then runs the
steps itself and never calls `training_step` or `validation_step`: the module logs `lr` in
`on_train_batch_start`, the losses the strategy's steps return in `on_train_batch_end` (`train/loss`)
and `on_validation_batch_end` (`val/loss`), and `val/ppl` as the exponential of the mean validation loss
(`val_mean_loss`: the logits never reach the module), the torchmetrics perplexity's value when every
validation batch holds as many tokens. Without a pipeline these hooks log nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

import lightning_zero  # noqa: F401  (load_from_checkpoint reads sharded checkpoint directories)
from lightning_zero.layout.activations import ActivationSpec, activation_bytes
from lightning_zero.layout.memory import full_precision
from recipes.training.model import GPT, GPTConfig


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and learning-rate schedule settings."""

    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr`."""
    warmup_steps: int = 50
    """Optimizer steps of linear warmup from 0."""
    weight_decay: float = 0.1
    """Decoupled weight decay for the decay group."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam moment coefficients."""
    eps: float = 1e-8
    """Adam epsilon."""
    decay_embeddings: bool = False
    """Put the embedding table (and a tied head) in the decay group."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))  # YAML gives a list
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.warmup_steps < 0:
            raise ValueError("optim.lr must be > 0, optim.min_lr_ratio in [0, 1], optim.warmup_steps >= 0")
        if self.weight_decay < 0 or len(self.betas) != 2:
            raise ValueError("optim.weight_decay must be >= 0 and optim.betas a pair")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): warmup, then cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool) -> list[dict[str, Any]]:
    """Split parameters into a decayed group (matrices) and an undecayed one (norms, biases, embeddings)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():  # shared (tied) tensors appear once
        if not param.requires_grad:
            continue
        is_embedding = id(param) in embedding_ids
        if param.ndim >= 2 and (decay_embeddings or not is_embedding):
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


QUERY_DTYPES = {
    "64-true": torch.float64,
    "32-true": torch.float32,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "transformer-engine-float16": torch.float16,
}
"""The dtype attention's inputs have under a precision (Lightning's full name); bf16 under the others."""


def attention_kernel(device: torch.device, precision: str, heads: int, seq_len: int, head_dim: int) -> str:
    """Which kernel `F.scaled_dot_product_attention(is_causal=True)` runs for the recipe's training
    forward on `device` under `precision` (`heads` query heads of `head_dim` over `seq_len` positions):
    "flash" for any fused one (flash, memory-efficient, cuDNN; a CPU's flash), "math" where torch falls
    back to the softmax of every pair (torch's own choice, `torch._fused_sdp_choice`, honouring an
    enclosing `torch.nn.attention.sdpa_kernel`). A torch without that function: "flash"."""
    dtype = QUERY_DTYPES.get(full_precision(precision), torch.bfloat16)
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "flash"
    query = torch.empty(1, heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    return "math" if choose(query, query, query, is_causal=True) == SDPBackend.MATH.value else "flash"


class PretrainModule(pl.LightningModule):
    """Next-token language modelling of a `GPT` built from `model_config`.

    The hyper-parameters are saved in every checkpoint as plain dicts (what `torch.load(weights_only=True)`
    reads, as lightning-zero's sharded `meta.pt` is), so `PretrainModule.load_from_checkpoint(path)` needs
    no arguments, for a checkpoint file and for a sharded checkpoint directory alike.
    """

    def __init__(
        self,
        model_config: GPTConfig | dict[str, Any],
        optim: OptimConfig | dict[str, Any],
    ) -> None:
        super().__init__()
        if isinstance(model_config, dict):  # from a checkpoint's hyper-parameters
            model_config = GPTConfig(**model_config)
        if isinstance(optim, dict):
            optim = OptimConfig(**optim)
        # The loggers get the whole resolved config from `recipes.config.build`; these are for checkpoints.
        self.save_hyperparameters(
            {
                "model_config": asdict(model_config),
                "optim": asdict(optim),
            },
            logger=False,
        )
        if model_config.init_from is not None:  # before any work: a directory of another shape is refused
            from recipes.training.llama import check_llama_directory

            check_llama_directory(model_config, model_config.init_from)
        self.model_config = model_config
        self.optim_config = optim
        self.model = GPT(model_config)
        with torch.device("cpu"):  # never on the meta device (`trainer.init_module(empty_init=True)`):
            self.val_perplexity = Perplexity()  # its state is no parameter; it follows the module's moves
            self.val_mean_loss = MeanMetric()  # val/ppl under pipeline parallelism (module docstring)
        self._sequence_split = 1
        """Ranks the sequence is split over between the layers (sequence parallelism: `T`)."""
        self._flops_by_seq: dict[int, float] = {}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def tokens_in_batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        """The tokens one micro-batch trains, its inputs' `B x T`: what lightning-zero's step profiler
        (`strategy.profile_steps=[first,last]`) counts its tokens per step and per second from."""
        return batch[0].numel()

    def flops_per_token(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """The whole model's training FLOPs per token over this batch's context `T`, for the step
        profiler's MFU: `GPT.flops_per_token`, `6 N + 12 L d T` (torchtitan's `6 (N - N_emb) + 12 l h q t`
        for an untied model), of the configured model built on the meta device (a pipeline stage or a
        tensor-parallel rank holds only a part of it); once per context length."""
        seq = batch[0].shape[1]
        if seq not in self._flops_by_seq:
            with torch.device("meta"):
                self._flops_by_seq[seq] = GPT(self.model_config).flops_per_token(seq)
        return self._flops_by_seq[seq]

    def activation_bytes(
        self, batch: tuple[torch.Tensor, torch.Tensor], precision: str | None = None
    ) -> int | None:
        """What one micro-batch's forward and loss save for backward on this rank, estimated: the
        arithmetic of `lightning_zero.layout.activations` for this model, the batch's `B x T`, the
        Trainer's precision (or `precision`), the attention kernel SDPA picks here (`attention_kernel`),
        activation checkpointing and the sequence-parallel split; plus the rotary tables, of which every
        block keeps a slice. What lightning-zero's step profiler puts beside the bytes it measures
        (`estimate.activation_bytes`). None where the arithmetic does not hold: compiled blocks (the
        compiler chooses what they keep) and pipeline stages."""
        config = self.model_config
        if config.compile_blocks or self.pipelined:
            return None
        precision = str(self.trainer.precision) if precision is None else precision
        micro_batch, seq = batch[0].shape
        split = self._sequence_split
        spec = ActivationSpec(
            seq_len=seq,
            micro_batch=micro_batch,
            d_model=config.d_model,
            layers=config.n_layer,
            heads=config.n_head,
            kv_heads=config.kv_heads,
            mlp_hidden=config.hidden_dim,
            vocab_size=config.vocab_size,
            precision=precision,
            attention=attention_kernel(self.device, precision, config.n_head // split, seq, config.head_dim),
            checkpointing=config.activation_checkpointing,
            tensor=split,
        )
        tables = sum(t.untyped_storage().nbytes() for t in (self.model.rope_cos, self.model.rope_sin))
        return round(activation_bytes(spec)) + tables

    def configure_model(self) -> None:
        """Under a strategy with a `tensor_parallel` mesh dimension of size > 1 (`parallelism.tensor=T`:
        lightning-zero's `tensor_parallel_size`, Lightning's `ModelParallelStrategy`), split the model
        over it (`recipes.training.tensor_parallel`); once, however often Lightning calls this."""
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        tensor_mesh = mesh["tensor_parallel"]
        from recipes.training.tensor_parallel import apply_tensor_parallel, is_tensor_parallel

        if tensor_mesh.size() > 1 and not is_tensor_parallel(self.model):
            apply_tensor_parallel(self.model, tensor_mesh)
        self._sequence_split = tensor_mesh.size()

    @property
    def pipelined(self) -> bool:
        """Whether a strategy runs this module as pipeline stages (a `pipeline_parallel` mesh dimension
        of size > 1): its steps are then the strategy's, not `training_step` / `validation_step`."""
        mesh = self.device_mesh
        if mesh is None or "pipeline_parallel" not in (mesh.mesh_dim_names or ()):
            return False
        return bool(mesh["pipeline_parallel"].size() > 1)

    def pipeline_layers(self) -> list[nn.Module | list[nn.Module]]:
        """The layers the pipeline stages are cut from, in forward order: one per block, the embedding
        grouped with the first block and the final norm and the head with the last, so that the stages
        hold equal numbers of blocks (`lightning_zero.layout.stages.stage_layers`: the first ones one
        more when the stages do not divide them), the first stage the embedding, the last the head."""
        flat = self.model.layers()  # embedding, blocks, norm, head
        return [flat[first : last + 1] if last > first else flat[first] for first, last in self._groups()]

    def pipeline_forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `index` of `pipeline_layers()` on `x`, a group's layers in order (`GPT.layer_forward`):
        the rotary tables cover the whole sequence, `x.shape[1]` positions times the sequence-parallel
        ranks that hold parts of it between the layers (the token ids of the embedding are whole)."""
        first, last = self._groups()[index]
        for flat in range(first, last + 1):
            x = self.model.layer_forward(flat, x, x.shape[1] * self._sequence_split)
        return x

    def _groups(self) -> list[tuple[int, int]]:
        """`(first, last)` indices into `GPT.layers()` of each pipeline layer: block `b` is at `b + 1`."""
        blocks = len(self.model.blocks)
        groups = [(b + 1, b + 1) for b in range(blocks)]
        groups[0] = (0, groups[0][1])  # the embedding before the first block
        groups[-1] = (groups[-1][0], blocks + 2)  # the final norm and the head after the last
        return groups

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch's logits: `training_step`'s."""
        return self._loss(output, target)

    def on_fit_start(self) -> None:
        """A fresh run with `model.init_from=DIR` starts from that Llama's weights, read straight into
        the shards (each rank reads only its own bytes under a ZeRO strategy)."""
        directory = self.model_config.init_from
        if directory is None or self.trainer.ckpt_path is not None:
            return
        from lightning_zero.checkpoint import SafetensorsReader, load_parameters
        from recipes.training.llama import llama_sources

        reader = SafetensorsReader(directory, sources=llama_sources(self.model_config, prefix="model."))
        optimizer = getattr(self.trainer.strategy, "sharded_optimizer", None)
        loaded = load_parameters(self, reader, engine=None if optimizer is None else optimizer.engine)
        if self.trainer.is_global_zero:
            print(f"initialized {len(loaded)} tensors from {directory}")

    def on_train_start(self) -> None:
        scheduler = self.lr_schedulers()
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and scheduler.last_epoch > 0:
            # A restored optimizer carries the lr of the previous command's schedule; recompute it in case
            # max_steps changed, so the first resumed step already follows the new cosine.
            groups = scheduler.optimizer.param_groups
            for group, base_lr, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
                group["lr"] = base_lr * factor(scheduler.last_epoch)
        if self.trainer.is_global_zero:  # after a resume this shows the restored step
            params = f"{self.model.num_params() / 1e6:.2f}M parameters"
            if self.pipelined:  # this rank holds its stages' layers only
                with torch.device("meta"):
                    params = (
                        f"{GPT(self.model_config).num_params() / 1e6:.2f}M parameters ({params} on stage 0)"
                    )
            print(f"training {params} from global step {self.trainer.global_step}")

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch  # each (B, T)
        loss = self._loss(self(inputs), targets)
        self.log("train/loss", loss)  # not prog_bar: Lightning would read it to the host every step
        self._log_lr()
        return loss

    def _log_lr(self) -> None:
        self.log("lr", self.optimizers().param_groups[0]["lr"])  # type: ignore[union-attr]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Under pipeline parallelism: log the learning rate this batch trains with (the schedulers
        have stepped by `on_train_batch_end`)."""
        if self.pipelined:
            self._log_lr()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Under pipeline parallelism: log the batch's loss the strategy's step returned, as
        `training_step` logs it (Lightning divides `outputs["loss"]` by the accumulated batches)."""
        if self.pipelined:
            self.log("train/loss", outputs["loss"] * self.trainer.accumulate_grad_batches)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs)
        self.val_perplexity.update(logits.float(), targets)
        self.log("val/loss", self._loss(logits, targets), sync_dist=True)
        # Logging the metric object lets Lightning compute it across ranks and reset it per epoch.
        self.log("val/ppl", self.val_perplexity, prog_bar=True, on_step=False, on_epoch=True)

    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Under pipeline parallelism: log the batch's mean loss the strategy's step returned."""
        if self.pipelined:
            self.log("val/loss", outputs, sync_dist=True)
            self.val_mean_loss.update(outputs)

    def on_validation_epoch_end(self) -> None:
        """Under pipeline parallelism: `val/ppl` as exp(mean validation loss) over the batches of every
        rank (`MeanMetric` syncs over all ranks: a pipeline's ranks hold the same losses)."""
        if self.pipelined:
            self.log("val/ppl", self.val_mean_loss.compute().exp(), prog_bar=True)
            self.val_mean_loss.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        config = self.optim_config
        groups = param_groups(self.model, config.weight_decay, config.decay_embeddings)
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, config.warmup_steps, total_steps, config.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
