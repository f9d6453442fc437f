"""The conformance table: each case is a LightningModule configuration, Trainer flags, callbacks and
what to do after ``fit``; :mod:`tests.conformance.runner` runs it under the reference strategy and
under ours, and :mod:`tests.conformance.test_conformance` compares what a user would see.

Fields of a case (all optional):
  module     keyword arguments of :class:`~tests.conformance.module.ConformanceModule`
  trainer    Trainer keyword arguments (``max_steps`` etc.; 2 CPU devices and ``64-true`` by default)
  callbacks  ``[[name, kwargs], ...]`` built fresh for every run (see ``runner.CALLBACKS``)
  after      actions on the same Trainer after ``fit``: ``"validate:best"``, ``"test:last"``,
             ``"predict:best"``, ``"fit_again"`` (a second fit of the same module, new Trainer),
             ``"load_last"`` (``ConformanceModule.load_from_checkpoint`` of the last checkpoint),
             ``"resume:last"`` (a new Trainer fits two more steps from ``last.ckpt``)
  reference  the peer whose behaviour is the spec: ``"ddp"`` (default), another registered DDP
             variant, or ``"single"`` (one process, ``N`` times the batch: for what DDP itself gets
             wrong, e.g. parameters made trainable after DDP was built are never all-reduced)
  ours       our strategies to run (default ``runner.OURS``: zero, and zero with overlap_param_gather;
             cases in ``STAGE1`` add zero1)
  refused    a substring of the error our strategies must raise (the reference must succeed)
  zero3_refused  the same, for stage 3 only (``"zero3"``: what it refuses and stages 1 and 2 do not)
  object     use strategy objects (``ZeroStrategy(...)``, ``DDPStrategy()``) instead of names
  strategy_kwargs  arguments both strategy objects take (``object`` cases), e.g. ``broadcast_buffers``
  compile_module  fit ``torch.compile(model, backend="aot_eager")`` (Lightning unwraps and recompiles)
  tol        tolerance of the comparison (default 1e-10, for float64)
  both_fail  the reference fails too (e.g. SyncBatchNorm on CPU); ours must fail with the same error
"""

from __future__ import annotations

from typing import Any

STEPS = 12  # 96 samples / (2 ranks x 4) = 12 batches per epoch

CASES: dict[str, dict[str, Any]] = {}


def _add(name: str, **case: Any) -> None:
    assert name not in CASES, name
    CASES[name] = case


_SHARDED = "which is sharded: outside its unit's forward and backward it is a placeholder"
"""Stage 3's refusal, at the op, of a read or a write of a parameter outside its unit's use (EMA, SWA,
in-place writes, a probe of the weights): it names the parameter and ``lightning_zero.gathered``."""
_REPLAN = "stage 3 cannot re-plan yet"
"""Stage 3's refusal of a trainable set that changes during fit (freezing, unfreezing, new groups)."""
_LR_MONITOR = ["LearningRateMonitor", {"logging_interval": "step", "log_momentum": True}]

# every torch LR scheduler a Lightning user returns, at step interval, with LearningRateMonitor. Under
# "zero3" only lambda, sequential (child schedulers holding the groups) and plateau_val run: a schedule
# reaches the optimizer through the param-group dicts, which are the same objects at every stage.
_SCHEDULES_ALIKE = ("step", "multistep", "exponential", "cosine", "cosine_restarts", "onecycle", "linear")
SCHEDULES_WITHOUT_ZERO3 = {f"sched_{s}" for s in (*_SCHEDULES_ALIKE, "chained")} | {
    "sched_epoch_interval",
    "sched_frequency_3",
    "plateau_epoch",
    "plateau_step",
}
for _name in (
    "lambda",
    "step",
    "multistep",
    "exponential",
    "cosine",
    "cosine_restarts",
    "onecycle",
    "linear",
    "sequential",
    "chained",
):
    _add(
        f"sched_{_name}",
        module={"scheduler": _name, "total_steps": 10},
        trainer={"max_steps": 10},
        callbacks=[_LR_MONITOR],
    )
