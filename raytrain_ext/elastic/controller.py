"""The run controller: an explicit state machine on the driver.

States: SCHEDULING -> RUNNING -> FINISHED; RUNNING -> RECOVERING -> SCHEDULING
after a worker or node failure while ``elastic.max_failures`` allows, FAILED
otherwise.  Recovering re-forms the group in place when a process survived:
survivors kept, a lost rank whose node is alive replaced by a warm spare or a new
process in its slot, one whose node died left out (the group shrinks, within
min..max); with a replicated layout (DDP) the new group takes the survivors'
state, else the newest committed checkpoint.  With no survivor, the group is
re-formed from scratch with as many workers as fit and restores the checkpoint.
RUNNING -> RECOVERING after a preemption (SIGTERM or drain: an emergency
checkpoint, then re-form away from the preempted nodes; ``elastic.max_preemptions``
is a separate budget; PREEMPTED when too little capacity is left).  RUNNING ->
RESIZING -> SCHEDULING to grow: in place when warm spares wait in the gang's
slots (every rank pauses at a step boundary, the spares join and take the state
from the ranks), else at a checkpoint boundary once capacity for more workers
has been stable (at most once per ``elastic.resize_cooldown_s``).

Each state has one handler that does the state's work and returns the next
state and the reason; every transition is logged.  The handlers dispatch:
``capacity`` decides sizes, ``recovery`` keeps the recovery records and budgets,
``notices`` reads drains, heartbeats and stragglers, ``grow`` watches for room to grow
and plans an in-place grow.  The worker group and the
cluster are injected (``group_factory``, ``cluster``), so the state machine runs
without Ray in tests.  The controller owns the group's lifetime: whatever
happens, the group is shut down before ``run`` returns or raises.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional, Tuple, Union

from raytrain_ext.elastic.capacity import Capacity
from raytrain_ext.elastic.cluster_probe import Cluster
from raytrain_ext.elastic.decision import Situation, decide_recovery, run_complete
from raytrain_ext.elastic.group_port import FitStatus, GroupPort
from raytrain_ext.elastic.grow import GrowWatch
from raytrain_ext.elastic.in_place import InPlacePlan
from raytrain_ext.elastic.notices import Notices
from raytrain_ext.elastic.policy import Action, Decision
from raytrain_ext.elastic.records import (
    TERMINAL,
    ControllerResult,
    Recovery,
    RecoveryKind,
    Resize,
    RunState,
    Transition,
)
from raytrain_ext.elastic.recovery import Recoveries
from raytrain_ext.errors.text import one_line, root_cause
from raytrain_ext.messages import StepReport
from raytrain_ext.metrics import MetricsSink
from raytrain_ext.worker.form_options import FormOptions

log = logging.getLogger(__name__)

# how often RUNNING looks at what another thread or a signal handler asked (stop, Ctrl-C)
# between two polls of the ranks: ``elastic.poll_interval_s`` is longer, to spare them
FLAG_CHECK_S = 0.25
STOP_DRAIN_S = 5.0  # a stop waits at most this for rank 0's last records
# deterministic failures, a restart would repeat them: a non-finite loss under
# guards.nan_policy=fail, a checkpoint of another model, bad input only a worker can see
NOT_RETRIED = ("NonFiniteLossError", "CheckpointMismatch", "InputError", "ConfigError")

Next = Tuple[RunState, str]


class TrainingFailed(RuntimeError):
    """A worker raised, or the group could not be formed.  The message is one line (the
    reason and the worker's own error); ``__cause__`` holds the full remote error."""


class Controller:
    def __init__(
        self,
        cfg,
        sink: MetricsSink,
        clock: Callable[[], float] = time.time,
        *,
        group_factory: Callable[[Any], GroupPort],
        cluster: Cluster,
        sleep: Callable[[float], None] = time.sleep,
    ):
        """``group_factory(cfg)`` makes the worker group and ``cluster`` answers what the
        cluster has room for (the trainer passes Ray's, ``ray_group``; tests pass fakes,
        with ``clock`` and ``sleep``)."""
        self.cfg, self.sink, self.clock = cfg, sink, clock
        self.state = RunState.SCHEDULING
        self.result = ControllerResult(state=self.state)
        self.group = group_factory(cfg)
        self.capacity = Capacity(cfg, cluster, clock, sleep)
        self.notices = Notices.for_run(cfg, self.group, cluster, clock)
        self.recoveries = Recoveries(cfg.elastic, self.group, clock, self.result.recovery_log)
        self.world_size = cfg.scaling.num_workers
        self.attempt = 0  # counts re-forms
        self._last_reform_at = clock()
        self.grow = GrowWatch(cfg, self.group, self.capacity)  # RUNNING's watch, RESIZING's plan
        self._in_place: Optional[InPlacePlan] = None  # the next SCHEDULING re-forms in place
        self._books: Optional[Union[Recovery, Resize]] = None  # closed by the next first step
        self._stop_reason: Optional[str] = None  # set from another thread by ``stop``
        self._interrupt_reason: Optional[str] = None  # set from a signal handler: ``interrupt``
        self._interrupt_asked = False  # the group was asked for its emergency checkpoint

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
                if self._interrupt_reason is not None and target not in TERMINAL:
                    target = RunState.INTERRUPTED
                    reason = (
                        f"interrupted ({self._interrupt_reason}) before training resumed; the "
                        "newest committed checkpoint stays"
                    )
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

    def stop(self, reason: str) -> None:
        """End the run from another thread: the loop ends within ``FLAG_CHECK_S`` while
        running (as before in the other states) in FAILED, once rank 0's records made
        since the last poll are forwarded (at most ``STOP_DRAIN_S`` more), and ``run``
        shuts the group down and raises ``TrainingFailed`` naming ``reason``.  Committed
        checkpoints stay, so a later fit() resumes from the newest one."""
        self._stop_reason = reason

    def interrupt(self, reason: str) -> None:
        """End the run as the user asked (Ctrl-C): while training, every rank takes an
        emergency checkpoint at the next step boundary, as for a preemption, and the run
        ends INTERRUPTED, so a rerun redoes nothing; at any other moment (forming,
        recovering) it ends INTERRUPTED at once with its committed checkpoints.  Safe to
        call from a signal handler: it only sets a flag the polling loop reads."""
        self._interrupt_reason = reason

    def request_checkpoint(self) -> None:
        """Ask for a checkpoint at the next step boundary (thread-safe, on-demand API)."""
        self.group.request_checkpoint()

    def _transition(self, target: RunState, reason: str) -> None:
        if target is self.state:
            return
        self.result.transitions.append(
            Transition(self.state.value, target.value, reason, self.clock())
        )
        log.info("controller: %s -> %s (%s)", self.state.value, target.value, reason)
        self.state = target

    def _schedule(self) -> Next:
        s = self.cfg.scaling
        if self.attempt == 0 and s.min_workers < s.max_workers:
            self.world_size = self.capacity.initial_size(s.num_workers, self.group.avoid_nodes)
        keep, self._in_place = self._in_place, None
        forming = self.clock()
        try:
            self._form(keep)
        except Exception as e:  # placement timeout, rendezvous failure
            self.result.error = e
            reason = f"could not form the worker group: {type(e).__name__}"
            if keep is not None and isinstance(self._books, Resize):
                return self._after_failure(f"{reason} while growing in place")
            if keep is not None:  # the same recovery goes on, restarting every process
                return RunState.RECOVERING, f"{reason} in place; restarting every process"
            return self._after_failure(reason) if self.attempt else (RunState.FAILED, reason)
        self._formed()
        if self._books is not None:  # the recovery or resize under way: its re-form's time
            self._books.reform_s = self.clock() - forming
            self._books.running_at = self.clock()
        self.group.start_fit(self.cfg, self.attempt)
        return (
            RunState.RUNNING,
            f"{self.group.world_size} workers formed a {self.group.backend} group",
        )

    def _form(self, plan: Optional[InPlacePlan]) -> None:
        """Re-form in place as ``plan`` says, or start a group of ``world_size``."""
        p = self.cfg.parallel
        form = FormOptions(p.backend, p.timeout_s, self.cfg.scaling.placement_timeout_s)
        if plan is not None:
            reformed = self.group.reform(plan, form)
            if isinstance(self._books, Recovery):
                self._books.reformed = reformed
            return
        self.group.start(self.world_size, form, spares=self.cfg.elastic.spare_workers)

    def _formed(self) -> None:
        """Write down the group just formed."""
        self.result.backend = self.group.backend
        self._last_reform_at = self.clock()
        if not self.result.records:  # the group that may make the first step: its start
            self.result.start_marks = dict(self.group.start_marks)
        self.notices.new_group()
        self.result.world_size_history.append(
            {"step": self._last_step(), "world_size": self.group.world_size}
        )
        self.result.workers = [
            {
                "rank": r,
                "node_id": i.node_id,
                "node_ip": i.node_ip,
                "pid": i.pid,
                "niceness": i.niceness,
                "gpu_ids": i.gpu_ids,
            }
            for r, i in enumerate(self.group.infos)
        ]

    def _running(self) -> Next:
        """Wait for the workers, forwarding metrics every poll interval; a stop or an
        interrupt is looked at every ``FLAG_CHECK_S`` (a wait, no call into the ranks)."""
        interval = self.cfg.elastic.poll_interval_s
        self.notices.watch()
        finished = False
        next_poll = self.clock() + interval
        while not finished and self._stop_reason is None:
            status = self.group.wait_fit(min(FLAG_CHECK_S, max(0.0, next_poll - self.clock())))
            if status.error is not None:
                if run_complete(status.returned, self.cfg.run.max_steps):
                    return self._finished_despite(status)
                return self._worker_failed(*status.error)
            finished = status.finished
            interrupted = self._forward_interrupt()
            if interrupted is None and self.clock() >= next_poll:
                next_poll = self.clock() + interval
                interrupted = self._between_polls()
            if interrupted is not None:
                return interrupted
        if self._stop_reason is not None:
            # rank 0's records since the last poll: a step it finished may have committed
            # its checkpoint, and the next fit() resumes after that step
            self._drain_events(timeout_s=STOP_DRAIN_S)
            return RunState.FAILED, f"stopped: {self._stop_reason}"
        self.result.worker_results = self.group.fit_results()
        self._drain_events()
        first = self.result.worker_results[0]
        if first.paused_at is not None and first.steps < self.cfg.run.max_steps:
            return RunState.RESIZING, (
                f"paused at step {first.paused_at}; growing to {self._grow_target()} "
                "workers in place"
            )
        preempted = first.preempted_at
        if preempted is not None and self._interrupt_asked:
            return RunState.INTERRUPTED, (
                f"interrupted ({self._interrupt_reason}): checkpoint at step {preempted} "
                "committed; rerun the same command to resume"
            )
        if preempted is not None and self.grow.pending is not None:
            return RunState.RESIZING, (
                f"checkpoint at step {preempted} committed; growing to "
                f"{self._grow_target()} workers"
            )
        if preempted is not None:
            return self._after_preemption(preempted)
        return RunState.FINISHED, f"{first.steps} steps completed"

    def _between_polls(self) -> Optional[Next]:
        """Forward records and notices; the next state when one of them ends RUNNING."""
        self._drain_events()
        self.notices.forward_drains()
        if self.notices.eviction is not None:
            return self._evict(self.notices.eviction)
        self.grow.watch(self._last_reform_at)
        hung = self.notices.check_heartbeats()
        if hung is not None:
            self.notices.dump_stacks(self.attempt)
            return self._after_failure(hung)
        return None

    def _finished_despite(self, status: FitStatus) -> Next:
        """A rank's process or node lost after rank 0 returned from the run's last step
        (``elastic.decision.run_complete``): nothing is left to train or to save, so
        nothing is recovered (a re-formed group would find no live state: the finished
        ranks let theirs go, and it would start over)."""
        assert status.error is not None
        rank, error = status.error
        self.result.worker_results = [status.returned[r] for r in sorted(status.returned)]
        self._drain_events()
        first = self.result.worker_results[0]
        lost = f"rank {rank} ({type(root_cause(error)).__name__}) was lost after the last step"
        log.warning("%s; the run is complete", lost)
        return RunState.FINISHED, f"{first.steps} steps completed; {lost}"

    def _worker_failed(self, rank: int, error: BaseException) -> Next:
        info = self.group.infos[rank]
        self.result.error = error
        name = type(root_cause(error)).__name__  # the worker's own, not Ray's wrapper
        reason = f"worker rank {rank} (node {info.node_ip}, pid {info.pid}) raised {name}"
        if name in NOT_RETRIED:
            return RunState.FAILED, reason
        return self._after_failure(reason)

    def _grow_target(self) -> Optional[int]:
        return None if self.grow.pending is None else self.grow.pending.target

    def _resize(self) -> Next:
        """Re-form bigger (``grow``): in place with the ready spares, or with the capacity
        there is now after the checkpoint boundary (a planned stop: nothing to redo)."""
        pending = self.grow.take()
        if pending.in_place:
            plan, resize, reason = self.grow.in_place_plan(
                pending.target, self._last_step(), self._last_step_at(), self.clock()
            )
            self._in_place, self.world_size = plan, plan.size
        else:
            before, started = self.group.world_size, self.clock()
            # every rank stopped at the boundary and answered: their nodes count without a ping
            self.capacity.note_alive(info.node_id for info in self.group.infos)
            self.group.shutdown()
            decision = self._decide(self.cfg.elastic.wait_for_capacity_s)
            if decision.action == Action.FAIL:
                return RunState.FAILED, decision.reason
            self.world_size, reason = decision.world_size, decision.reason
            resize = Resize(
                self._last_step(),
                before,
                self.world_size,
                pending.target,
                self.clock() - started,
                False,
                self._last_step_at(),
                decided_at=self.clock(),
            )
        self.attempt += 1
        self.result.resize_log.append(resize)
        self._books = resize
        return RunState.SCHEDULING, reason

    def _forward_interrupt(self) -> Optional[Next]:
        """Ask every rank for the emergency checkpoint once an interrupt came (rank 0's
        request reaches them all through the per-step exchange); without checkpoints the
        run ends now, with nothing saved."""
        if self._interrupt_reason is None or self._interrupt_asked:
            return None
        if not self.cfg.checkpoint.enabled:
            return RunState.INTERRUPTED, (
                f"interrupted ({self._interrupt_reason}); checkpoints are off: nothing was saved"
            )
        self._interrupt_asked = True
        self.group.preempt([0], self.cfg.checkpoint.preemption_grace_s)
        return None

    def _after_preemption(self, step: int) -> Next:
        """A preemption is not a failure: shrink away from the preempted node(s), or stop."""
        infos = self.group.infos
        nodes = self.notices.drained_nodes | {
            infos[r].node_id for r, res in enumerate(self.result.worker_results) if res.sigterm
        }
        ips = sorted({i.node_ip for i in infos if i.node_id in nodes})
        reason = (
            f"preemption notice (SIGTERM or node drain) for node(s) {', '.join(ips) or '?'}; "
            f"emergency checkpoint at step {step}"
        )
        spent = self.recoveries.open_preemption(reason, step)
        if spent is not None:
            return RunState.PREEMPTED, f"{reason}; {spent}"
        self._books = self.recoveries.current
        self.group.avoid_nodes.update(nodes)
        # every rank returned its result, so every node is alive: the capacity check counts
        # them without a ping (on a loaded node a ping outlasted the check, and the run stopped)
        self.capacity.note_alive(info.node_id for info in infos)
        return RunState.RECOVERING, reason

    def _evict(self, rank: int) -> Next:
        """Re-form without a straggler's node; an eviction is not a failure."""
        info = self.group.infos[rank]
        self.group.avoid_nodes.add(info.node_id)
        self.notices.eviction = None
        return self._after_failure(
            f"evicting straggler rank {rank} (node {info.node_ip}): guards.evict_stragglers",
            counted=False,
        )

    def _after_failure(self, reason: str, counted: bool = True) -> Next:
        """Count the failure; recover if the failure budget allows it, else fail."""
        if not self.recoveries.count_failure(counted):
            return RunState.FAILED, reason
        detected_at = self.clock()
        self._drain_events()
        last_step = self._survivors_last_step()
        last_at = self._last_step_at()
        self.recoveries.open_failure(reason, counted, detected_at, last_step, last_at)
        self._books = self.recoveries.current
        return RunState.RECOVERING, f"{reason}; {self.recoveries.budget_text(counted)}"

    def _survivors_last_step(self) -> int:
        """The furthest step any surviving rank completed (its heartbeat).

        Also notes the nodes of the ranks that answered: they are alive, so the
        capacity check that follows need not ping them.
        """
        steps = [self._last_step()]
        polls = self.group.poll(range(self.group.world_size), timeout_s=5)
        self.capacity.note_alive(self.group.infos[rank].node_id for rank in polls)
        for rank in sorted(polls):
            steps.append(polls[rank].step)
            self._forward(polls[rank].reports)  # rank 0's reports not yet forwarded
        return max(steps)

    def _recover(self) -> Next:
        """Re-form in place when surviving processes can fill an allowed size (refilling lost
        ranks whose node is alive, leaving out those whose node died); else stop the
        survivors, see what fits now, and re-form from the newest checkpoint.  What to do
        is ``decision.decide_recovery``'s; this executes it."""
        recovery = self.recoveries.current
        self.grow.cancel()  # a failure overtook a resize
        situation = self.recoveries.situation(self.notices.hung_ranks)
        decision = decide_recovery(situation, self.recoveries.failure_budget, self.capacity.scaling)
        if decision.plan is not None:
            plan = self._in_place = decision.plan
            recovery.decide(self.clock(), decision.action, plan.size)
            recovery.lost = [{"rank": r, "fate": f} for r, f in sorted(plan.fates.items())]
            self.world_size = plan.size
            self.attempt += 1
            return RunState.SCHEDULING, decision.reason
        self.group.shutdown()
        preempted = recovery.kind is RecoveryKind.PREEMPTION
        e = self.cfg.elastic
        wait_s = e.preemption_wait_s if preempted else e.wait_for_capacity_s
        decision = self._decide(wait_s, situation)
        recovery.decide(self.clock(), decision.action, decision.world_size)
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

    def _close_books(self, report: StepReport) -> None:
        """The new group's first step ends the recovery or resize that formed it; what
        forming it used up (spares, the pool's idle processes) is refilled now, off its
        path: a starting process competes for CPU with the group's first step."""
        books, self._books = self._books, None
        if isinstance(books, Recovery):
            self.recoveries.account(report)
        elif isinstance(books, Resize):
            books.account(report)
        self.group.replenish(self.cfg.elastic.spare_workers)

    def _decide(self, wait_s: float, situation: Optional[Situation] = None) -> Decision:
        """A restart's size from what fits once the group stopped (``situation``: the
        failure's; a planned resize decides from the failures counted alone)."""
        return self.capacity.decide(
            situation or Situation(self.recoveries.failures),
            self.recoveries.failure_budget,
            wait_s,
            self.group.avoid_nodes,
            stopping=lambda: self._stop_reason is not None,
        )

    def _last_step(self) -> int:
        return self.result.records[-1]["step"] if self.result.records else 0

    def _last_step_at(self) -> Optional[float]:
        """When the newest step ended (rank 0's clock); None before the first."""
        return self.result.records[-1]["time"] if self.result.records else None

    def _drain_events(self, timeout_s: float = 30.0) -> None:
        """Forward rank 0's new per-step records to the sinks."""
        events = self.group.poll([0], timeout_s=timeout_s)
        if 0 in events:  # else rank 0 is gone; its fit() reports the error
            self._forward(events[0].reports)

    def _forward(self, reports: List[StepReport]) -> None:
        for report in reports:
            if report.replayed:  # an earlier group's: the records alone, if they lack it
                if report.step > self._last_step():
                    self._record(report)
                continue
            if not self.result.records:  # the first step: when rank 0's loop was built
                self.result.start_marks.update(report.start_marks or {})
            self.result.stragglers.extend(self.notices.observe_step(report))
            if report.first_of_group:
                self._close_books(report)
            self._record(report)

    def _record(self, report: StepReport) -> None:
        row = report.to_record(recoveries=len(self.result.recovery_log))
        self.result.records.append(row)
        self.sink.write(report.step, row)
