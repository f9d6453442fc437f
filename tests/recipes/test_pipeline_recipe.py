"""The recipe with pipeline parallelism: `parallelism.pipeline=2` trains as `parallelism.pipeline=1` on the
same global batch and logs what it logs, and its checkpoint resumes as the unbroken run, at
`parallelism.pipeline=2` and `1` (one 2-rank launch of `tests/recipes/pp_recipe_fit.py`, shared by the
tests below); the module's layers run as its forward does, and the settings a pipeline cannot run with
are refused before any process starts, naming the setting."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate

from lightning_zero.layout.stages import members
from recipes.config.validation import ConfigError, validate
from recipes.training import GPT, GPTConfig, PretrainModule
from tests.conf.compose import compose_pretrain
from tests.launch import launch_env, run_script
from tests.recipes.test_tensor_parallel_recipe import samples_by_step, trained_rows, worst_difference

REPO_ROOT = Path(__file__).resolve().parents[2]
LOSS_TOL, PARAM_TOL = 1e-6, 1e-12  # losses: fp32 (the norms and loss); weights: float64
PIPELINED = ("pipeline", "interleaved")
NO_CHECKPOINTS = ["callbacks.model_checkpoint=null", "trainer.enable_checkpointing=false"]
PIPELINE = ["parallelism.pipeline=2", "model.tie_embeddings=false"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The one 2-rank launch of `pp_recipe_fit.py`: its saved results and its directory."""
    root = tmp_path_factory.mktemp("pp_recipe")
    out = root / "results.pt"
    command = [sys.executable, "-m", "tests.recipes.pp_recipe_fit", "--out", str(out), "--dir", str(root)]
    proc = run_script(command, 2, cwd=REPO_ROOT, env=launch_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False), root


def step_means(rank_losses: list[list[tuple[int, float]]]) -> dict[int, float]:
    """Each step's mean over every micro-batch of every rank."""
    by_step: dict[int, list[float]] = {}
    for losses in rank_losses:
        for step, loss in losses:
            by_step.setdefault(step, []).append(loss)
    return {step: sum(v) / len(v) for step, v in sorted(by_step.items())}


