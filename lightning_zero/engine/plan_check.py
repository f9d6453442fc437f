"""Start-up check that every rank built the same bucket plan (a mismatch would hang or corrupt).

One fixed-size control all-reduce (the maximum of each rank's plan fingerprint and size and of their
negatives: equal on every rank iff the maximum of ``v`` is minus the maximum of ``-v``), so what a rank
sends and receives does not grow with the world size and cannot itself hang on a mismatch. Only if
they differ: an all-gather of the fingerprints and sizes and of the plans' descriptions, and every
rank raises the same error naming the ranks and the first differing bucket line of rank 0's and the
rank's own plan.
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
    if comm.same_everywhere(mine):  # one all-reduce whatever the world size; details only on a mismatch
        return
    everyone = comm.all_gather_ints(mine)
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
