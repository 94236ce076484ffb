"""Recovery records and the budgets they spend: open, choose survivors, close the books.

A failure (a worker raised, died or hung) spends ``elastic.max_failures``, a
preemption (SIGTERM, a node drain) ``elastic.max_preemptions``; an eviction of a
straggler's node spends neither.  Each recovery the budgets allow gets one
``Recovery`` record: opened when detected, decided by the controller when
RECOVERING ends, accounted by the first step of the re-formed group.  Records
are appended, never removed: the last one is the recovery under way.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

from raytrain_ext.elastic.config import ElasticConfig
from raytrain_ext.elastic.decision import Situation, in_place_considered
from raytrain_ext.elastic.group_port import GroupPort
from raytrain_ext.elastic.policy import Budget
from raytrain_ext.elastic.records import Recovery, RecoveryKind
from raytrain_ext.messages import StepReport

log = logging.getLogger(__name__)


class Recoveries:
    def __init__(
        self,
        elastic: ElasticConfig,
        group: GroupPort,
        clock: Callable[[], float],
        records: List[Recovery],
    ):
        e = self.elastic = elastic
        self.group, self.clock = group, clock
        self.records = records
        self.failures = 0
        self.preemptions = 0
        self.failure_budget = Budget(e.max_failures, "elastic.max_failures")
        self.preemption_budget = Budget(e.max_preemptions, "elastic.max_preemptions")

    @property
    def current(self) -> Recovery:
        return self.records[-1]

    def count_failure(self, counted: bool) -> bool:
        """Count a failure (an eviction is not counted); False once the budget is spent."""
        self.failures += counted
        return not counted or self.failure_budget.allows(self.failures)

    def budget_text(self, counted: bool) -> str:
        """What is left of the failure budget, for the transition's log line."""
        if not counted:
            return "not counted as a failure"
        limit = self.failure_budget.limit
        allowed = "unlimited" if limit < 0 else f"{limit}"
        return f"failure {self.failures} of {allowed} allowed (elastic.max_failures)"

    def open_failure(
        self,
        reason: str,
        counted: bool,
        detected_at: float,
        last_step: int,
        last_step_at: Optional[float] = None,
    ) -> None:
        kind = RecoveryKind.FAILURE if counted else RecoveryKind.EVICTION
        recovery = Recovery(kind, self.failures, reason, detected_at, last_step)
        recovery.last_step_at = last_step_at
        self.records.append(recovery)

    def open_preemption(self, reason: str, step: int) -> Optional[str]:
        """Count a preemption whose emergency checkpoint is at ``step``; why the run must
        stop when the budget is spent, else None (and the record is opened)."""
        self.preemptions += 1
        if not self.preemption_budget.allows(self.preemptions):
            return self.preemption_budget.spent(self.preemptions, "preemption")
        kind = RecoveryKind.PREEMPTION
        self.records.append(Recovery(kind, self.failures, reason, self.clock(), step))
        return None

    def situation(self, hung_ranks: List[int]) -> Situation:
        """What the recovery decision reads after this failure: the broken group's evidence
        when a re-form in place is considered (gathering it kills hung ranks and takes the
        others out of their collectives), the failures counted, and no capacity yet."""
        e = self.elastic
        evidence = None
        if in_place_considered(self.current.kind is RecoveryKind.FAILURE, e.reuse_survivors):
            evidence = self.group.gather_evidence(hung_ranks, e.reuse_wait_s, e.fate_wait_s)
        return Situation(self.failures, evidence, replacement=e.replacement)

    def account(self, report: StepReport) -> None:
        """The first step after a re-form closes the books on the last recovery."""
        recovery = self.current
        recovery.account(report)
        log.info(
            "controller: recovered from failure %d in %.2f s (restored step %d from %s, "
            "%d steps redone)",
            recovery.failure,
            recovery.first_step_after_s,
            recovery.restored_step,
            recovery.restored_from,
            recovery.steps_redone,
        )