def column(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    """One metric of `metrics.csv` by step (the rows that hold it)."""
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


@pytest.mark.parametrize("run", PIPELINED)
def test_pipeline_trains_as_data_parallel_on_the_same_global_batch(
    launched: tuple[dict[str, Any], Path], run: str
) -> None:
    """Pipeline 2 x data 1 (1F1B at stage 3 with activation checkpointing; interleaved 1F1B with 2
    virtual stages per rank) against pipeline 1 x data 2: the same micro-batch losses per step (fp32
    norms and loss: <= 1e-6, 3e-8 measured), the same float64 weights after 3 steps (<= 1e-12, 3.5e-16
    measured: every stage's gathered), the same greedy sample; each rank held its stages' parameters
    only, and the sampler dealt both ranks of the pipeline the same batches."""
    saved, _ = launched
    got, want = saved["results"][run], saved["results"]["data"]
    assert got["pipelined"] and not want["pipelined"]
    assert [r[run] for r in saved["layouts"]] == [(1, 0), (1, 0)]
    assert [r["data"] for r in saved["layouts"]] == [(2, 0), (2, 1)]
    losses, want_losses = step_means(got["losses"]), step_means(want["losses"])
    assert list(losses) == list(want_losses) == [0, 1, 2]
    worst_loss = max(abs(losses[s] - want_losses[s]) for s in want_losses)
    assert worst_loss <= LOSS_TOL, (losses, want_losses)
    worst = worst_difference(got["params"], want["params"])
    assert worst[0][1] <= PARAM_TOL, worst[:5]
    assert got["sample"] == want["sample"]
    first, second = (set(names) for names in got["held"])
    assert not first & second and first | second == set(want["held"][0])
    assert "embed.weight" in first and "head.weight" in second  # the first stage's, the last's


@pytest.mark.parametrize("run", PIPELINED)
def test_the_pipeline_logs_what_the_recipe_logs(launched: tuple[dict[str, Any], Path], run: str) -> None:
    """`metrics.csv` of the pipeline runs (the module logs from `on_train_batch_start/_end` and
    `on_validation_batch_end` there): `lr` per step equal to the unsplit run's; `train/loss` rank 0's
    loss of the step's last batch, undivided by the accumulation, as `training_step` logs it;
    `val/loss` (over every rank) and `val/ppl` (exp of the mean validation loss, against the logits'
    torchmetrics perplexity) within fp32 of the unsplit run's."""
    saved, _ = launched
    rows, want_rows = saved["results"][run]["metrics"], saved["results"]["data"]["metrics"]
    # logged outside the 64-true forward context (`on_train_batch_start`): a float32 tensor
    assert column(rows, "lr") == pytest.approx(column(want_rows, "lr"), rel=1e-7)
    rank0 = dict(saved["results"][run]["losses"][0])  # each step's last micro-batch
    assert column(rows, "train/loss") == pytest.approx({s: 2 * v for s, v in rank0.items()}, rel=1e-12)
    for key in ("val/loss", "val/ppl"):
        got, want = column(rows, key), column(want_rows, key)
        assert list(got) == list(want) == [1], (rows, want_rows)  # validated once, after step 2
        assert got[1] == pytest.approx(want[1], rel=LOSS_TOL), key
    assert column(rows, "val/ppl")[1] == pytest.approx(math.exp(column(rows, "val/loss")[1]), rel=1e-6)


def test_trained_samples_are_written_once_per_data_parallel_rank(
    launched: tuple[dict[str, Any], Path],
) -> None:
    """`callbacks=trained_samples`: the two stages train the same samples, written once (pipeline rank
    0); the same samples per step as the two data-parallel ranks' files of the unsplit run."""
    _, root = launched
    for run in PIPELINED:
        rows, want = trained_rows(root / run), trained_rows(root / "data")
        assert list(rows) == ["rank0.txt"] and list(want) == ["rank0.txt", "rank1.txt"]
        assert samples_by_step(rows) == samples_by_step(want)


@pytest.mark.parametrize("run", ["resumed", "resumed_unsplit"])
def test_a_pipeline_checkpoint_resumes_as_the_unbroken_run(
    launched: tuple[dict[str, Any], Path], run: str
) -> None:
    """The recipe's checkpoint of the pipeline run (1F1B, zero3) after step 2 of 3, resumed for the last
    step in the same layout (`resumed`) and as pipeline 1 x data 2 at ZeRO stage 2 (`resumed_unsplit`):
    the same micro-batch losses at step 2 as the unbroken run (<= 1e-6; equal measured), the same
    weights at the end (<= 1e-12: 0 in the same layout, 3.5e-16 unsplit), the same sample. The data
    position continues: the checkpoint says 2 global batches of 8 were consumed, the resumed run trains
    step 2 only, with the samples the unbroken run trained at step 2 (none repeated, none skipped)."""
    saved, root = launched
    got, unbroken = saved["results"][run], saved["results"]["pipeline"]
    assert got["pipelined"] == (run == "resumed")
    position = unbroken["checkpoints"]["position"]  # the sampler's record: 1 data-parallel rank, 8 samples
    assert (position["consumed_samples"], position["global_batch_size"], position["world_size"]) == (16, 8, 1)
    losses, want_losses = step_means(got["losses"]), step_means(unbroken["losses"])
    assert list(losses) == [2], losses  # resumed after step 2's optimizer step: step 2 only
    assert abs(losses[2] - want_losses[2]) <= LOSS_TOL, (losses, want_losses)
    worst = worst_difference(got["params"], unbroken["params"])
    assert worst[0][1] <= PARAM_TOL, worst[:5]
    assert got["sample"] == unbroken["sample"]
    trained = samples_by_step(trained_rows(root / run))
    want = samples_by_step(trained_rows(root / "pipeline"))
    assert list(want) == [0, 1, 2] and trained == {2: want[2]}


def test_the_recipes_reader_joins_a_pipeline_checkpoint(launched: tuple[dict[str, Any], Path]) -> None:
    """`last` of the pipeline run (written at the end of the fit) read by `recipes.checkpoints.load_module`
    (what export, generate and evaluate read): every stage's weights, equal to the trained ones (in the
    float32 module it builds: the float64 weights rounded once)."""
    saved, _ = launched
    pipeline = saved["results"]["pipeline"]
    loaded = pipeline["checkpoints"]["last"]
    want = {name: tensor.to(loaded[name].dtype) for name, tensor in pipeline["params"].items()}
    worst = worst_difference(loaded, want)
    assert worst[0][1] == 0.0, worst[:5]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_layers_run_as_the_forward(checkpointing: bool) -> None:
    """`pipeline_forward` over `pipeline_layers()` in order, then `pipeline_loss`, is the module's
    forward and `_loss`, with activation checkpointing too (one process, float64)."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=64, n_layer=2, d_model=32, n_head=4, max_seq_len=16, activation_checkpointing=checkpointing
    )
    module = PretrainModule(config, {}).double()
    idx, target = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    layers = module.pipeline_layers()  # one per block, the embedding and the head with the outer ones
    assert [[type(m).__name__ for m in members(layer)] for layer in layers] == [
        ["TokenEmbedding", "Block"],
        ["Block", "RMSNorm", "OutputHead"],
    ]
    x = idx
    for index in range(len(layers)):
        x = module.pipeline_forward(index, x)
    assert torch.equal(x, module(idx))
    loss = module.pipeline_loss(x, target)
    assert torch.equal(loss, module._loss(module(idx), target))
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())


def test_whole_model_layers_are_the_models_modules() -> None:
    model = GPT(GPTConfig(vocab_size=64, n_layer=3, d_model=32, n_head=4, max_seq_len=16))
    assert model.layers() == [model.embed, *model.blocks, model.norm, model.head]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.pipeline=0"], "parallelism.pipeline=0 must be >= 1"),
        (
            ["parallelism.pipeline=2", "parallelism.microbatches=0"],
            "parallelism.microbatches=0 must be >= 1, or null",
        ),
        (["parallelism.pipeline=2", "parallelism.schedule=zb"], "parallelism.schedule=zb is not one of"),
        (
            ["parallelism.pipeline=2", "parallelism.schedule=interleaved_1f1b"],
            "parallelism.virtual_stages=1 with parallelism.schedule=interleaved_1f1b: set "
            "parallelism.virtual_stages=2 or more",
        ),
        (
            ["parallelism.pipeline=2", "parallelism.virtual_stages=2"],
            "parallelism.virtual_stages=2 with parallelism.schedule=1f1b: set parallelism.virtual_stages=1",
        ),
        (
            ["parallelism.microbatches=4"],
            "parallelism.microbatches=4 without a pipeline: set parallelism.pipeline=P",
        ),
        (
            ["parallelism.schedule=gpipe"],
            "parallelism.schedule=gpipe without a pipeline: set parallelism.pipeline=P",
        ),
        (
            [*PIPELINE, "parallelism.pipeline=3"],
            "parallelism.pipeline=3 x parallelism.tensor=1 does not divide the job's 2 ranks "
            "(cluster.nodes=1 x trainer.devices=2)(...)use parallelism.pipeline in [2]",
        ),
        (
            [*PIPELINE, "trainer.devices=4", "parallelism.tensor=4", "model.n_kv_head=4"],
            "parallelism.pipeline=2 x parallelism.tensor=4 does not divide the job's 4 ranks",
        ),
        (
            [*PIPELINE, "data.batch_size=6", "parallelism.microbatches=4"],
            "parallelism.microbatches=4 does not divide data.batch_size=6(...)in [1, 2, 3, 6]",
        ),
        (
            [*PIPELINE, "data.batch_size=5"],
            "parallelism.microbatches=null (one per stage) does not divide data.batch_size=5",
        ),
        (
            [
                *PIPELINE,
                "model.n_layer=1",
                "parallelism.schedule=interleaved_1f1b",
                "parallelism.virtual_stages=3",
            ],
            "= 6 stages, more than model.n_layer=1 blocks(...)use model.n_layer >= 6",
        ),
        (
            ["parallelism.pipeline=2"],
            "model.tie_embeddings=true with parallelism.pipeline=2(...)use model.tie_embeddings=false",
        ),
        (
            [*PIPELINE, "strategy=ddp"],
            "parallelism.pipeline=2 needs a lightning-zero strategy",
        ),
        (
            ["strategy.pipeline_microbatches=4"],
            "strategy.pipeline_microbatches=4 differs from parallelism.microbatches=None: set "
            "parallelism.microbatches=4",
        ),
        (
            [*PIPELINE, "trainer.precision=16-mixed"],
            "trainer.precision=16-mixed with parallelism.pipeline=2(...)use bf16-mixed or bf16-true",
        ),
        (
            [*PIPELINE, "strategy.sharded_checkpoint=false"],
            "strategy.sharded_checkpoint=false with parallelism.pipeline=2(...)leave "
            "strategy.sharded_checkpoint=true, or turn checkpoints off",
        ),
        (
            # Lightning's own ModelCheckpoint (trainer.enable_checkpointing)
            [*PIPELINE, "strategy.sharded_checkpoint=false", "callbacks.model_checkpoint=null"],
            "strategy.sharded_checkpoint=false with parallelism.pipeline=2",
        ),
        (
            [*PIPELINE, "model.compile_blocks=true"],
            "model.compile_blocks=true with parallelism.pipeline=2",
        ),
    ],
)
def test_settings_a_pipeline_cannot_run_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_pretrain(overrides))
    assert all(part in str(info.value) for part in message.split("(...)")), str(info.value)


def test_a_pipeline_run_keeps_the_recipes_checkpoints() -> None:
    """The recipe's checkpoint series (on by default) and a single-file strategy without checkpoints
    both validate under a pipeline."""
    assert validate(compose_pretrain(PIPELINE)).pipeline_parallel == 2
    single_file = [*PIPELINE, *NO_CHECKPOINTS, "strategy.sharded_checkpoint=false"]
    assert validate(compose_pretrain(single_file)).pipeline_parallel == 2


def test_the_strategy_takes_its_pipeline_from_parallelism() -> None:
    cfg = compose_pretrain(
        [*PIPELINE, "parallelism.microbatches=4", "parallelism.schedule=gpipe", "strategy=zero3"]
    )
    configs = validate(cfg)
    assert configs.pipeline_parallel == 2
    options = instantiate(cfg.strategy)._zero.options
    assert (options.pipeline_parallel_size, options.pipeline_microbatches) == (2, 4)
    assert (options.pipeline_schedule, options.pipeline_virtual_stages) == ("gpipe", 1)
    default = instantiate(compose_pretrain([]).strategy)._zero.options  # ZeroStrategy's own defaults
    assert (default.pipeline_parallel_size, default.pipeline_microbatches) == (1, None)
