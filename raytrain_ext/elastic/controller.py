"""The run controller: an explicit state machine on the driver.

States: SCHEDULING -> RUNNING -> FINISHED; RUNNING -> RECOVERING -> SCHEDULING
after a worker or node failure while ``elastic.max_failures`` allows, FAILED
otherwise.  Recovering re-forms the group in place when the lost ranks can be
replaced at the same size (surviving processes kept, lost ranks taken over by
warm spares or new processes in their freed slots); otherwise the survivors are
stopped and the group re-formed with as many workers as fit, within min..max.
Either way the new group restores the newest committed checkpoint.
RUNNING -> RECOVERING after a preemption (SIGTERM or drain: an emergency
checkpoint, then re-form away from the preempted nodes; ``elastic.max_preemptions``
is a separate budget; PREEMPTED when too little capacity is left); RUNNING ->
RESIZING -> SCHEDULING when capacity for more workers has been stable (grow at
a checkpoint boundary, at most once per ``elastic.resize_cooldown_s``).  Each state has one handler
that does the state's work and returns the next state and the reason; policies
decide, the controller executes; every transition is logged.  The controller
owns the worker group's lifetime: whatever happens, the group is shut down
before ``run`` returns or raises.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import ray

from raytrain_ext.config import to_dict
from raytrain_ext.elastic.diagnostics import dump_worker_stacks, newly_flagged_stragglers
from raytrain_ext.elastic.failure_text import one_line
from raytrain_ext.elastic.policy import (
    Action,
    Budget,
    Decision,
    GrowPolicy,
    NodeProbe,
    ScalingPolicy,
    free_resources_per_node,
    recovery_decision,
    workers_that_fit,
)
from raytrain_ext.elastic.survivors import first_error, keepable_ranks
from raytrain_ext.elastic.watchdog import HangWatchdog
from raytrain_ext.metrics import MetricsSink
from raytrain_ext.parallel.dims import resize_unit
from raytrain_ext.worker.group import WorkerGroup

log = logging.getLogger(__name__)


class RunState(enum.Enum):
    SCHEDULING = "SCHEDULING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    FINISHED = "FINISHED"
    PREEMPTED = "PREEMPTED"
    FAILED = "FAILED"


TERMINAL = (RunState.FINISHED, RunState.PREEMPTED, RunState.FAILED)


NOT_RETRIED = ("NonFiniteLossError",)  # deterministic failures: a restart would repeat them


class TrainingFailed(RuntimeError):
    """A worker raised, or the group could not be formed.  The message is one line (the
    reason and the worker's own error); ``__cause__`` holds the full remote error."""


@dataclass
class Transition:
    source: str
    target: str
    reason: str
    at: float


@dataclass
class ControllerResult:
    state: RunState
    records: List[Dict[str, Any]] = field(default_factory=list)
    worker_results: List[Dict[str, Any]] = field(default_factory=list)
    world_size_history: List[Dict[str, int]] = field(default_factory=list)
    transitions: List[Transition] = field(default_factory=list)
    workers: List[Dict[str, Any]] = field(default_factory=list)
    recoveries: List[Dict[str, Any]] = field(default_factory=list)
    resizes: List[Dict[str, Any]] = field(default_factory=list)
    stragglers: List[Dict[str, Any]] = field(default_factory=list)
    backend: Optional[str] = None
    error: Optional[BaseException] = None


class Controller:
    def __init__(self, cfg, sink: MetricsSink, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.sink = sink
        self.clock = clock
        self.state = RunState.SCHEDULING
        self.group = WorkerGroup(
            dict(cfg.scaling.resources_per_worker), cfg.scaling.placement_strategy
        )
        self.result = ControllerResult(state=self.state)
        self._fit_refs: List[ray.ObjectRef] = []
        self._last_drain_check = 0.0
        self._drain_forwarded = False
        self.world_size = cfg.scaling.num_workers
        self.failures = 0
        self.attempt = 0
        self.watchdog = HangWatchdog(cfg.elastic.hang_factor, cfg.elastic.hang_floor_s)
        self._last_heartbeat_check = 0.0
        self.failure_budget = Budget(cfg.elastic.max_failures, "elastic.max_failures")
        unit = resize_unit(cfg.parallel)
        self.scaling_policy = ScalingPolicy(cfg.scaling.min_workers, cfg.scaling.max_workers, unit)
        self._stragglers_named: set = set()
        self._eviction: Optional[int] = None
        e = cfg.elastic
        self.preemptions = 0
        self.preemption_budget = Budget(e.max_preemptions, "elastic.max_preemptions")
        self.grow_policy = GrowPolicy(
            cfg.scaling.max_workers, e.resize_cooldown_s, e.grow_stable_s, unit
        )
        self._last_reform_at = clock()
        self._last_grow_check = 0.0
        self._resize_target: Optional[int] = None
        self._drained_nodes: set = set()
        self._answered_nodes: set = set()  # nodes whose ranks answered after the last failure
        self._grow_probe = NodeProbe()
        self._hung_ranks: List[int] = []  # named by the watchdog's last verdict
        self._keep_ranks: Optional[List[int]] = None  # the next SCHEDULING re-forms in place
        self._stop_reason: Optional[str] = None  # set from another thread by ``stop``

    def run(self) -> ControllerResult:
        handlers = {
            RunState.SCHEDULING: self._schedule,
            RunState.RUNNING: self._running,
            RunState.RECOVERING: self._recover,
            RunState.RESIZING: self._resize,
        }
        try:
            while self.state not in TERMINAL:
                target, reason = handlers[self.state]()
                if self._stop_reason is not None and target not in TERMINAL:
                    target, reason = RunState.FAILED, f"stopped: {self._stop_reason}"
                self._transition(target, reason)
        finally:
            self.group.shutdown()
        self.result.state = self.state
        if self.state is RunState.FAILED:
            reason = self.result.transitions[-1].reason
            error = self.result.error
            detail = "" if error is None else f": {one_line(error, with_type=False)}"
            raise TrainingFailed(f"training failed: {reason}{detail}") from self.result.error
        return self.result

    def _transition(self, target: RunState, reason: str) -> None:
        if target is self.state:
            return
        self.result.transitions.append(
            Transition(self.state.value, target.value, reason, self.clock())
        )
        log.info("controller: %s -> %s (%s)", self.state.value, target.value, reason)
        self.state = target

    def _schedule(self) -> Tuple[RunState, str]:
        s, p = self.cfg.scaling, self.cfg.parallel
        if self.attempt == 0 and s.min_workers < s.max_workers:
            self.world_size = self._initial_size()
        keep, self._keep_ranks = self._keep_ranks, None
        try:
            if keep is not None:
                filled = self.group.reform(
                    keep,
                    backend=p.backend,
                    timeout_s=p.timeout_s,
                    placement_timeout_s=s.placement_timeout_s,
                )
                self.result.recoveries[-1]["reformed"] = filled
            else:
                self.group.start(
                    self.world_size,
                    backend=p.backend,
                    timeout_s=p.timeout_s,
                    placement_timeout_s=s.placement_timeout_s,
                    spares=self.cfg.elastic.spare_workers,
                )
        except Exception as e:  # placement timeout, rendezvous failure
            self._fit_refs = []  # nothing ran: no survivor to keep
            self.result.error = e
            reason = f"could not form the worker group: {type(e).__name__}"
            if keep is not None:  # the same recovery goes on, restarting every process
                return RunState.RECOVERING, f"{reason} in place; restarting every process"
            return self._after_failure(reason) if self.attempt else (RunState.FAILED, reason)
        self.result.backend = self.group.backend
        self._last_reform_at = self.clock()
        self._stragglers_named = set()  # ranks are renumbered by every re-form
        self.result.world_size_history.append(
            {"step": self._last_step(), "world_size": self.group.world_size}
        )
        self.result.workers = [
            {
                "rank": r,
                "node_id": i["node_id"],
                "node_ip": i["node_ip"],
                "pid": i["pid"],
                "gpu_ids": i["gpu_ids"],
            }
            for r, i in enumerate(self.group.infos)
        ]
        self._fit_refs = self.group.call_async("fit", to_dict(self.cfg), self.attempt)
        return (
            RunState.RUNNING,
            f"{self.group.world_size} workers formed a {self.group.backend} group",
        )

    def _initial_size(self) -> int:
        """Start with as many workers as fit now, within min..max (``num_workers`` when fewer
        than min fit: the placement then waits ``scaling.placement_timeout_s`` for capacity)."""
        free = free_resources_per_node()  # at the start Ray's node list is fresh: no ping needed
        capacity = self._workers_that_fit(free, set(free)) - self.cfg.elastic.spare_workers
        size = self.scaling_policy.size_for(capacity)
        if size < self.scaling_policy.min_workers:
            return self.cfg.scaling.num_workers
        log.info(
            "controller: %d workers fit; starting with %d (min %d, max %d)",
            capacity,
            size,
            self.scaling_policy.min_workers,
            self.scaling_policy.max_workers,
        )
        return size

    def _running(self) -> Tuple[RunState, str]:
        """Wait for the workers, forwarding metrics every poll interval."""
        interval = self.cfg.elastic.poll_interval_s
        pending = list(self._fit_refs)
        self._hung_ranks = []
        self.watchdog = HangWatchdog(self.cfg.elastic.hang_factor, self.cfg.elastic.hang_floor_s)
        while pending and self._stop_reason is None:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=interval)
            failed = self._first_error(done)
            if failed is not None:
                rank, error = failed
                info = self.group.infos[rank]
                self.result.error = error
                reason = (
                    f"worker rank {rank} (node {info['node_ip']}, pid {info['pid']}) raised "
                    f"{_error_name(error)}"
                )
                if _error_name(error) in NOT_RETRIED:
                    return RunState.FAILED, reason
                return self._after_failure(reason)
            self._drain_events()
            self._forward_drain_notices()
            if self._eviction is not None:
                return self._evict(self._eviction)
            self._maybe_grow()
            hung = self._check_heartbeats()
            if hung is not None:
                self._dump_stacks()
                return self._after_failure(hung)
        if self._stop_reason is not None:
            return RunState.FAILED, f"stopped: {self._stop_reason}"
        self.result.worker_results = ray.get(self._fit_refs)
        self._drain_events()
        preempted = self.result.worker_results[0].get("preempted_at")
        if preempted is not None and self._resize_target is not None:
            return RunState.RESIZING, (
                f"checkpoint at step {preempted} committed; growing to "
                f"{self._resize_target} workers"
            )
        if preempted is not None:
            return self._after_preemption(preempted)
        return RunState.FINISHED, f"{self.cfg.run.max_steps} steps completed"

    def _check_heartbeats(self, every_s: float = 1.0) -> Optional[str]:
        """Feed every rank's heartbeat to the watchdog; a reason string when the group hangs."""
        now = self.clock()
        if now - self._last_heartbeat_check < every_s:
            return None
        self._last_heartbeat_check = now
        refs = [actor.heartbeat.remote() for actor in self.group.actors]
        for rank, ref in enumerate(refs):
            try:
                beat = ray.get(ref, timeout=5)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                continue  # a dead rank: its fit() ref reports it
            self.watchdog.observe(rank, beat["step"], beat["phase"], now)
        verdict = self.watchdog.check(now)
        if verdict is None:
            return None
        self._hung_ranks = list(verdict.ranks)
        names = ", ".join(
            f"rank {r} (node {self.group.infos[r]['node_ip']}, pid {self.group.infos[r]['pid']})"
            for r in verdict.ranks
        )
        reason = (
            f"hang: {names} made no progress for {verdict.stalled_s:.1f} s (deadline "
            f"{verdict.deadline_s:.1f} s = max(elastic.hang_factor x median step, "
            f"elastic.hang_floor_s))"
        )
        log.error("controller: %s", reason)
        return reason

    def _maybe_grow(self) -> None:
        """Below max_workers, watch for capacity; when the grow policy agrees, ask for a
        checkpoint boundary (every rank saves, then stops) and re-form bigger from it."""
        now = self.clock()
        if (
            self._resize_target is not None
            or not self.cfg.checkpoint.enabled
            or now - self._last_grow_check < self.cfg.elastic.grow_check_s
            or self.group.world_size >= self.scaling_policy.max_workers
        ):
            return  # growing re-forms from a checkpoint: without checkpoints, never
        self._last_grow_check = now
        free = free_resources_per_node()
        self._grow_probe.add(free)  # only nodes that answer count: a listed node may be dead
        extra = self._workers_that_fit(free, self._grow_probe.answered(timeout_s=0))
        target = self.grow_policy.observe(now, self.group.world_size, extra, self._last_reform_at)
        if target is None:
            return
        self._resize_target = target
        log.info(
            "controller: capacity for %d more worker(s) for %.0f s; growing %d -> %d at a "
            "checkpoint boundary",
            extra,
            self.cfg.elastic.grow_stable_s,
            self.group.world_size,
            target,
        )
        self.group.actors[0].preempt.remote(self.cfg.checkpoint.preemption_grace_s)

    def _resize(self) -> Tuple[RunState, str]:
        """Re-form with the capacity there is now (a planned stop: nothing to redo)."""
        before, target = self.group.world_size, self._resize_target
        started = self.clock()
        # every rank stopped at the boundary and answered: their nodes count without a ping
        self._answered_nodes = {info["node_id"] for info in self.group.infos}
        self.group.shutdown()
        self._resize_target = None
        decision = self._decide_with_patience(self.cfg.elastic.wait_for_capacity_s)
        if decision.action == Action.FAIL:
            return RunState.FAILED, decision.reason
        self.world_size = decision.world_size
        self.attempt += 1
        self.result.resizes.append(
            {
                "step": self._last_step(),
                "from": before,
                "to": self.world_size,
                "wanted": target,
                "decided_s": self.clock() - started,
            }
        )
        return RunState.SCHEDULING, decision.reason

    def _after_preemption(self, step: int) -> Tuple[RunState, str]:
        """A preemption is not a failure: shrink away from the preempted node(s), or stop."""
        nodes = self._drained_nodes | {
            self.group.infos[r]["node_id"]
            for r, res in enumerate(self.result.worker_results)
            if res.get("sigterm")
        }
        self.preemptions += 1
        ips = sorted({i["node_ip"] for i in self.group.infos if i["node_id"] in nodes})
        reason = (
            f"preemption notice (SIGTERM or node drain) for node(s) {', '.join(ips) or '?'}; "
            f"emergency checkpoint at step {step}"
        )
        if not self.preemption_budget.allows(self.preemptions):
            return RunState.PREEMPTED, (
                f"{reason}; {self.preemption_budget.spent(self.preemptions, 'preemption')}"
            )
        self.group.avoid_nodes |= nodes
        # every rank returned its result, so every node is alive: the capacity check counts
        # them without a ping (on a loaded node a ping outlasted the check, and the run stopped)
        self._answered_nodes = {info["node_id"] for info in self.group.infos}
        self.result.recoveries.append(
            {
                "kind": "preemption",
                "failure": self.failures,
                "reason": reason,
                "detected_at": self.clock(),
                "last_step": step,
            }
        )
        return RunState.RECOVERING, reason

    def _evict(self, rank: int) -> Tuple[RunState, str]:
        """Re-form without a straggler's node; an eviction is not a failure."""
        info = self.group.infos[rank]
        self.group.avoid_nodes.add(info["node_id"])
        self._eviction = None
        return self._after_failure(
            f"evicting straggler rank {rank} (node {info['node_ip']}): guards.evict_stragglers",
            counted=False,
        )

    def _after_failure(self, reason: str, counted: bool = True) -> Tuple[RunState, str]:
        """Count the failure; recover if the failure policy allows it, else fail."""
        self.failures += counted
        if counted and not self.failure_budget.allows(self.failures):
            return RunState.FAILED, reason
        detected_at = self.clock()
        self._drain_events()
        self.result.recoveries.append(
            {
                "kind": "failure" if counted else "eviction",
                "failure": self.failures,
                "reason": reason,
                "detected_at": detected_at,
                "last_step": self._survivors_last_step(),
            }
        )
        return RunState.RECOVERING, reason

    def _survivors_last_step(self) -> int:
        """The furthest step any surviving rank completed (its heartbeat).

        Also notes the nodes of the ranks that answered: they are alive, so the
        capacity check that follows need not ping them.
        """
        polls = [actor.poll.remote() for actor in self.group.actors]
        steps = [self._last_step()]
        self._answered_nodes = set()
        for rank, ref in enumerate(polls):
            try:
                events = ray.get(ref, timeout=5)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                continue  # a dead rank
            self._answered_nodes.add(self.group.infos[rank]["node_id"])
            steps.append(events["step"])
            self._forward(events["records"])  # rank 0's records not yet forwarded
        return max(steps)

    def _recover(self) -> Tuple[RunState, str]:
        """Re-form in place if the lost ranks can be replaced; else stop the survivors, see
        what fits now, and re-form (either way restoring the newest checkpoint)."""
        recovery = self.result.recoveries[-1]
        self._resize_target = None  # a failure overtook a planned resize
        keep = self._survivors_to_keep(recovery)
        if keep is not None:
            self._keep_ranks = keep
            recovery.update(
                decided_s=self.clock() - recovery["detected_at"],
                decision="replace",
                world_size=self.world_size,
            )
            self.attempt += 1
            return RunState.SCHEDULING, (
                f"re-forming {self.world_size} workers in place: "
                f"{len(keep)} surviving process(es) kept"
            )
        self.group.shutdown()
        preempted = recovery["kind"] == "preemption"
        e = self.cfg.elastic
        decision = self._decide_with_patience(
            e.preemption_wait_s if preempted else e.wait_for_capacity_s
        )
        recovery.update(
            decided_s=self.clock() - recovery["detected_at"],
            decision=decision.action,
            world_size=decision.world_size,
        )
        if decision.action == Action.FAIL and preempted:
            return RunState.PREEMPTED, (
                f"{decision.reason} after the preemption; the emergency "
                "checkpoint is committed: rerun to resume"
            )
        if decision.action == Action.FAIL:
            return RunState.FAILED, decision.reason
        self.world_size = decision.world_size
        self.attempt += 1
        return RunState.SCHEDULING, decision.reason

    def _survivors_to_keep(self, recovery: Dict[str, Any]) -> Optional[List[int]]:
        """The ranks whose processes join the next group if it can be re-formed in place at
        its size (see ``survivors.keepable_ranks``); None to restart every process."""
        e = self.cfg.elastic
        if (
            not e.reuse_survivors
            or recovery["kind"] != "failure"
            or self.group.backend != "gloo"
            or not self._fit_refs
        ):
            return None  # NCCL: a communicator whose peer vanished needs an abort, not reuse
        return keepable_ranks(self.group, self._fit_refs, self._hung_ranks, e.reuse_wait_s)

    def _decide_with_patience(self, wait_s: float) -> Decision:
        """Decide; below min_workers, wait up to ``wait_s`` for capacity.

        Committed checkpoints stay where they are meanwhile (the memory tier's
        holders outlive the group), so a node that comes back resumes from peer memory.
        """
        deadline = self.clock() + wait_s
        while True:
            capacity = self._settled_capacity()
            decision = recovery_decision(
                self.failures, capacity, self.failure_budget, self.scaling_policy
            )
            if (
                decision.action == Action.RESTART
                or capacity >= self.scaling_policy.min_workers
                or self.clock() >= deadline
                or self._stop_reason is not None
            ):
                return decision
            log.warning(
                "controller: %s; waiting up to %.0f s more for capacity",
                decision.reason,
                deadline - self.clock(),
            )
            time.sleep(min(2.0, max(0.0, deadline - self.clock())))

    def _settled_capacity(self, settle_s: float = 4.0) -> int:
        """Workers that fit on nodes that answer a ping (or whose ranks just answered), once
        the stopped group's resources are back; polled until ``max_workers`` fit or
        ``settle_s`` has passed."""
        deadline = self.clock() + settle_s
        probe = NodeProbe(free_resources_per_node(), known_alive=self._answered_nodes)
        self._answered_nodes = set()  # proof of life holds for the first check only
        spares = self.cfg.elastic.spare_workers  # placed with the gang: they need room too
        capacity = 0
        while True:
            alive = probe.answered(timeout_s=0.1)
            capacity = max(
                capacity, self._workers_that_fit(free_resources_per_node(), alive) - spares
            )
            if capacity >= self.scaling_policy.max_workers or self.clock() > deadline:
                return capacity
            time.sleep(0.1)

    def _workers_that_fit(self, free: Dict[str, Dict[str, float]], nodes: Set[str]) -> int:
        """Worker bundles that fit in the free resources of ``nodes``, minus avoided nodes
        (preempted, or a straggler's)."""
        usable = [free[node] for node in nodes - self.group.avoid_nodes if node in free]
        return workers_that_fit(usable, dict(self.cfg.scaling.resources_per_worker))

    def _last_step(self) -> int:
        return self.result.records[-1]["step"] if self.result.records else 0

    def _forward_drain_notices(self, every_s: float = 1.0) -> None:
        """A node being drained (spot reclaim, autoscaler) preempts the run like SIGTERM."""
        now = self.clock()
        if self._drain_forwarded or now - self._last_drain_check < every_s:
            return
        self._last_drain_check = now
        try:
            draining = ray._private.worker.global_worker.gcs_client.get_draining_nodes(timeout=5)
        except Exception as e:  # an older Ray or a GCS hiccup: SIGTERM still works
            log.debug("cannot read draining nodes: %s", e)
            return
        ranks = [r for r, info in enumerate(self.group.infos) if info["node_id"] in draining]
        if not ranks:
            return
        deadline_s = min(draining[self.group.infos[r]["node_id"]] for r in ranks) / 1000.0
        grace = max(1.0, min(self.cfg.checkpoint.preemption_grace_s, deadline_s - time.time()))
        self._drained_nodes.update(self.group.infos[r]["node_id"] for r in ranks)
        log.warning(
            "controller: node(s) of ranks %s are draining (deadline in %.0f s); "
            "emergency checkpoint within %.0f s",
            ranks,
            deadline_s - time.time(),
            grace,
        )
        for rank in ranks:
            self.group.actors[rank].preempt.remote(grace)
        self._drain_forwarded = True

    def stop(self, reason: str) -> None:
        """End the run from another thread: the loop ends at its next poll (within
        ``elastic.poll_interval_s`` while running) in FAILED, and ``run`` shuts the group
        down and raises ``TrainingFailed`` naming ``reason``.  Committed checkpoints stay,
        so a later fit() resumes from the newest one."""
        self._stop_reason = reason

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint at the next step boundary (thread-safe, on-demand API)."""
        if self.group.actors:
            self.group.actors[0].request_checkpoint.remote()

    def _first_error(self, done: List[ray.ObjectRef]) -> Optional[Tuple[int, BaseException]]:
        return first_error(self._fit_refs, done, self.clock)

    def _drain_events(self) -> None:
        """Forward rank 0's new per-step records to the sinks."""
        try:
            events = ray.get(self.group.actors[0].poll.remote(), timeout=30)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return  # rank 0 is gone; its fit() ref reports the error
        self._forward(events["records"])

    def _forward(self, records: List[Dict[str, Any]]) -> None:
        for record in records:
            self.watchdog.record_step_time(record["step_time_s"])
            if record.get("stragglers"):
                self._report_stragglers(record)
            if "restored" in record and self.result.recoveries:
                self._account_recovery(record)
            record["recoveries"] = len(self.result.recoveries)
            self.result.records.append(record)
            self.sink.write(record["step"], record)

    def _report_stragglers(self, record: Dict[str, Any]) -> None:
        """Name newly flagged stragglers once; mark the first for eviction if configured."""
        g = self.cfg.guards
        entries = newly_flagged_stragglers(
            record, self.group.infos, self._stragglers_named, g.straggler_window
        )
        self.result.stragglers.extend(entries)
        if entries and g.evict_stragglers and self._eviction is None:
            self._eviction = entries[0]["rank"]

    def _dump_stacks(self) -> None:
        """Python stacks of every worker into ``<run_dir>/hang-stacks/`` (guards.hang_stacks)."""
        if self.cfg.guards.hang_stacks:
            dump_worker_stacks(
                self.group.actors,
                self.group.infos,
                Path(self.cfg.run.output_dir) / self.cfg.run.name / "hang-stacks",
                self.attempt,
            )

    def _account_recovery(self, record: Dict[str, Any]) -> None:
        """The first step after a re-form closes the books on the recovery."""
        recovery = self.result.recoveries[-1]
        restored = record["restored"] or {}
        restored_step = restored.get("step", 0)
        recovery.update(
            restore_s=restored.get("total_s", 0.0),
            restored_from=restored.get("tier"),
            restored_step=restored_step,
            restore_phases=restored.get("phases"),
            steps_redone=max(0, recovery["last_step"] - restored_step),
            first_step_after_s=record["time"] - recovery["detected_at"],
        )
        log.info(
            "controller: recovered from failure %d in %.2f s (restored step %d from %s, "
            "%d steps redone)",
            recovery["failure"],
            recovery["first_step_after_s"],
            restored_step,
            recovery["restored_from"],
            recovery["steps_redone"],
        )
        self.group.replenish_spares(self.cfg.elastic.spare_workers)  # off the recovery's path


def _error_name(error: BaseException) -> str:
    """The worker's own exception type, not Ray's ``RayTaskError`` wrapper."""
    return type(getattr(error, "cause", None) or error).__name__