_add(
    "sched_epoch_interval",
    module={"scheduler": "step", "interval": "epoch"},
    trainer={"max_epochs": 4, "limit_train_batches": 3},
    callbacks=[_LR_MONITOR],
)
_add(
    "sched_frequency_3",
    module={"scheduler": "exponential", "frequency": 3},
    trainer={"max_steps": 10},
    callbacks=[_LR_MONITOR],
)
_add(
    "plateau_epoch",
    module={"scheduler": "plateau", "interval": "epoch", "monitor": "loss_epoch"},
    trainer={"max_epochs": 4, "limit_train_batches": 3},
    callbacks=[_LR_MONITOR],
)
_add(
    "plateau_step",
    module={"scheduler": "plateau", "interval": "step", "monitor": "loss_step"},
    trainer={"max_steps": 8},
    callbacks=[_LR_MONITOR],
)
_add(
    "plateau_val",
    module={"scheduler": "plateau", "interval": "epoch", "monitor": "val_loss"},
    trainer={"max_epochs": 3, "limit_train_batches": 3, "limit_val_batches": 2},
    callbacks=[_LR_MONITOR],
)

# manual optimization
_add("manual_plain", module={"manual": "plain", "scheduler": "sequential"}, trainer={"max_steps": 8})
_add("manual_accumulate", module={"manual": "accumulate"}, trainer={"max_steps": 5})
_add("manual_toggle", module={"manual": "toggle"}, trainer={"max_steps": 6})
_add("manual_clip", module={"manual": "clip"}, trainer={"max_steps": 6})
_add(
    "gan_two_optimizers",
    module={"manual": "gan"},
    trainer={"max_steps": 4},
    reference="ddp_find_unused_parameters_true",  # each optimizer's step leaves the other part unused
    refused="exactly one optimizer",
)

# the trainable set changing during fit
_add(
    "freeze_mid_fit",
    callbacks=[["FreezeAt", {"step": 3}]],
    trainer={"max_steps": 8},
    reference="ddp_find_unused_parameters_true",
    zero3_refused=_REPLAN,
)
_add(
    "add_param_group_mid_fit",
    module={"frozen_backbone": True, "explicit_sampler": True},
    callbacks=[["AddGroupAt", {"step": 3}]],
    trainer={"max_steps": 8, "use_distributed_sampler": False},
    reference="single",
    zero3_refused=_REPLAN,
)
_add(
    "base_finetuning",
    module={"explicit_sampler": True},
    callbacks=[["Finetune", {}]],
    trainer={"max_epochs": 3, "limit_train_batches": 3, "use_distributed_sampler": False},
    reference="single",
    zero3_refused=_SHARDED,
)

