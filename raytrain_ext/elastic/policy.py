"""Elastic policies: pure functions of what happened, returning decisions as data.

The controller executes decisions; policies never touch Ray (what the cluster has
room for is asked by ``cluster_probe`` and passed in as numbers), so every rule is
unit-testable by calling it with made-up capacities and failure counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Iterable, Mapping, Optional

if TYPE_CHECKING:
    from raytrain_ext.elastic.in_place import InPlacePlan


class Action(StrEnum):
    """What the controller does after a failure (a ``str``: records and logs print it).

    ``REPLACE`` and ``SHRINK`` are chosen from the surviving processes
    (``decision.decide_recovery``); the policies here return ``RESTART`` or ``FAIL``.
    """

    RESTART = "restart"  # re-form with ``Decision.world_size`` workers
    REPLACE = "replace"  # re-form in place at the same size, surviving processes kept
    SHRINK = "shrink"  # re-form in place smaller, surviving processes kept
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    """``world_size``: the next group's size (None: to be measured, or FAIL); ``plan``: for
    REPLACE and SHRINK, the re-form in place the group carries out."""

    action: Action
    reason: str
    world_size: Optional[int] = None
    plan: Optional["InPlacePlan"] = None


def workers_that_fit(
    free_per_node: Iterable[Mapping[str, float]], per_worker: Mapping[str, float]
) -> int:
    """How many worker bundles the free resources of each node can hold."""
    needed = {k: v for k, v in per_worker.items() if v > 0}
    total = 0
    for free in free_per_node:
        fits = [math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in needed.items()]
        total += min(fits) if fits else 0
    return total


@dataclass(frozen=True)
class Budget:
    """How many times a run may recover from one kind of event (-1: unlimited).

    Failures and preemptions have separate budgets (``elastic.max_failures``,
    ``elastic.max_preemptions``): a spot reclaim never spends the failure budget.
    ``key`` is the config key that sets ``limit``, named when the budget is spent.
    """

    limit: int
    key: str

    def allows(self, used: int) -> bool:
        return self.limit < 0 or used <= self.limit

    def spent(self, used: int, what: str) -> str:
        return f"{what} {used} exceeds {self.key}={self.limit}"


@dataclass(frozen=True)
class ScalingPolicy:
    """Use as many workers as fit, within ``min_workers..max_workers``, in multiples of ``unit``.

    ``unit`` is the model-parallel group (``dp_replicate x tp x pp x ep``): a TP or
    pipeline layout can only shrink or grow by whole groups.
    """

    min_workers: int
    max_workers: int
    unit: int = 1

    def size_for(self, capacity: int) -> int:
        """The largest allowed world size that fits ``capacity`` (may be below min)."""
        return min(capacity, self.max_workers) // self.unit * self.unit

    def decide(self, capacity: int) -> Decision:
        size = self.size_for(capacity)
        if size < self.min_workers:
            return Decision(
                Action.FAIL,
                f"only {capacity} workers fit, fewer than "
                f"scaling.min_workers={self.min_workers}"
                + (f" in multiples of {self.unit}" if self.unit > 1 else ""),
            )
        return Decision(
            Action.RESTART,
            f"{capacity} workers fit; using {size} "
            f"(min {self.min_workers}, max {self.max_workers}"
            + (f", multiples of {self.unit})" if self.unit > 1 else ")"),
            size,
        )


def recovery_decision(
    failures: int, capacity: int, failure_budget: Budget, scaling_policy: ScalingPolicy
) -> Decision:
    """What to do after the ``failures``-th failure, with ``capacity`` workers placeable."""
    if not failure_budget.allows(failures):
        return Decision(Action.FAIL, failure_budget.spent(failures, "failure"))
    return scaling_policy.decide(capacity)


@dataclass
class GrowPolicy:
    """When to grow a running group back toward ``max_workers`` (hysteresis included).

    Extra capacity must be seen continuously for ``stable_s`` (a flapping node
    resets the clock each time it vanishes), and at least ``cooldown_s`` must
    have passed since the group was last re-formed for any reason, so a run
    is resized at most once per cooldown.  ``observe`` returns the world size to
    grow to, or None to keep running.
    """

    max_workers: int
    cooldown_s: float
    stable_s: float
    unit: int = 1  # grow by whole model-parallel groups
    seen_since: Optional[float] = None

    def observe(
        self, now: float, world_size: int, extra_fit: int, last_reform_at: float
    ) -> Optional[int]:
        target = min(self.max_workers, world_size + extra_fit) // self.unit * self.unit
        if target <= world_size:
            self.seen_since = None
            return None
        if self.seen_since is None:
            self.seen_since = now
        if now - self.seen_since < self.stable_s or now - last_reform_at < self.cooldown_s:
            return None
        return target
