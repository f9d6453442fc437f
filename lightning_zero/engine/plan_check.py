"""Start-up check that every rank built the same bucket plan (a mismatch would hang or corrupt).

Two control collectives, both fixed-size so they cannot themselves hang on a mismatch: an
all-gather of each rank's plan fingerprint and size; if any differ, every rank raises the same
error naming the ranks and the first differing bucket line of rank 0's and the rank's own plan.
"""

from __future__ import annotations

from lightning_zero.comm.communicator import Comm
from lightning_zero.layout.buckets import BucketPlan


class PlanMismatchError(RuntimeError):
    """Ranks built different bucket plans (different models, dtypes, requires_grad or settings)."""


def check_same_plan(plan: BucketPlan, comm: Comm) -> None:
    """Raise :class:`PlanMismatchError` on every rank if any rank's plan differs. Call on all ranks."""
    if comm.world_size == 1:
        return
    lines = plan.describe()
    mine = [plan.fingerprint(), len(plan.params), sum(p.numel for p in plan.params)]
    everyone = comm.all_gather_ints(mine)
    if all(row == everyone[0] for row in everyone):
        return
    descriptions: list[list[str] | None] = comm.all_gather_object(lines)
    reference = descriptions[0] or []
    details = []
    for rank, other in enumerate(descriptions):
        other = other or []
        if other == reference:
            continue
        first = next(
            (
                i
                for i in range(max(len(other), len(reference)))
                if i >= len(other) or i >= len(reference) or other[i] != reference[i]
            ),
            0,
        )
        ref_line = reference[first] if first < len(reference) else "<none>"
        other_line = other[first] if first < len(other) else "<none>"
        details.append(
            f"rank {rank} differs from rank 0 (params: {everyone[rank][1]} vs {everyone[0][1]}, "
            f"elements: {everyone[rank][2]} vs {everyone[0][2]}):\n  rank 0: {ref_line}\n"
            f"  rank {rank}: {other_line}"
        )
    raise PlanMismatchError(
        "ranks built different gradient bucket plans; every rank must have the same trainable parameters "
        "(names, shapes, dtypes, requires_grad, order) and the same ZeRO settings.\n" + "\n".join(details)
    )
