"""What the running group tells the controller besides finishing: drain notices, heartbeats
(hangs), stragglers, and the worker stacks dumped on a hang.

Each check is throttled on the controller's clock and reports what it found (a
hang's reason, a rank to evict); the controller chooses the transition.  Drain
notices are forwarded to the ranks once per run: the preemption that follows
re-forms the group away from the drained nodes.  ``watch`` starts afresh for
each group, since hang detection compares the heartbeats of one group's ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

from raytrain_ext.elastic.cluster_probe import Cluster
from raytrain_ext.elastic.config import ElasticConfig
from raytrain_ext.elastic.group_port import GroupPort
from raytrain_ext.elastic.watchdog import HangWatchdog
from raytrain_ext.messages import RankInfo, StepReport
from raytrain_ext.train.config import GuardsConfig

log = logging.getLogger(__name__)


class Notices:
    """``stacks_dir``: where hang stacks go (``<run_dir>/hang-stacks``);
    ``preemption_grace_s``: the checkpoint a drain notice asks for must be taken within
    this (and the drain's deadline)."""

    def __init__(
        self,
        elastic: ElasticConfig,
        guards: GuardsConfig,
        preemption_grace_s: float,
        stacks_dir: Path,
        group: GroupPort,
        cluster: Cluster,
        clock: Callable[[], float],
    ):
        self.elastic, self.guards, self.stacks_dir = elastic, guards, stacks_dir
        self.preemption_grace_s = preemption_grace_s
        self.group, self.cluster, self.clock = group, cluster, clock
        self.watchdog = HangWatchdog(elastic.hang_factor, elastic.hang_floor_s)
        self.hung_ranks: List[int] = []  # named by the watchdog's last verdict
        self.drained_nodes: Set[str] = set()
        self.eviction: Optional[int] = None  # a straggler's rank, for guards.evict_stragglers
        self._stragglers_named: Set[int] = set()
        self._last_heartbeat_check = 0.0
        self._last_drain_check = 0.0
        self._drain_forwarded = False

    @classmethod
    def for_run(
        cls, cfg: Any, group: GroupPort, cluster: Cluster, clock: Callable[[], float]
    ) -> Notices:
        """The notices of a run: its ``elastic`` and ``guards`` sections, its preemption
        grace, and its run directory's ``hang-stacks/``."""
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
        return cls(
            cfg.elastic,
            cfg.guards,
            cfg.checkpoint.preemption_grace_s,
            run_dir / "hang-stacks",
            group,
            cluster,
            clock,
        )

    def new_group(self) -> None:
        """Ranks are renumbered by every re-form: stragglers are named afresh."""
        self._stragglers_named = set()

    def watch(self) -> None:
        """Start watching a group that just began ``fit``."""
        self.hung_ranks = []
        self.watchdog = HangWatchdog(self.elastic.hang_factor, self.elastic.hang_floor_s)

    def forward_drains(self, every_s: float = 1.0) -> None:
        """A node being drained (spot reclaim, autoscaler) preempts the run like SIGTERM:
        its ranks are asked to checkpoint before the drain's deadline and stop."""
        now = self.clock()
        if self._drain_forwarded or now - self._last_drain_check < every_s:
            return
        self._last_drain_check = now
        draining = self.cluster.draining_nodes()
        infos = self.group.infos
        ranks = [r for r, info in enumerate(infos) if info.node_id in draining]
        if not ranks:
            return
        left_s = min(draining[infos[r].node_id] for r in ranks)
        grace = max(1.0, min(self.preemption_grace_s, left_s))
        self.drained_nodes.update(infos[r].node_id for r in ranks)
        log.warning(
            "controller: node(s) of ranks %s are draining (deadline in %.0f s); "
            "emergency checkpoint within %.0f s",
            ranks,
            left_s,
            grace,
        )
        self.group.preempt(ranks, grace)
        self._drain_forwarded = True

    def check_heartbeats(self, every_s: float = 1.0) -> Optional[str]:
        """Feed every rank's heartbeat to the watchdog; a reason string when the group hangs."""
        now = self.clock()
        if now - self._last_heartbeat_check < every_s:
            return None
        self._last_heartbeat_check = now
        for rank, beat in self.group.heartbeats(timeout_s=5).items():
            self.watchdog.observe(rank, beat.step, beat.phase, now)
        verdict = self.watchdog.check(now)
        if verdict is None:
            return None
        self.hung_ranks = list(verdict.ranks)
        infos = self.group.infos
        names = ", ".join(
            f"rank {r} (node {infos[r].node_ip}, pid {infos[r].pid})" for r in verdict.ranks
        )
        reason = (
            f"hang: {names} made no progress for {verdict.stalled_s:.1f} s (deadline "
            f"{verdict.deadline_s:.1f} s = max(elastic.hang_factor x median step, "
            f"elastic.hang_floor_s))"
        )
        log.error("controller: %s", reason)
        return reason

    def observe_step(self, report: StepReport) -> List[Dict[str, Any]]:
        """Time the step for the watchdog; name newly flagged stragglers once (returned) and
        mark the first for eviction when ``guards.evict_stragglers``."""
        self.watchdog.record_step_time(report.step_time_s)
        if not report.stragglers:
            return []
        g = self.guards
        entries = newly_flagged_stragglers(
            report, self.group.infos, self._stragglers_named, g.straggler_window
        )
        if entries and g.evict_stragglers and self.eviction is None:
            self.eviction = entries[0]["rank"]
        return entries

    def dump_stacks(self, attempt: int) -> None:
        """Python stacks of every worker into ``<run_dir>/hang-stacks/`` (guards.hang_stacks)."""
        if self.guards.hang_stacks:
            self.group.dump_stacks(self.stacks_dir, attempt)


def newly_flagged_stragglers(
    report: StepReport, infos: List[RankInfo], already_named: set, window: int
) -> List[Dict[str, Any]]:
    """One entry per rank flagged in ``report`` for the first time, named with node and GPU."""
    times = report.rank_compute_s or []
    entries = []
    for rank in report.stragglers:
        if rank in already_named or rank >= len(infos) or rank >= len(times):
            continue
        already_named.add(rank)
        info = infos[rank]
        others = sorted(t for r, t in enumerate(times) if r != rank)
        entry: Dict[str, Any] = {
            "step": report.step,
            "rank": rank,
            "node_ip": info.node_ip,
            "node_id": info.node_id,
            "gpu_ids": info.gpu_ids,
            "compute_s": times[rank],
            "peers_median_s": others[len(others) // 2],
        }
        log.warning(
            "controller: straggler rank %d (node %s, GPU %s): compute %.1f ms per step "
            "vs %.1f ms median of the other ranks for %d steps",
            rank,
            info.node_ip,
            ",".join(info.gpu_ids) or "none",
            entry["compute_s"] * 1e3,
            entry["peers_median_s"] * 1e3,
            window,
        )
        entries.append(entry)
    return entries
