"""How many workers to run: at the start, after a failure or preemption, and when to grow.

Reads the cluster through an injected ``Cluster`` and decides with the pure
policies of ``policy.py``; the controller executes what it returns.  A node
counts only when it answered a ping or one of the group's ranks has just
answered from it (Ray keeps listing a dead node for a while), and never when
the run avoids it (preempted, or a straggler's).  Warm spares are placed with
the gang, so the capacity they need is taken off every count.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Dict, Iterable, Optional, Set

from raytrain_ext.elastic.cluster_probe import Cluster
from raytrain_ext.elastic.decision import Situation, decide_recovery
from raytrain_ext.elastic.policy import (
    Action,
    Budget,
    Decision,
    GrowPolicy,
    ScalingPolicy,
    workers_that_fit,
)
from raytrain_ext.parallel.dims import resize_unit

log = logging.getLogger(__name__)


class Capacity:
    def __init__(
        self,
        cfg,
        cluster: Cluster,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ):
        s, e = cfg.scaling, cfg.elastic
        unit = resize_unit(cfg.parallel)
        self.scaling = ScalingPolicy(s.min_workers, s.max_workers, unit)
        self.grow = GrowPolicy(s.max_workers, e.resize_cooldown_s, e.grow_stable_s, unit)
        self.per_worker = dict(s.resources_per_worker)
        self.spares = e.spare_workers
        self.grow_check_s = e.grow_check_s
        self.cluster, self.clock, self.sleep = cluster, clock, sleep
        self._known_alive: Set[str] = set()
        self._grow_probe = cluster.node_probe((), ())
        self._last_grow_check = 0.0

    def note_alive(self, nodes: Iterable[str]) -> None:
        """Nodes just proven alive (their ranks answered): the next capacity check counts
        them without a ping, which on a loaded node can outlast the check."""
        self._known_alive = set(nodes)

    def initial_size(self, num_workers: int, avoid: Set[str]) -> int:
        """As many workers as fit now, within min..max (``num_workers`` when fewer than min
        fit: the placement then waits ``scaling.placement_timeout_s`` for capacity)."""
        free = self.cluster.free_resources()  # at the start the node list is fresh: no ping
        capacity = self._fit(free, set(free), avoid) - self.spares
        size = self.scaling.size_for(capacity)
        if size < self.scaling.min_workers:
            return num_workers
        log.info(
            "controller: %d workers fit; starting with %d (min %d, max %d)",
            capacity,
            size,
            self.scaling.min_workers,
            self.scaling.max_workers,
        )
        return size

    def grow_target(self, world_size: int, avoid: Set[str], last_reform_at: float) -> Optional[int]:
        """The size to grow to, once the grow policy agrees (checked every
        ``elastic.grow_check_s``); None to keep running as is."""
        now = self.clock()
        if (
            now - self._last_grow_check < self.grow_check_s
            or world_size >= self.scaling.max_workers
        ):
            return None
        self._last_grow_check = now
        free = self.cluster.free_resources()
        self._grow_probe.add(free)  # only nodes that answer count: a listed node may be dead
        extra = self._fit(free, self._grow_probe.answered(timeout_s=0), avoid)
        target = self.grow.observe(now, world_size, extra, last_reform_at)
        if target is not None:
            log.info(
                "controller: capacity for %d more worker(s) for %.0f s; growing %d -> %d at a "
                "checkpoint boundary",
                extra,
                self.grow.stable_s,
                world_size,
                target,
            )
        return target

    def decide(
        self,
        situation: Situation,
        budget: Budget,
        wait_s: float,
        avoid: Set[str],
        stopping: Callable[[], bool],
    ) -> Decision:
        """Measure what fits and decide a restart's size (``decision.decide_recovery``);
        below min_workers, wait up to ``wait_s`` for capacity.

        Committed checkpoints stay where they are meanwhile (the memory tier's
        holders outlive the group), so a node that comes back resumes from peer memory.
        """
        deadline = self.clock() + wait_s
        while True:
            capacity = self.settled(avoid)
            stopped = replace(situation, evidence=None, capacity=capacity)  # no process is kept
            decision = decide_recovery(stopped, budget, self.scaling)
            if (
                decision.action != Action.FAIL
                or capacity >= self.scaling.min_workers
                or self.clock() >= deadline
                or stopping()
            ):
                return decision
            log.warning(
                "controller: %s; waiting up to %.0f s more for capacity",
                decision.reason,
                deadline - self.clock(),
            )
            self.sleep(min(2.0, max(0.0, deadline - self.clock())))

    def settled(self, avoid: Set[str], settle_s: float = 4.0) -> int:
        """Workers that fit on live nodes once a stopped group's resources are back: polled
        until ``max_workers`` fit or ``settle_s`` has passed."""
        deadline = self.clock() + settle_s
        probe = self.cluster.node_probe(self.cluster.free_resources(), self._known_alive)
        self._known_alive = set()  # proof of life holds for the first check only
        capacity = 0
        while True:
            alive = probe.answered(timeout_s=0.1)
            fit = self._fit(self.cluster.free_resources(), alive, avoid) - self.spares
            capacity = max(capacity, fit)
            if capacity >= self.scaling.max_workers or self.clock() > deadline:
                return capacity
            self.sleep(0.1)

    def _fit(self, free: Dict[str, Dict[str, float]], nodes: Set[str], avoid: Set[str]) -> int:
        """Worker bundles that fit in the free resources of ``nodes``, avoided nodes left out."""
        usable = [free[node] for node in nodes - avoid if node in free]
        return workers_that_fit(usable, self.per_worker)
