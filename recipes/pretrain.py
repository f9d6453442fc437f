"""Pretrain a GPT with Lightning, configured by Hydra: `python -m recipes.pretrain [overrides]`.

Run from the repository root. With no arguments it trains the `tiny` model on a few MB of the Python
standard library's source with 2 CPU processes (the groups' defaults are the CPU demo; choosing a group
takes that group's values, experiments and debug setups are opt-in); `--cfg job` prints the composed
config, `ckpt_path=last` resumes the run in `run_dir` (Hydra's `hydra.run.dir`, by default
`outputs/<run_name>`: stable, not timestamped, so the same command with `ckpt_path=last` finds it).

Flow: compose (Hydra, against the schema of `recipes.config.schema`) -> validate
(`recipes.config.validation`, before any process starts; a bad setting prints one message and exits with
status 2) -> instantiate (`recipes.config.build`) -> `trainer.fit` -> on rank 0, print a text sample and
where the results are. A rank that sees another rank die or hang (`lightning_zero.comm.CommError`)
prints that error and exits with status 75 (EX_TEMPFAIL: resumable; under SLURM the job requeues
itself, see `recipes.training.SlurmRequeue`); any other error ends with its traceback and status 1.

Several processes: Lightning's launcher re-runs this command for ranks > 0 with
`hydra.run.dir=<the same dir> hydra.output_subdir=null`, so all ranks share one run directory; Hydra
writes nothing there itself (`output_subdir: null`, `job_logging: none`), rank 0 writes `config.yaml`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

import lightning_zero
from lightning_zero.comm import end_process_group
from lightning_zero.report import PROFILE_FILE, ReportError, write_report
from recipes.config import ConfigError, Run, build_run, validate  # registers `pretrain_schema`, resolvers
from recipes.training import EXIT_PEER_FAILURE, LossPlot, peer_failure
from recipes.training.tensor_parallel import is_tensor_parallel, unsplit_copy

EXIT_CONFIG_ERROR = 2


def fail(error: ConfigError, run_dir: Path) -> None:
    """Print the error once, drop the empty run directory Hydra just created, exit non-zero."""
    if rank_zero_only.rank == 0:
        print(f"error: {error}", file=sys.stderr)
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()
    sys.exit(EXIT_CONFIG_ERROR)


def sample_text(run: Run, cfg: DictConfig) -> str:
    """Generate `sample.max_new_tokens` tokens after `sample.prompt` with the trained model."""
    tokenizer = run.datamodule.tokenizer
    assert tokenizer is not None, "the data module is set up by fit()"
    model = run.module.model
    # decoding one position at a time cannot be split along the sequence, nor run by stages
    pipeline = run.module.device_mesh["pipeline_parallel"] if run.module.pipelined else None  # type: ignore[index]
    if is_tensor_parallel(model) or pipeline is not None:
        with lightning_zero.gathered(model):
            model = unsplit_copy(model, pipeline)
    prompt = torch.tensor([tokenizer.encode(cfg.sample.prompt)], dtype=torch.long, device=run.module.device)
    generator = torch.Generator(device=run.module.device).manual_seed(cfg.seed)
    ids = model.generate(
        prompt, cfg.sample.max_new_tokens, cfg.sample.temperature, cfg.sample.top_k, generator=generator
    )
    return tokenizer.decode(ids[0].tolist())


def report(run: Run, cfg: DictConfig, sample: str, log_dir: Path) -> None:
    """Final metrics, the text sample and the locations of the run's outputs (rank 0 only); the step
    report when `log_dir` (the trainer's) holds a step profile (`strategy.profile_steps` was set)."""
    metrics = {k: float(v) for k, v in run.trainer.callback_metrics.items()}
    figures = ", ".join(
        f"{k}={metrics[k]:.4g}" for k in ("train/loss", "val/ppl", "tokens_per_s") if k in metrics
    )
    print(f"\nfinished at step {run.trainer.global_step}: {figures}")
    print(f"--- sample ({cfg.sample.max_new_tokens} tokens after {cfg.sample.prompt!r}) ---")
    print(sample)
    print("---")
    print(f"run directory: {run.run_dir.resolve()}")
    for logger in run.trainer.loggers:
        print(f"logs ({type(logger).__name__}): {Path(logger.log_dir or logger.save_dir or '.').resolve()}")
    plots = [c.written for c in run.trainer.callbacks if isinstance(c, LossPlot) and c.written is not None]
    for path in plots:
        print(f"loss curves: {path.resolve()}")
    if (log_dir / PROFILE_FILE).is_file():
        try:
            step = write_report(log_dir / PROFILE_FILE)
            print(f"step report: {step.page.resolve()}", *step.summary, sep="\n  ")
        except (ReportError, ModuleNotFoundError) as error:
            print(f"step report not written: {error}", file=sys.stderr)
    callback = run.checkpoint_callback
    if callback is not None and callback.last_model_path:
        print(f"checkpoint: {Path(callback.last_model_path).resolve()}")
        print("resume with the same command plus: ckpt_path=last")  # same groups: same run_name and run_dir


@hydra.main(version_base="1.3", config_path="../conf", config_name="pretrain")
def main(cfg: DictConfig) -> None:
    """Compose, validate, instantiate, fit, sample."""
    try:
        configs = validate(cfg)
    except ConfigError as error:
        fail(error, Path(cfg.run_dir))
    run = build_run(cfg, configs)
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path)
    except Exception as error:
        failure = peer_failure(error)
        if failure is None:
            raise
        print(
            f"error: {failure}\nexit status {EXIT_PEER_FAILURE}: another rank failed or hung (its own output "
            "says why, if it could); the run resumes from its newest complete checkpoint with the same "
            "command plus ckpt_path=last (under SLURM the job requeues itself: docs/clusters.md)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(EXIT_PEER_FAILURE)
    # every rank samples: under zero3 the model stays sharded after fit, and its forward gathers; under
    # tensor or pipeline parallelism every rank gathers the whole model (`sample_text`)
    sample = sample_text(run, cfg)
    log_dir = Path(run.trainer.log_dir or run.run_dir)  # a broadcast inside: every rank asks
    if run.trainer.is_global_zero:
        report(run, cfg, sample, log_dir)
    # every rank, its work done: a gloo group left to the interpreter's exit-time destructors can abort
    # a finished run ("terminate called without an active exception", exit status -6; seen once in a
    # docs session of the demo's resume, after its report)
    end_process_group()


if __name__ == "__main__":
    main()
