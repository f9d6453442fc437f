"""Non-finite gradients: found on each rank before sending, agreed once per step, skipped everywhere.

With ``ZeroConfig.skip_nonfinite_steps = K > 0`` (:class:`NonFiniteGuard`):

  1. **Check, per bucket, on the device.** Just before a bucket's collective launches, the reducer
     hands the encoded bucket (this rank's local gradients, averaged, in the wire dtype) to
     :meth:`NonFiniteGuard.inspect`: one fused ``aminmax`` pass whose two scalars stay on the device
     (no host synchronisation per bucket). A NaN or inf after the reduction can only come from a
     local one (Megatron-Core checks the same place), except on a wire narrower than the
     accumulation dtype, where a sum of finite means can overflow: there the codec also inspects the
     reduced part this rank keeps (:mod:`lightning_zero.engine.codecs`, :meth:`inspect_reduced`).
  2. **Agree once per step, all ranks.** Each rank's verdicts become a ``(2, world_size)`` int vector
     with its own entries set (non-finite before sending; after the reduction); a max all-reduce tells
     every rank *which* ranks saw non-finite values: those that sent them, or, when none did, those
     holding a reduced sum that overflowed the wire dtype.
     With ``find_unused_parameters=True`` the vector rides on the used-parameter mask's all-reduce
     (no extra collective, no extra host synchronisation); otherwise :meth:`NonFiniteGuard.agree`
     makes one small control all-reduce and one host synchronisation at the step (world size 1:
     the host synchronisation only). When fp16 loss scaling has already found every shard finite
     (``unscale_``), the answer is known and nothing is sent.
  3. **Skip or update, the same on every rank.** A step some rank saw inf/NaN in is skipped on every
     rank by the engine: gradients dropped, nothing updated, nothing gathered; it is counted
     (:attr:`NonFiniteGuard.skipped_steps`), and the ``K``-th skipped step in a row raises
     :class:`NonFiniteGradientError` on every rank at the same step, so no rank is left waiting in a
     collective the others never join.

Limits: the gradients are checked, not the update (an Adam step that itself overflows is not caught);
a step skipped by fp16 loss scaling (the scaler's own overflow check) never reaches the guard and is
neither counted nor part of a run of skips.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.comm.communicator import Comm


class NonFiniteGradientError(RuntimeError):
    """``skip_nonfinite_steps`` optimizer steps in a row had inf/NaN gradients (raised on every rank).

    Attributes:
        step: the optimizer step of the last skipped step.
        ranks: the ranks that saw non-finite values in it.
    """

    def __init__(self, message: str, step: int, ranks: list[int]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks


class NonFiniteGuard:
    """Detection, agreement and counting of non-finite gradient steps for one engine.

    Args:
        comm: the data-parallel group's communicator.
        limit: ``skip_nonfinite_steps`` (``0``: off; the reducer then never calls :meth:`inspect`).
    """

    def __init__(self, comm: Comm, limit: int) -> None:
        self.comm = comm
        self.limit = limit
        self.also: Comm | None = None
        """Tensor parallelism's group: the flags are agreed over it too (its ranks hold other slices
        of the same gradients, and must skip or step together)."""
        self.pipeline: Comm | None = None
        """Pipeline parallelism's group: the flags are agreed over it last (its ranks hold the other
        stages, whose parameters differ: only the flags, never a used-parameter mask)."""
        self.skipped_steps = 0
        """Steps skipped since the engine was built."""
        self.consecutive = 0
        """Skipped steps in a row, up to the latest step."""
        self.last_ranks: list[int] = []
        """The ranks that saw inf/NaN in the latest skipped step."""
        self.first_of_run: int | None = None
        """The optimizer step that started the current run of skipped steps."""
        # (2,) float64 min and max of each inspected tensor, on the device: before sending | reduced
        self._extremes: tuple[list[Tensor], list[Tensor]] = ([], [])
        self._agreed: list[int] | None = None  # the ranks that saw inf/NaN, once agreed
        self._in_reduction = False  # the agreed ranks only hold an overflowed sum

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def inspect(self, tensor: Tensor) -> None:
        """Note whether ``tensor``, this rank's gradients about to be sent, holds inf/NaN: one pass,
        the result kept on the device (no host synchronisation)."""
        self._note(tensor, self._extremes[0])

    def inspect_reduced(self, tensor: Tensor) -> None:
        """The same for a reduced part this rank keeps (a narrower wire's sum may overflow)."""
        self._note(tensor, self._extremes[1])

    @torch.no_grad()
    def _note(self, tensor: Tensor, into: list[Tensor]) -> None:
        low, high = torch.aminmax(tensor)  # NaN propagates into both; +-inf shows in one of them
        into.append(torch.stack((low, high)).to(torch.float64))  # exact for every float dtype
        self._agreed = None

    @torch.no_grad()
    def local_flags(self) -> Tensor:
        """``(2 * world_size,)`` int32 on the communication device: at this rank's entry of the first
        half 1 if anything it sent since the last :meth:`reset` held inf/NaN, of the second half 1 if
        a reduced part did; 0 elsewhere. No host synchronisation (on the compute device's backend)."""
        world_size = self.comm.world_size
        flags = torch.zeros(2 * world_size, dtype=torch.int32, device=self.comm.device)
        for half, extremes in enumerate(self._extremes):
            if extremes:
                seen = torch.cat(extremes)  # (2 * inspected,)
                extremes[:] = [seen]  # later rounds of the same step add to it
                bad = (~torch.isfinite(seen).all()).to(flags.device, torch.int32)
                flags[half * world_size + self.comm.rank] = bad
        return flags

    def agree_also(self, flags: Tensor) -> None:
        """Max-reduce ``flags`` (already agreed over the data-parallel ranks) over :attr:`also`."""
        if self.also is not None:
            self.also.wait(self.also.all_reduce(flags, op="max", control=True))

    def agree_across_stages(self, flags: Tensor) -> None:
        """Max-reduce ``flags`` (this guard's :meth:`local_flags`, already agreed over the data- and
        tensor-parallel ranks) over :attr:`pipeline`: a stage's non-finite gradient skips every stage."""
        if self.pipeline is not None:
            self.pipeline.wait(self.pipeline.all_reduce(flags, op="max", control=True))

    def agreed(self, flags: Sequence[int]) -> None:
        """Take the all-reduced flags (e.g. from the used-parameter mask's all-reduce)."""
        world_size = self.comm.world_size
        sent = [rank for rank in range(world_size) if flags[rank]]
        reduced = [rank for rank in range(world_size) if flags[world_size + rank]]
        self._in_reduction = not sent and bool(reduced)
        self._agreed = sent or reduced

    def known_finite(self) -> None:
        """Every rank's gradients are known to be finite (loss scaling checked every shard)."""
        self._agreed = []
        self._in_reduction = False

    def agree(self) -> list[int]:
        """The ranks that saw inf/NaN in this step's gradients, the same list on every rank.

        Must be called on all ranks (one small all-reduce unless already agreed).
        """
        if self._agreed is None:
            flags = self.local_flags()
            if self.comm.world_size > 1:
                self.comm.wait(self.comm.all_reduce(flags, op="max", control=True))
            self.agree_also(flags)
            self.agree_across_stages(flags)
            self.agreed(flags.tolist())  # the step's one host synchronisation
        assert self._agreed is not None
        return self._agreed

    def reset(self) -> None:
        """A new step: forget what was inspected."""
        self._extremes = ([], [])
        self._agreed = None

    def updated(self) -> None:
        """The step was finite and applied: a run of skipped steps ends."""
        self.consecutive = 0
        self.first_of_run = None

    def skipped(self, step: int, ranks: list[int]) -> None:
        """Count a skipped step.

        Raises:
            NonFiniteGradientError: it is the ``limit``-th skipped step in a row.
        """
        self.skipped_steps += 1
        self.consecutive += 1
        self.last_ranks = list(ranks)
        if self.first_of_run is None:
            self.first_of_run = step
        if self.consecutive >= self.limit:
            since = "" if self.consecutive == 1 else f" (steps {self.first_of_run} to {step})"
            where = " (in the reduced sum: too large for the wire dtype)" if self._in_reduction else ""
            raise NonFiniteGradientError(
                f"non-finite gradients (inf/NaN) at optimizer step {step} on rank(s) "
                f"{', '.join(map(str, ranks))}{where}: {self.consecutive} step(s) in a row skipped{since}, "
                f"the limit set by skip_nonfinite_steps={self.limit}. Parameters and optimizer state "
                "are those before the first skipped step.",
                step,
                ranks,
            )
