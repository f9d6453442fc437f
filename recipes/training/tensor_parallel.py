"""Tensor and sequence parallelism for the recipe's GPT (Megatron-LM's layout, torchtitan's plan).

`apply_tensor_parallel(model, mesh)` splits every block over the ranks of a 1-D tensor-parallel mesh
(`T` ranks) with `torch.distributed.tensor.parallel.parallelize_module`, the way torchtitan's
`apply_tp` splits its Llama:

  * token embedding: `RowwiseParallel` (the vocabulary rows split; token ids replicated in, the
    partial lookups reduce-scattered out along the sequence: `Shard(1)`);
  * `attn_norm`, `mlp_norm` and the final `norm`: `SequenceParallel` (each rank normalizes its
    `seq / T` positions with the whole, replicated weight, whose gradient arrives as a partial sum
    that the strategy sums over the group);
  * before attention and the MLP: `PrepareModuleInput` all-gathers the sequence (`Shard(1)` ->
    `Replicate`);
  * `attn.q`, `attn.k`, `attn.v`, `mlp.gate`, `mlp.up`: `ColwiseParallel` (output features split: a
    rank holds `n_head / T` query heads and `kv_heads / T` key/value heads; `Attention` reads its
    local head counts from the projections' widths);
  * `attn.proj`, `mlp.down`: `RowwiseParallel(output_layouts=Shard(1))` (the partial products
    reduce-scattered back onto sequence shards, the residual stream stays sequence-parallel);
  * output head: `ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())`: vocabulary
    columns split, the logits all-gathered, so the loss is the ordinary cross-entropy on whole
    logits. Not loss parallelism (`torch.distributed.tensor.parallel.loss_parallel`): that needs the
    loss *and its backward* inside a context manager, and Lightning runs `backward` outside
    `training_step`; the cost is one all-gather of (batch, seq, vocab) logits per micro-batch.

A tied embedding and head compose: both plans shard the shared matrix by vocabulary rows
(`Shard(0)`) over the same mesh, so the head is tied again to the embedding's `DTensor` after the
plan (each style replaces the parameter it finds with its own copy).

Communication per block and micro-batch, in the forward (the backward mirrors it): two all-gathers
of the sequence (attention, MLP) and two reduce-scatters (their output projections), each of
(batch, seq, d_model) activations over the `T` ranks; plus the embedding's reduce-scatter and the
head's all-gather of the logits.

What must divide (`GPTConfig.check_tensor_parallel`, checked before launch by the recipe's
validation): `T` divides `n_head`, the key/value heads, the MLP width and the vocabulary; the
training sequence length (sequence sharding of the activations) and a node's devices are checked
by the recipe. Sampling with a KV cache decodes one position at a time, which a sequence split
cannot hold: `unsplit_copy` gives every rank the whole model for that.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from recipes.training.model import GPT


def block_plan() -> dict[str, ParallelStyle]:
    """The plan of one `Block`, by submodule name (Megatron's attention and MLP split, sequence-parallel
    norms). `attn` takes (x, cos, sin, cache): only `x` is redistributed."""
    return {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate": ColwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def outer_plan() -> dict[str, ParallelStyle]:
    """The plan around the blocks: embedding, final norm, output head (logits replicated)."""
    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def apply_tensor_parallel(model: GPT, mesh: DeviceMesh) -> None:
    """Split `model` in place over the 1-D tensor-parallel `mesh` (see the module docstring).

    Call it on every rank of the mesh, with the same model, before the optimizer is built.

    Raises:
        ValueError: a mesh that is not 1-D, or a model shape `mesh.size()` does not divide (named).
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tensor-parallel mesh, got {mesh.ndim} dims")
    model.config.check_tensor_parallel(mesh.size())
    parallelize_module(model, mesh, outer_plan())
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan())
    if model.config.tie_embeddings:  # each style replaced the shared matrix by its own DTensor copy
        embed, head = model.embed.weight, model.head.weight
        assert isinstance(embed, DTensor) and isinstance(head, DTensor)
        assert embed.placements == head.placements == (Shard(0),), (embed.placements, head.placements)
        model.head.weight = embed


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether `model` holds `DTensor` parameters (a plan was applied)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def unsplit_copy(model: GPT, pipeline: DeviceMesh | None = None) -> GPT:
    """A plain `GPT` on `model`'s device and in its dtype (`trainer.precision=64-true` trains in
    float64) holding the whole of `model`'s current weights; with the 1-D `pipeline` mesh, `model`
    holds one pipeline stage's layers (`PretrainModule.pipeline_layers`) and the copy every stage's.

    A collective over the tensor-parallel group (each `DTensor` is all-gathered) and the pipeline group
    (each stage's weights sent to every other, through the host): call it on every rank. The copy holds
    the whole model on every rank, which suits sampling from the recipe's models, not from one too
    large for a device.
    """
    state = {
        name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        for name, tensor in model.state_dict().items()
    }
    if pipeline is not None:
        stages: list[dict[str, torch.Tensor] | None] = [None] * pipeline.size()
        mine = {name: tensor.detach().cpu() for name, tensor in state.items()}
        torch.distributed.all_gather_object(stages, mine, group=pipeline.get_group())
        state = {name: tensor for stage in stages if stage is not None for name, tensor in stage.items()}
    device = model.rope_cos.device
    with torch.device(device):
        copy = GPT(model.config)
    copy.to(dtype=state["embed.weight"].dtype)  # a float32 copy would round the weights it is asked for
    copy.load_state_dict(state)
    return copy.train(model.training)
