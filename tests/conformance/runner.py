"""Run conformance cases under several strategies, in one launch, and save what a user would see.

Lightning's launcher re-runs this script for rank 1, which then runs the same cases in the same
order; every case's error is caught and recorded on every rank alike, so one refused case does
not end the others. Each rank saves its own results to ``OUT.rank<R>``::

    python -m tests.conformance.runner --out results.pt --workdir DIR --cases sched_step,fit_twice

``run_case(name, "single")`` runs the one-process reference (``N`` times the batch) in the caller.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    EMAWeightAveraging,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
    Timer,
    WeightAveraging,
)
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero.engine.parameters import sharded_engine
from tests.conformance import module as M
from tests.conformance.cases import CASES, SCHEDULES_WITHOUT_ZERO3, STAGE1

WORLD_SIZE = 2
"""Processes per launch (``--world-size``; 4 for the hybrid launch)."""
OURS = ["zero", "zero_overlap", "zero3"]
"""Our strategies every case runs under unless it names its own; cases that exercise the gradient
path (where stage 1 differs: all-reduce instead of reduce-scatter) add "zero1" (``cases.STAGE1``)."""
HYBRID = ["zero_2x2"]
"""With ``--hybrid`` (4 ranks): stage 2 sharded over 2 groups of 2 ranks, replicated across them."""
CALLBACKS: dict[str, Any] = {
    "LearningRateMonitor": LearningRateMonitor,
    "ModelCheckpoint": ModelCheckpoint,
    "StochasticWeightAveraging": StochasticWeightAveraging,
    "FreezeAt": M.FreezeAt,
    "AddGroupAt": M.AddGroupAt,
    "Finetune": M.Finetune,
    "EMA": M.EMA,
    "DetachAfterFit": M.DetachAfterFit,
    "WriteWeightsAt": M.WriteWeightsAt,
    "ParamProbe": M.ParamProbe,
    "HookCounter": M.HookCounter,
    "GradientAccumulationScheduler": GradientAccumulationScheduler,
    "Timer": Timer,
    "EMAWeightAveraging": EMAWeightAveraging,
    "WeightAveraging": WeightAveraging,
    "EMAEveryOther": M.EMAEveryOther,
}
_SMALL_BUCKETS = {"bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.0005}  # several buckets on this model


def _strategy(name: str, as_object: bool, kwargs: dict[str, Any]) -> Any:
    """``kwargs``: arguments both strategies take (e.g. ``broadcast_buffers``), for object cases."""
    assert as_object or not kwargs, "strategy_kwargs need object=True"
    if name in ("zero", "zero1", "zero2", "zero_overlap", "zero_2x2"):
        from lightning_zero import ZeroStrategy

        overlap = name == "zero_overlap"  # parameter gathers left in flight into the next forward
        stage = 1 if name == "zero1" else 2
        if name == "zero_2x2":
            kwargs = {**kwargs, "shard_group_size": 2}
        return ZeroStrategy(stage=stage, overlap_param_gather=overlap, **_SMALL_BUCKETS, **kwargs)
    if name == "zero3":  # the backbone's two Linear layers are units, the head the root's
        from lightning_zero import ZeroStrategy

        return ZeroStrategy(stage=3, min_unit_numel=0, **_SMALL_BUCKETS, **kwargs)
    if name in ("zero_by_name", "zero3_by_name"):
        return name.removesuffix("_by_name")
    if as_object and name == "ddp":
        return DDPStrategy(**kwargs)
    return name


def _trainer(
    case: dict[str, Any], strategy: str, root: Path, logger: M.MemoryLogger
) -> tuple[L.Trainer, M.Recorder]:
    recorder = M.Recorder()
    callbacks = [CALLBACKS[name](**kwargs) for name, kwargs in case.get("callbacks", [])]
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint):
            cb.dirpath = str(root / "ckpt")
    single = strategy == "single"
    flags = {"precision": "64-true", **case.get("trainer", {})}
    trainer = L.Trainer(
        strategy="auto"
        if single
        else _strategy(strategy, case.get("object", False), case.get("strategy_kwargs", {})),
        devices=1 if single else WORLD_SIZE,
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callbacks),
        default_root_dir=str(root),
        callbacks=[*callbacks, recorder, *([M.DeferGathers()] if strategy == "zero_overlap" else [])],
        **flags,
    )
    return trainer, recorder


def _module(case: dict[str, Any], strategy: str) -> M.ConformanceModule:
    kwargs = dict(case.get("module", {}))
    if strategy == "single":
        kwargs["batch_size"] = kwargs.get("batch_size", 4) * WORLD_SIZE
    return M.ConformanceModule(**kwargs)


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def _after(
    action: str,
    trainer: L.Trainer,
    model: M.ConformanceModule,
    case: dict[str, Any],
    strategy: str,
    root: Path,
) -> Any:
    kind, _, ckpt = action.partition(":")
    ckpt_path = ckpt or None
    if kind == "validate":
        metrics = trainer.validate(model, ckpt_path=ckpt_path, verbose=False)
        return {"metrics": metrics, "params": _tensors(model)}
    if kind == "test":
        metrics = trainer.test(model, ckpt_path=ckpt_path, verbose=False)
        return {"metrics": metrics, "params": _tensors(model)}
    if kind == "predict":
        out = trainer.predict(model, ckpt_path=ckpt_path)
        return torch.cat([t.detach().cpu() for t in out])  # type: ignore[union-attr, misc]
    if kind == "fit_again":
        second, _ = _trainer(case, strategy, root / "again", M.MemoryLogger())
        second.fit(model)
        return _tensors(model)
    if kind == "resume":  # a new Trainer continues from the checkpoint for two more steps
        flags = dict(case.get("trainer", {}))
        flags["max_steps"] = trainer.global_step + 2
        again, _ = _trainer({**case, "trainer": flags}, strategy, root / "resumed", M.MemoryLogger())
        fresh = _module(case, strategy)
        try:
            again.fit(fresh, ckpt_path=str(root / "ckpt" / f"{ckpt}.ckpt"))
        except Exception as err:  # noqa: BLE001 - the error is the result to compare
            return f"{type(err).__name__}: {err}"
        return _tensors(fresh)
    if kind == "load_last":
        last = root / "ckpt" / "last.ckpt"
        return _tensors(M.ConformanceModule.load_from_checkpoint(last, map_location="cpu"))
    raise ValueError(f"unknown action {action!r}")


def launched_strategies(name: str, hybrid: bool = False) -> list[str]:
    """The multi-process runs of a case: its reference (unless one process) and ours."""
    case = CASES[name]
    reference = case.get("reference", "ddp")
    return ([] if reference == "single" else [reference]) + ours_of(name, hybrid)


def ours_of(name: str, hybrid: bool = False) -> list[str]:
    """Our strategies a case runs under (``hybrid``: in the 4-rank launch, :data:`HYBRID`)."""
    if hybrid:
        return list(HYBRID)
    case = CASES[name]
    ours = [s for s in OURS if not (s == "zero3" and name in SCHEDULES_WITHOUT_ZERO3)]
    return list(case.get("ours", ours + (["zero1"] if name in STAGE1 else [])))


def run_case(name: str, strategy: str, workdir: Path) -> dict[str, Any]:
    """Run one case under one strategy; everything recorded as plain tensors and numbers."""
    case = CASES[name]
    root = workdir / f"{name}-{strategy}"
    logger = M.MemoryLogger()
    result: dict[str, Any] = {"error": None}
    try:
        trainer, recorder = _trainer(case, strategy, root, logger)
        model = _module(case, strategy)
        if case.get("compile_module"):  # trainer.fit(torch.compile(model)): Lightning unwraps and re-applies
            trainer.fit(torch.compile(model, backend="aot_eager"))  # type: ignore[arg-type]
        else:
            trainer.fit(model)
        result.update(
            recorded=[cb.recorded for cb in trainer.callbacks if hasattr(cb, "recorded")],  # type: ignore[attr-defined]
            lrs=recorder.steps,
            params=_tensors(model),
            sharded_after_fit=sharded_engine(model) is not None,  # stage 3 keeps the model sharded
            global_step=trainer.global_step,
            epoch=trainer.current_epoch,
            callback_metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
        )
        result["after"] = {
            action: _after(action, trainer, model, case, strategy, root) for action in case.get("after", [])
        }
    except Exception as err:  # noqa: BLE001 - recorded and compared: a refusal is a result
        result["error"] = f"{type(err).__name__}: {err}"
    result["logged"] = logger.rows
    return result


def main() -> None:
    import lightning_zero  # noqa: F401  # registers the strategy names

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="comma-separated case names")
    parser.add_argument("--workdir", required=True, help="shared by the ranks: checkpoints go there")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hybrid", action="store_true", help="run the cases under HYBRID (4 ranks)")
    args = parser.parse_args()
    global WORLD_SIZE  # noqa: PLW0603 - one launch, one world size
    WORLD_SIZE = args.world_size
    workdir = Path(args.workdir)
    results: dict[str, dict[str, Any]] = {}
    for name in args.cases.split(","):
        for strategy in launched_strategies(name, args.hybrid):
            results[f"{name}/{strategy}"] = run_case(name, strategy, workdir)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.save(results, f"{args.out}.rank{rank}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
