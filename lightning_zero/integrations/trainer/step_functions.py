"""Lightning's step functions under ``ZeroStrategy``: what runs around ``training_step``,
``validation_step``, ``test_step`` and ``predict_step`` in place of DDP's wrapper forward.

``StepFunctions`` is :class:`~lightning_zero.integrations.trainer.checkpointing.ShardedCheckpointing`
plus these overrides; ``ZeroStrategy`` derives from it and owns the front end they drive.

  * before a training step: a changed trainable set is re-planned, the engine's step count follows
    ``trainer.global_step``, buffers are broadcast as DDP does, and the root's parameters are waited
    for (``overlap_param_gather``) or gathered (stage 3): Lightning calls the step function, not the
    root's forward, so the root's forward pre-hook does not run before it;
  * validation during ``fit`` is handled as a training forward is (buffers, waits); outside ``fit``
    and for test/predict only a sharded root is gathered, as DDP's wrapper is not there either;
  * under pipeline parallelism the strategy's schedule replaces the LightningModule's step functions
    (:mod:`lightning_zero.integrations.trainer.pipeline`), inside the precision plugin's contexts.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_zero.engine.parameters import sharded_engine
from lightning_zero.integrations.trainer.checkpointing import ShardedCheckpointing
from lightning_zero.integrations.trainer.pipeline import TrainerPipeline


class StepFunctions(ShardedCheckpointing):
    """The step-function overrides of ``ZeroStrategy`` (see the module docstring)."""

    _pipeline: TrainerPipeline | None = None
    """Pipeline parallelism: this rank's stages and their schedules (set at setup)."""

    def _step(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Lightning's ``{kind}_step``: the LightningModule's, or the pipeline's schedule."""
        pipeline = self._pipeline
        if pipeline is None:
            return getattr(super(), f"{kind}_step")(*args, **kwargs)
        batch = args[0] if args else kwargs["batch"]
        context = {"training": "train", "validation": "val"}.get(kind, kind)
        with getattr(self.precision_plugin, f"{context}_step_context")():
            if kind == "training":
                return pipeline.training_step(batch, args[1] if len(args) > 1 else kwargs["batch_idx"])
            if kind == "predict":
                return pipeline.predict_step(batch)
            return pipeline.evaluation_step(batch)

    def wait_for_params(self) -> None:
        """Complete the parameter all-gathers left in flight by ``overlap_param_gather``: needed before
        reading parameters outside a module's forward in code the strategy does not know of."""
        self._zero.wait_for_params()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        self._zero.replan_if_changed(module, where=f"global step {module.trainer.global_step}")
        # a non-finite-gradient error names Lightning's step, also after a resume
        self._zero.count_steps_from(module.trainer.global_step)
        self._zero.before_forward(module)
        self._before_step_function()
        output = self._step("training", args, kwargs)
        # manual optimization: Lightning turns DDP's sync off around the forward
        self._zero.after_forward(sync_applies=module.automatic_optimization)
        return output

    def _before_step_function(self) -> None:
        """Lightning calls ``training_step``/``validation_step``, not the root's forward, so the root's
        forward pre-hook does not run before them: its parameters are waited for (overlapped
        gathers) or gathered (stage 3) here."""
        if self._gather_sharded_root():
            return
        engine = self._zero.engine
        if engine is not None:
            engine.wait_for_params(root_only=True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._fitting():  # trainer.validate(): DDP's wrapper is not there either
            self._gather_sharded_root()
            return self._step("validation", args, kwargs)
        module = self.lightning_module
        assert module is not None
        self._zero.before_forward(module)
        self._before_step_function()
        output = self._step("validation", args, kwargs)
        self._zero.after_forward(sync_applies=module.automatic_optimization)
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._gather_sharded_root()
        return self._step("test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._gather_sharded_root()
        return self._step("predict", args, kwargs)

    def _gather_sharded_root(self) -> bool:
        """Stage 3 (during fit, after it, or a model another Trainer left sharded): gather the root
        unit, which a step function may use without the module's forward (units gather in their
        own forward). Whether the model is sharded."""
        sharded = sharded_engine(self.lightning_module)
        if sharded is not None:
            sharded.gather_root()
        return sharded is not None
