"""Elastic policies: pure functions of what happened, returning decisions as data.

The controller executes decisions; policies never touch Ray, so every rule is
unit-testable by calling it with made-up capacities and failure counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Mapping, Optional, Set


@dataclass(frozen=True)
class Decision:
    """``action`` is ``restart`` (re-form with ``world_size`` workers) or ``fail``."""

    action: str
    reason: str
    world_size: Optional[int] = None


def workers_that_fit(free_per_node: Iterable[Mapping[str, float]],
                     per_worker: Mapping[str, float]) -> int:
    """How many worker bundles the free resources of each node can hold."""
    needed = {k: v for k, v in per_worker.items() if v > 0}
    total = 0
    for free in free_per_node:
        fits = [math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in needed.items()]
        total += min(fits) if fits else 0
    return total


@dataclass(frozen=True)
class FailurePolicy:
    """Retry after a failure until ``max_failures`` is spent (-1: unlimited)."""

    max_failures: int

    def allows(self, failures: int) -> bool:
        return self.max_failures < 0 or failures <= self.max_failures


@dataclass(frozen=True)
class ScalingPolicy:
    """Use as many workers as fit, within ``min_workers..max_workers``."""

    min_workers: int
    max_workers: int

    def decide(self, capacity: int) -> Decision:
        if capacity < self.min_workers:
            return Decision("fail", f"only {capacity} workers fit, fewer than "
                                    f"scaling.min_workers={self.min_workers}")
        size = min(capacity, self.max_workers)
        return Decision("restart", f"{capacity} workers fit; using {size} "
                                   f"(min {self.min_workers}, max {self.max_workers})", size)


def recovery_decision(failures: int, capacity: int, failure_policy: FailurePolicy,
                      scaling_policy: ScalingPolicy) -> Decision:
    """What to do after the ``failures``-th failure, with ``capacity`` workers placeable."""
    if not failure_policy.allows(failures):
        return Decision("fail", f"failure {failures} exceeds elastic.max_failures="
                                f"{failure_policy.max_failures}")
    return scaling_policy.decide(capacity)


def free_resources_per_node() -> Dict[str, Dict[str, float]]:
    """Free resources of every node Ray lists, keyed by node id."""
    import ray

    return {node: dict(res) for node, res in
            ray._private.state.state.available_resources_per_node().items()}


def live_nodes(nodes: Iterable[str], probe_timeout_s: float = 2.0) -> Set[str]:
    """The nodes that answer a ping now.

    Ray keeps listing a node that died abruptly until its health checks fail
    (seconds to tens of seconds); a zero-CPU task pinned to each node tells the
    live ones apart immediately, so recovery does not count a dead node's CPUs.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ping = ray.remote(num_cpus=0)(_pong)
    probes = {node: ping.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote() for node in nodes}
    ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=probe_timeout_s)
    return {node for node, ref in probes.items() if ref in ready}


def _pong() -> bool:
    return True
