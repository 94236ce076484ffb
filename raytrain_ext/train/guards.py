"""In-run guards as pure decisions: stragglers and non-finite steps.

Both guards see only numbers every rank already has after a step (the
all-gathered per-rank compute times, the globally reduced gradient norm), so
every rank reaches the same decision without an extra collective, and the
logic is unit-testable without processes.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Dict, List, Sequence


@dataclass
class StragglerDetector:
    """Flags a rank whose compute time stays above ``factor`` x its peers' median.

    A rank is compared with the median of the *other* ranks (with two ranks the
    median of all would sit halfway and hide a 2x straggler).  It is flagged after
    ``window`` consecutive slow steps and stays flagged until a step is normal
    again, so one noisy step neither raises nor clears the flag.  Differences
    below ``min_excess_s`` are ignored: on millisecond steps, jitter is not a straggler.
    """

    factor: float
    window: int
    min_excess_s: float = 0.005
    streaks: Dict[int, int] = field(default_factory=dict)

    def observe(self, compute_s: Sequence[float]) -> List[int]:
        """Feed one step's per-rank compute times; returns the ranks flagged now."""
        if len(compute_s) < 2:
            return []
        for rank, seconds in enumerate(compute_s):
            peers = statistics.median(s for r, s in enumerate(compute_s) if r != rank)
            slow = seconds > self.factor * peers and seconds - peers > self.min_excess_s
            self.streaks[rank] = self.streaks.get(rank, 0) + 1 if slow else 0
        return self.flagged()

    def flagged(self) -> List[int]:
        return sorted(r for r, n in self.streaks.items() if n >= self.window)


class StepAction(StrEnum):
    """What a step with a non-finite loss or gradient norm gets (every rank alike)."""

    OK = "ok"  # finite: the update is applied
    SKIP = "skip"  # no update, the batch is consumed
    ROLLBACK = "rollback"  # restore the last checkpoint and skip this batch
    FAIL = "fail"


@dataclass(frozen=True)
class NonFiniteDecision:
    action: StepAction
    reason: str = ""


def nonfinite_decision(
    policy: str,
    loss: float,
    grad_norm: float,
    nonfinite_so_far: int,
    max_nonfinite: int,
    can_rollback: bool,
) -> NonFiniteDecision:
    """What to do with a step whose loss or gradient norm is NaN/Inf.

    The gradient norm is computed from all-reduced gradients, so a NaN on any
    rank reaches every rank: all ranks decide alike.  ``nonfinite_so_far``
    counts earlier non-finite steps of this run; past ``max_nonfinite`` the run
    fails whatever the policy, because a model that keeps diverging is not
    rescued by skipping batches.  ``rollback`` without a committed checkpoint
    degrades to ``skip`` (there is nothing to roll back to).
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return NonFiniteDecision(StepAction.OK)
    what = f"loss {loss}, grad_norm {grad_norm}"
    if policy == "fail":
        return NonFiniteDecision(StepAction.FAIL, f"{what} (guards.nan_policy=fail)")
    if nonfinite_so_far + 1 > max_nonfinite:
        return NonFiniteDecision(
            StepAction.FAIL,
            f"{what}: {nonfinite_so_far + 1} non-finite steps exceed "
            f"guards.max_nan_steps={max_nonfinite}",
        )
    if policy == "rollback" and can_rollback:
        return NonFiniteDecision(
            StepAction.ROLLBACK, f"{what}: restoring the last checkpoint and skipping this batch"
        )
    fallback = " (no committed checkpoint to roll back to)" if policy == "rollback" else ""
    return NonFiniteDecision(StepAction.SKIP, f"{what}: update skipped, batch consumed{fallback}")


class NonFiniteLossError(RuntimeError):
    """Raised by every rank together when the NaN policy says fail; not retried."""
