"""`recipes.config.signatures`: schemas and checks read from constructor signatures (no Hydra composition)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy

from recipes.config.schema import TRAINER_ARGS_FROM_GROUPS, TrainerSchema
from recipes.config.signatures import (
    ArgumentError,
    check_arguments,
    field_type,
    matches,
    read_signature,
    schema_for,
)


@pytest.mark.parametrize(
    ("annotation", "default", "expected"),
    [
        (int, 1, int),
        (Optional[int], None, Optional[int]),  # noqa: UP045
        (float, None, Optional[float]),  # noqa: UP045  (a None default makes it optional)
        (Union[int, float], 0.0, Any),  # noqa: UP007  (int: batches, float: a fraction; not one type)
        (Literal["popen", "spawn"], "popen", str),
        (Literal[True, False, "link"], None, Any),
        (Union[str, Path, None], None, Optional[str]),  # noqa: UP007, UP045
        (list[int], None, Optional[list[int]]),  # noqa: UP045
        (Callable, None, Any),
        (pl.Callback, None, Any),
    ],
)
def test_field_types(annotation: Any, default: Any, expected: Any) -> None:
    assert field_type(annotation, default) == expected


@pytest.mark.parametrize(
    ("value", "annotation", "ok"),
    [
        (3, int, True),
        (True, int, False),
        (3, float, True),
        ("3", int, False),
        (None, Optional[int], True),  # noqa: UP045
        ("all", Union[int, float, None], False),  # noqa: UP007
        (0.5, Union[int, float, None], True),  # noqa: UP007
        ("link", Union[bool, Literal["link"], None], True),  # noqa: UP007
        ("links", Union[bool, Literal["link"], None], False),  # noqa: UP007
        (1, Literal[True], False),
        ([0, 1], Union[list[int], str, int], True),  # noqa: UP007
        (["a"], list[int], False),
        ("simple", Union[pl.profilers.Profiler, str, None], True),  # noqa: UP007
        ({"_target_": "x.Y"}, pl.profilers.Profiler, True),
        ({"a": 1}, pl.profilers.Profiler, False),
        ("out", Path, True),
    ],
)
def test_values_against_annotations(value: Any, annotation: Any, ok: bool) -> None:
    assert matches(value, annotation) is ok


def test_trainer_schema_has_every_trainer_argument_but_those_from_groups() -> None:
    arguments = set(inspect.signature(pl.Trainer).parameters)
    fields = [f.name for f in dataclasses.fields(TrainerSchema)]
    assert fields[0] == "_target_" and set(fields[1:]) == arguments - set(TRAINER_ARGS_FROM_GROUPS)


def test_zero_strategy_schema_takes_every_argument_and_the_timeout_as_a_node() -> None:
    lightning_zero = pytest.importorskip("lightning_zero")
    schema = schema_for(lightning_zero.ZeroStrategy)
    defaults = {f.name: f for f in dataclasses.fields(schema)}
    assert set(defaults) - {"_target_"} == set(inspect.signature(lightning_zero.ZeroStrategy).parameters)
    assert defaults["timeout"].default_factory() == {"_target_": "datetime.timedelta", "seconds": 1800}


def test_ddp_strategy_keyword_arguments_are_those_of_distributed_data_parallel() -> None:
    signature = read_signature(DDPStrategy)
    assert signature is not None and not signature.var_keyword
    assert {"static_graph", "gradient_as_bucket_view", "timeout"} <= set(signature.parameters)
    assert "device_ids" not in signature.parameters and "module" not in signature.parameters  # Lightning's


def test_check_arguments_names_the_key_and_the_closest_arguments() -> None:
    target = "lightning.pytorch.callbacks.ModelCheckpoint"
    check_arguments({"_target_": target, "save_last": "link", "every_n_train_steps": 5}, "cb")
    with pytest.raises(ArgumentError, match=r"cb.every_n_train_step: .* did you mean every_n_train_steps"):
        check_arguments({"_target_": target, "every_n_train_step": 5}, "cb")
    with pytest.raises(
        ArgumentError, match=r"cb.train_time_interval.hours: datetime.timedelta|cb.train_time"
    ):
        check_arguments({"_target_": target, "train_time_interval": 3}, "cb")
    nested = {"_target_": "lightning.pytorch.profilers.SimpleProfiler", "dirpath": "x", "file_name": "p"}
    with pytest.raises(ArgumentError, match=r"trainer.profiler.file_name: .* did you mean filename"):
        check_arguments({"_target_": "lightning.pytorch.Trainer", "profiler": nested}, "trainer")
    check_arguments(
        {"_target_": "lightning.pytorch.loggers.TensorBoardLogger", "save_dir": "x", "any": 1}, "tb"
    )
