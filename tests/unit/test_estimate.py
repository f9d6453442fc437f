"""``lightning-zero estimate``: arithmetic that answers at once (neither Lightning nor torch imported),
taking every precision and layout the strategy takes."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import subprocess
import sys
from typing import get_args

import pytest

from lightning_zero.cli import main
from lightning_zero.layout.activations import ACTIVATION_DTYPES, ActivationSpec, activation_bytes, layer_bytes
from lightning_zero.layout.memory import (
    POOL_SLOTS,
    PRECISION_ALIASES,
    PRECISION_BYTES,
    estimate_rows,
    full_precision,
    microbatches_in_flight,
    pipeline_bubble,
)
from tests.docs.scripts import ROOT

ESTIMATE = ["estimate", "--params", "1e9", "--world-size", "32"]
SHAPE = ["--seq-len", "4096", "--micro-batch", "1", "--d-model", "4096", "--layers", "32"]
SHAPE_70B = [
    "--seq-len",
    "4096",
    "--micro-batch",
    "1",
    "--d-model",
    "8192",
    "--layers",
    "80",
    "--heads",
    "64",
]
HEAVY = ("lightning", "lightning.pytorch", "lightning.fabric", "torch", "torch.distributed")
"""Seconds of imports each, where the arithmetic takes milliseconds."""


def test_the_estimate_command_imports_neither_lightning_nor_torch() -> None:
    """A fresh interpreter runs the command's ``main`` as the console script does, then lists which of
    :data:`HEAVY` came in: none."""
    code = (
        "import sys\n"
        "from lightning_zero.cli import main\n"
        f"assert main({[*ESTIMATE, '--shard-group-size', 'auto', '--devices', '8']!r}) == 0\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sharded in groups of 8" in run.stdout
    assert run.stdout.splitlines()[-1] == "[]", run.stdout


def test_the_pool_slots_are_the_engines() -> None:
    """The engine module that defines ``POOL_SLOTS`` (found by reading the source, wherever it lives)
    holds as many buffers as the estimate counts."""
    engine = ROOT / "lightning_zero" / "engine"
    defining = [
        f"lightning_zero.engine.{path.stem}"
        for path in sorted(engine.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "POOL_SLOTS" for t in node.targets)
    ]
    assert len(defining) == 1, f"POOL_SLOTS defined in {defining}: one engine module defines it"
    assert importlib.import_module(defining[0]).POOL_SLOTS == POOL_SLOTS


def test_every_precision_lightning_takes_is_estimated() -> None:
    """The strategy takes whatever precision plugin Lightning builds, so the estimate takes every name
    Lightning does, short names included."""
    from lightning.fabric.plugins.precision.precision import (
        _PRECISION_INPUT_STR,
        _PRECISION_INPUT_STR_ALIAS_CONVERSION,
    )

    assert set(PRECISION_BYTES) == set(get_args(_PRECISION_INPUT_STR)) == set(ACTIVATION_DTYPES)
    assert PRECISION_ALIASES == _PRECISION_INPUT_STR_ALIAS_CONVERSION
    for precision in [*PRECISION_BYTES, *PRECISION_ALIASES]:
        assert main([*ESTIMATE, "--precision", precision]) == 0, precision
    assert estimate_rows(1e9, 8, "16", 25.0) == estimate_rows(1e9, 8, "bf16-mixed", 25.0)
    assert estimate_rows(1e9, 8, "16-true", 25.0) == estimate_rows(1e9, 8, "bf16-true", 25.0)
    with pytest.raises(ValueError, match="precision='fp8': one of"):
        full_precision("fp8")


def test_shard_group_size_auto_is_the_ranks_of_one_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ESTIMATE, "--shard-group-size", "auto", "--devices", "8"]) == 0
    auto = capsys.readouterr().out
    assert "32 ranks sharded in groups of 8 (replicated 4x)" in auto
    assert main([*ESTIMATE, "--shard-group-size", "8"]) == 0
    assert capsys.readouterr().out == auto
    with pytest.raises(SystemExit):
        main([*ESTIMATE, "--shard-group-size", "auto"])
    assert "give the ranks of one node with --devices" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*ESTIMATE, "--shard-group-size", "auto", "--devices", "5"])
    assert "--devices 5 must be a positive divisor of --world-size 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*ESTIMATE, "--shard-group-size", "many"])
    assert "shard_group_size='many' must divide the 32 data-parallel ranks" in capsys.readouterr().err


def test_tensor_parallelism_splits_every_layer_and_the_activations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """70B on 8 x 8 ranks: under T = 8 each rank holds 1/8 of every layer sharded over the 8 data-
    parallel ranks (ZeRO's fully sharded state is 1/64 either way); sequence parallelism divides the
    activations by T but the inputs of the column-parallel projections, gathered whole."""
    base = ["estimate", "--params", "69e9", "--world-size", "64", "--devices", "8", *SHAPE_70B]
    assert main([*base, "--tensor-parallel", "8"]) == 0
    split = capsys.readouterr().out
    assert main(base) == 0
    whole = capsys.readouterr().out
    assert "64 ranks (tensor 8 x data 8; ddp: data parallel over the 8)" in split
    rows = [
        dict(
            line.split()[:2]
            for line in out.splitlines()
            if line.startswith("  zero") or line.startswith("  ddp")
        )
        for out in (split, whole)
    ]
    assert rows[0]["zero3"] == rows[1]["zero3"]  # 16 Psi / 64 per rank either way
    assert float(rows[0]["ddp"]) == pytest.approx(float(rows[1]["ddp"]) / 8, rel=1e-3)
    h, f, a = 8192, 21888, 64  # f: 8/3 h rounded up to 64
    whole_spec = ActivationSpec(seq_len=4096, micro_batch=1, d_model=h, layers=80, heads=a)
    split_spec = dataclasses.replace(whole_spec, tensor=8)
    per_token = 26 * h + 8 * f + 4 * a + 8  # bf16: norms 2 (4h + 4 + 2h), inputs 4h, attention 8h + 4a,
    assert layer_bytes(whole_spec) == 4096 * per_token  # the output projection's input 2h, the MLP 8f
    assert layer_bytes(split_spec) == 4096 * ((per_token - 4 * h) / 8 + 4 * h)  # the inputs 2 x 2h whole
    for spec, out in ((whole_spec, whole), (split_spec, split)):
        assert f"activations {activation_bytes(spec) / 2**30:5.2f} GiB per micro-batch of 1 x 4096" in out
    assert "activations 118.77 GiB" in whole and "activations 23.65 GiB" in split


def test_tensor_parallel_sizes_and_activation_arguments_are_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for extra, message in (
        (["--tensor-parallel", "3"], "tensor_parallel_size=3 must divide the world's 32 ranks"),
        (["--tensor-parallel", "8", "--devices", "4"], "tensor_parallel_size=8 must divide a node's 4 ranks"),
        (["--tensor-parallel", "2", "--shard-group-size", "8"], "drop --shard-group-size"),
        (["--seq-len", "4096"], "activations need all five of --seq-len"),
        (["--vocab-size", "32000"], "activations need all five of --seq-len"),
        ([*SHAPE, "--heads", "5"], "--heads 5 must divide --d-model 4096"),
        ([*SHAPE, "--heads", "32", "--kv-heads", "5"], "--kv-heads 5 must divide --heads 32"),
        ([*SHAPE, "--heads", "32", "--vocab-size", "-1"], "--vocab-size -1 must be >= 0"),
        ([*SHAPE, "--heads", "32", "--attention", "sparse"], "invalid choice: 'sparse'"),
    ):
        with pytest.raises(SystemExit):
            main([*ESTIMATE, *extra])
        assert message in capsys.readouterr().err, extra


def test_the_activation_options_reach_the_figure(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 2 7B's shape, 4096 tokens: the math kernel adds the softmax of every pair (4 bytes per
    head, pair and layer: fp32), checkpointing keeps a block's input only, the vocabulary adds the fp32
    logits, bf16-mixed keeps fp32 norms and 16-bit copies of every input and weight."""
    shape = [*SHAPE, "--heads", "32", "--mlp-hidden", "11008"]
    base = ActivationSpec(seq_len=4096, micro_batch=1, d_model=4096, layers=32, heads=32, mlp_hidden=11008)
    for extra, spec in (
        ([], base),
        (["--attention", "math"], dataclasses.replace(base, attention="math")),
        (["--activation-checkpointing"], dataclasses.replace(base, checkpointing=True)),
        (["--vocab-size", "32000"], dataclasses.replace(base, vocab_size=32000)),
        (
            ["--precision", "bf16-mixed", "--kv-heads", "8"],
            dataclasses.replace(base, precision="bf16-mixed", kv_heads=8),
        ),
    ):
        assert main([*ESTIMATE, *shape, *extra]) == 0
        out = capsys.readouterr().out
        assert f"activations {activation_bytes(spec) / 2**30:5.2f} GiB" in out, (extra, out)
    math = dataclasses.replace(base, attention="math")
    # the softmax and fp32 q, k, v (3 x 4h) in place of 16-bit q, k, v and the output (4 x 2h), the lse (4a)
    assert layer_bytes(math) - layer_bytes(base) == 4096 * (4 * 32 * 4096 + 4 * 4096 - 4 * 32)
    assert layer_bytes(dataclasses.replace(base, checkpointing=True)) == 4096 * 2 * 4096  # the block's input
    logits = dataclasses.replace(base, vocab_size=32000)
    assert activation_bytes(logits) - activation_bytes(base) == 4096 * 4 * 32000


def test_pipeline_parallel_divides_the_state_and_reports_the_bubble_and_the_activations_held(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """70B on 128 ranks, pipeline 2 x tensor 8 x data 8: each stage holds half the parameters; the
    bubble is (P-1)/(M+P-1) (over V for interleaved); the first stage holds M micro-batches of its
    half of the layers under GPipe, min(M, P) under 1F1B."""
    base = ["estimate", "--params", "69e9", "--devices", "8", "--tensor-parallel", "8", *SHAPE_70B]
    assert main([*base, "--world-size", "64"]) == 0
    flat = capsys.readouterr().out
    outs = {}
    for schedule in (
        ["--schedule", "gpipe"],
        ["--schedule", "1f1b"],
        ["--schedule", "interleaved_1f1b", "--virtual-stages", "2"],
    ):
        assert (
            main([*base, "--world-size", "128", "--pipeline-parallel", "2", "--microbatches", "8", *schedule])
            == 0
        )
        outs[schedule[1]] = capsys.readouterr().out
    assert "128 ranks (pipeline 2 x tensor 8 x data 8;" in outs["1f1b"]
    zero3 = [
        float(line.split()[1])
        for out in (flat, outs["1f1b"])
        for line in out.splitlines()
        if line.startswith("  zero3")
    ]
    assert zero3[1] == pytest.approx(zero3[0] / 2, rel=1e-2)  # all but the buckets in flight halve
    assert pipeline_bubble(2, 8) == pytest.approx(1 / 9) and "bubble (P-1)/(M+P-1) = 11.1%" in outs["1f1b"]
    assert "= 5.6% of a step" in outs["interleaved_1f1b"]
    spec = ActivationSpec(seq_len=4096, micro_batch=1, d_model=8192, layers=80, heads=64, tensor=8)
    per_microbatch = layer_bytes(spec) * 40 / 2**30  # half the layers
    assert f"activations {per_microbatch * 8:5.2f} GiB" in outs["gpipe"]  # all 8 in flight
    assert f"activations {per_microbatch * 2:5.2f} GiB" in outs["1f1b"]  # min(M, P)
    assert (
        microbatches_in_flight("interleaved_1f1b", 2, 8, 2) == 2.5
    )  # torch's warm-up: (V-1)P + 2(P-1) + 1 chunks


def test_pipeline_arguments_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for extra, message in (
        (
            ["--pipeline-parallel", "3"],
            "--pipeline-parallel 3 must divide --world-size 32: one of [1, 2, 4, 8, 16, 32]",
        ),
        (["--pipeline-parallel", "2"], "needs --microbatches M >= 1"),
        (["--microbatches", "4"], "need --pipeline-parallel P > 1"),
        (
            ["--pipeline-parallel", "2", "--microbatches", "4", "--virtual-stages", "2"],
            "interleaved_1f1b takes V >= 2",
        ),
    ):
        with pytest.raises(SystemExit):
            main([*ESTIMATE, *extra])
        assert message in capsys.readouterr().err, extra