# buffers, parameter readers and writers, gradient norms
_add("batchnorm_buffers", module={"batchnorm": True}, trainer={"max_steps": 6, "limit_val_batches": 2})
# each rank keeps its own running statistics, as DDP(broadcast_buffers=False) does
_add(
    "batchnorm_no_broadcast",
    module={"batchnorm": True},
    trainer={"max_steps": 6, "limit_val_batches": 2},
    object=True,
    strategy_kwargs={"broadcast_buffers": False},
)
# DDP skips the broadcast after a no_sync micro-batch and after every forward in manual optimization
_add(
    "batchnorm_accumulate",
    module={"batchnorm": True},
    trainer={"max_steps": 3, "accumulate_grad_batches": 2, "limit_val_batches": 0},
)
_add(
    "batchnorm_manual",
    module={"batchnorm": True, "manual": "plain"},
    trainer={"max_steps": 4, "limit_val_batches": 0},
)
_add(
    "batchnorm_accumulate_validate",
    module={"batchnorm": True},
    trainer={"max_steps": 4, "accumulate_grad_batches": 2, "val_check_interval": 4, "limit_val_batches": 2},
)
# torch's SyncBatchNorm refuses CPU tensors: under "ddp" and ours alike, with the same error
_add(
    "sync_batchnorm",
    module={"batchnorm": True},
    trainer={"max_steps": 3, "sync_batchnorm": True},
    both_fail=True,
)
_add(
    "swa",
    module={"batchnorm": True},
    trainer={"max_epochs": 3, "limit_train_batches": 4},
    callbacks=[["StochasticWeightAveraging", {"swa_lrs": 0.005, "swa_epoch_start": 1}]],
    zero3_refused=_SHARDED,
)
_add(
    "ema_callback",
    callbacks=[["EMA", {}]],
    trainer={"max_steps": 6, "val_check_interval": 3, "limit_val_batches": 2},
    zero3_refused=_SHARDED,
)
# Lightning's WeightAveraging callbacks: under "ddp" a whole AveragedModel per rank; ours keep the
# average on the shards (lightning_zero.engine.averaging), at every stage. Compared in fp32: "ddp"'s
# callback copies the model at setup, before the 64-true conversion, and averages in fp32 (a
# multi-tensor function even fails there, mixing fp32 and fp64); ours average the fp64 masters.
_WA = {"precision": "32-true"}
_add(  # EMA: validation (sanity check too) with the average swapped in, the average the weights at the end
    "ema_weight_averaging",
    callbacks=[["EMAWeightAveraging", {"decay": 0.8}], ["ModelCheckpoint", {"save_last": True}]],
    trainer={"max_steps": 6, "val_check_interval": 3, "limit_val_batches": 2, **_WA},
    tol=1e-6,
    after=["load_last"],  # the checkpoint's weights are the average
)
_add(  # SWA (no function given) of the parameters and, averaged the same way, the BatchNorm buffers
    "swa_weight_averaging_buffers",
    module={"batchnorm": True},
    callbacks=[["WeightAveraging", {}]],
    trainer={"max_epochs": 2, "limit_train_batches": 4, "val_check_interval": 2, "limit_val_batches": 2}
    | _WA,
    tol=1e-6,
)
_add(  # a multi-tensor function, buffers copied, and updates every other step from step 2 (should_update)
    "ema_multi_every_other_step",
    module={"batchnorm": True},
    callbacks=[["EMAEveryOther", {"decay": 0.7, "use_buffers": False}]],
    trainer={"max_steps": 7, "val_check_interval": 3, "limit_val_batches": 2, **_WA},
    tol=1e-6,
)
_add(  # a weights-only checkpoint holds the current weights (Lightning saves no callback state there)
    "ema_save_weights_only",
    callbacks=[
        ["EMAWeightAveraging", {"decay": 0.8}],
        ["ModelCheckpoint", {"save_weights_only": True, "save_last": True}],
    ],
    trainer={"max_steps": 4, "limit_val_batches": 0, **_WA},
    tol=1e-6,
    after=["load_last"],
)
_add(  # resuming restores the weights and the average apart (n_averaged too: the first update copies)
    "ema_resume",
    callbacks=[["EMAWeightAveraging", {"decay": 0.8}], ["ModelCheckpoint", {"save_last": True}]],
    trainer={"max_steps": 4, "limit_val_batches": 0, **_WA},
    tol=1e-6,
    after=["resume:last"],
)
_add(  # ... and the averaged BatchNorm buffers, kept whole in the callback's state
    "ema_resume_buffers",
    module={"batchnorm": True},
    callbacks=[["EMAWeightAveraging", {"decay": 0.8}], ["ModelCheckpoint", {"save_last": True}]],
    trainer={"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 2, **_WA},
    tol=1e-6,
    after=["resume:last", "load_last"],
)
_add(
    "param_reads_at_phase_changes",
    callbacks=[["ParamProbe", {}]],
    trainer={"max_steps": 6, "val_check_interval": 4, "limit_val_batches": 2},  # no validation at the end
    zero3_refused=_SHARDED,  # the read itself, where "ddp" reads the weights; gathered(...) gives them
)
_add(  # hooks between an optimizer step and the next forward that touch no parameter run as under "ddp"
    "hooks_between_steps",
    module={"between_step_hooks": True},
    callbacks=[
        ["HookCounter", {}],
        ["GradientAccumulationScheduler", {"scheduling": {0: 1, 1: 2}}],
        ["Timer", {}],
    ],
    trainer={"max_epochs": 2, "limit_train_batches": 4, "val_check_interval": 2, "limit_val_batches": 2},
)
# a parameter of the LightningModule itself, used in training_step without calling self(...)
_add(  # after fit: validate/test read the root parameter before any forward (stage 3: still sharded)
    "root_parameter",
    module={"root_scale": True},
    trainer={"max_steps": 6, "limit_val_batches": 2},
    after=["validate", "test"],
)
_add(
    "grad_norm_logging", module={"log_grad_norm": "zero"}, trainer={"max_steps": 4, "gradient_clip_val": 0.05}
)

# evaluation after fit, checkpoints
_CKPT = ["ModelCheckpoint", {"monitor": "val_loss", "save_top_k": 1, "save_last": True}]
_add(
    "evaluate_after_fit",
    trainer={"max_steps": 6, "val_check_interval": 2, "limit_val_batches": 2},
    callbacks=[_CKPT],
    after=["validate:best", "test:last", "predict:best", "load_last"],
)
_add(
    "evaluate_after_detached_teardown",
    trainer={"max_steps": 6, "val_check_interval": 2, "limit_val_batches": 2},
    callbacks=[_CKPT, ["DetachAfterFit", {}]],
    after=["validate:best", "test:last"],
)
_add(
    "save_weights_only",
    trainer={"max_steps": 4, "limit_val_batches": 0},
    callbacks=[["ModelCheckpoint", {"save_weights_only": True, "save_last": True}]],
    after=["load_last", "resume:last"],  # resuming needs optimizer state: the same refusal as ddp's
)
# "ddp" restores a checkpoint before its 64-true conversion (weights pass through fp32): compare in fp32
_add(
    "resume_last",
    trainer={"max_steps": 4, "limit_val_batches": 0, "precision": "32-true"},
    tol=1e-5,
    callbacks=[["ModelCheckpoint", {"save_last": True}]],
    after=["resume:last"],
)
_add("fit_twice", trainer={"max_steps": 4}, after=["fit_again"])
_add(  # a weight under two names: checkpoints hold it once, and every key loads back (fp32: resume)
    "tied_weights",
    module={"tied": True},
    trainer={"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 2, "precision": "32-true"},
    tol=1e-5,
    callbacks=[_CKPT],
    after=["test:best", "load_last", "resume:last"],
)

# Trainer flags
_add(
    "clip_value_accumulate",
    trainer={
        "max_steps": 5,
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.01,
        "gradient_clip_algorithm": "value",
    },
)
_add(
    "clip_norm_accumulate", trainer={"max_steps": 5, "accumulate_grad_batches": 3, "gradient_clip_val": 0.05}
)
# a global norm below the threshold must leave the gradients alone (never scale them up)
_add("clip_norm_not_reached", trainer={"max_steps": 5, "gradient_clip_val": 100.0})
_add("val_check_interval", trainer={"max_steps": 8, "val_check_interval": 3, "limit_val_batches": 2})
_add("limit_train_batches", trainer={"max_epochs": 3, "limit_train_batches": 2})
_add("fast_dev_run", trainer={"fast_dev_run": 2})
_add("overfit_batches", trainer={"max_steps": 6, "overfit_batches": 2})
_add("strategy_objects", trainer={"max_steps": 5, "accumulate_grad_batches": 2}, object=True)
_add("compile_blocks", module={"compile_blocks": True}, trainer={"max_steps": 4})
_add("compile_module", compile_module=True, module={"log_metrics": False}, trainer={"max_steps": 4})
_add(
    "registered_name",
    trainer={"max_steps": 5, "accumulate_grad_batches": 2},
    ours=["zero_by_name", "zero3_by_name"],
)
_add(
    "write_weights_in_place_bf16",
    trainer={"max_steps": 4, "precision": "bf16-true"},
    callbacks=[["WriteWeightsAt", {"step": 2}]],
    zero3_refused=_SHARDED,
)

# fp32: the sharded update runs the kernel family of the user's AdamW (torch's fused kernel and its
# for-loop/foreach update round differently, and Adam amplifies that): the default and foreach equal
# "ddp" bit for bit. The fused CPU kernel rounds the last elements of a tensor (its vectorised loop's
# tail) differently, and a shard piece ends elsewhere than the whole parameter: measured 3.7e-9 here
for _kernel, _tol in ((None, 0.0), ("foreach", 0.0), ("fused", 1e-7)):
    _add(
        f"fp32_adamw_{_kernel or 'default'}",
        module={"adam_kernel": _kernel},
        trainer={"max_steps": 8, "precision": "32-true"},
        tol=_tol,
    )

STAGE1 = {
    "ema_weight_averaging",
    "manual_plain",
    "manual_accumulate",
    "manual_clip",
    "freeze_mid_fit",
    "add_param_group_mid_fit",
    "grad_norm_logging",
    "clip_value_accumulate",
    "clip_norm_accumulate",
    "batchnorm_accumulate",
    "sched_sequential",
    "swa",
    "strategy_objects",
    "resume_last",
}
"""Cases that also run under "zero1": the gradient path (accumulation, clipping, gradient norms, rounds
of manual backward, re-planning) is where stage 1 and 2 differ."""
assert STAGE1 <= set(CASES), STAGE1 - set(CASES)
