"""What the controller writes down: run states, transitions, recovery and resize records,
and what a run did (``ControllerResult``); what the workers send is in ``messages``.

Records are dataclasses, so each field is named and typed once; ``to_dict`` gives
the plain form that summary.json, the report and the benchmarks read, with the
keys and values they have always had.  A recovery's later stages add their keys
only once reached, so a reader tells from the keys how far a recovery got.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from raytrain_ext.elastic.policy import Action
from raytrain_ext.messages import FitResult, StepReport
from raytrain_ext.metrics.start_phases import phase_chain


class RunState(enum.Enum):
    SCHEDULING = "SCHEDULING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    FINISHED = "FINISHED"
    PREEMPTED = "PREEMPTED"
    INTERRUPTED = "INTERRUPTED"  # the user stopped it (Ctrl-C): checkpointed, not a failure
    FAILED = "FAILED"


TERMINAL = (RunState.FINISHED, RunState.PREEMPTED, RunState.INTERRUPTED, RunState.FAILED)


@dataclass
class Transition:
    source: str
    target: str
    reason: str
    at: float


class RecoveryKind(enum.StrEnum):
    FAILURE = "failure"  # a worker raised, died or hung: spends elastic.max_failures
    EVICTION = "eviction"  # a straggler's node is left out: spends no budget
    PREEMPTION = "preemption"  # SIGTERM or a node drain: spends elastic.max_preemptions


_DECIDED = ("decided_s", "decision", "world_size")
_ACCOUNTED = (
    "phases",
    "restore_s",
    "restored_from",
    "restored_step",
    "restore_phases",
    "restore_bytes",
    "steps_redone",
    "first_step_after_s",
)


# Where a recovery's time goes, rank 0's moments in order (``metrics.start_phases``'s
# chain: each phase from the previous moment to its own; they add up to the last step's
# end -> the first step's end).  The fault lies inside ``detect``.
RECOVERY_PHASES = (
    ("detect", "detected_at"),  # the last step's end -> the controller's verdict
    ("decide", "decided_at"),  # survivors stopped, their evidence, capacity, the decision
    ("reform", "running_at"),  # placement, a replacement's actor, the rendezvous
    ("dispatch", "fit_started_at"),  # fit reaching rank 0
    ("data", "data_opened_at"),  # its data and prefetcher opened again
    ("model", "model_built_at"),  # the model built and wrapped (DDP, FSDP), the optimizer
    ("prepare", "restore_started_at"),  # the step's parts, checkpoint tiers opened and probed
    ("restore", "restored_at"),  # the state, from live peers or a checkpoint
    ("settle", "built_at"),  # what depends on the state: evaluator, the wrapper's settle
    ("resume", "step_started_at"),  # the loop built -> its first step begins
    ("first_step", "first_step_at"),  # the first step itself
)


# Where a grow-back's pause goes: the last step's end -> every rank stopped at the step
# boundary (under a sharded layout, after the checkpoint that carries the state over) and
# the size decided, then the re-form and the loop's build as a recovery's.
RESIZE_PHASES = (("pause", "decided_at"),) + RECOVERY_PHASES[2:]


@dataclass
class Recovery:
    """One recovery, from its detection to the first step of the re-formed group.

    Filled in stages: opened when detected (the first five fields), decided when
    RECOVERING ends (``decide``; ``reformed`` as well after a re-form in place),
    and accounted by the first step of the new group (``account``).  Times are
    the controller's clock, except ``first_step_after_s``, which ends at the
    worker's timestamp of that step.
    """

    kind: RecoveryKind
    failure: int  # failures counted so far, this one included when it counts
    reason: str
    detected_at: float
    last_step: int  # the furthest step any rank completed before the recovery
    decided_s: Optional[float] = None  # detection -> decision
    decision: Optional[Action] = None
    world_size: Optional[int] = None  # of the next group
    reformed: Optional[Dict[str, int]] = None  # how a re-form in place filled the slots
    # a re-form in place: each lost rank and Ray's verdict on it (process_died, node_died...)
    lost: Optional[List[Dict[str, Any]]] = None
    reform_s: Optional[float] = None  # placing and joining the new group (after deciding)
    restore_s: Optional[float] = None
    restored_from: Optional[str] = None  # the checkpoint tier
    restored_step: Optional[int] = None
    restore_phases: Optional[Dict[str, float]] = None
    # rank 0's restore: bytes read from the tier ("read") and copied from its own shards
    # ("held", checkpoint.held_chunks); None when it read no checkpoint
    restore_bytes: Optional[Dict[str, int]] = None
    steps_redone: Optional[int] = None
    first_step_after_s: Optional[float] = None  # detection -> end of the first step after
    last_step_at: Optional[float] = None  # when the newest step before it ended (None: none)
    running_at: Optional[float] = None  # the re-formed group started
    phases: Optional[Dict[str, float]] = None  # RECOVERY_PHASES, seconds

    def decide(self, now: float, decision: Action, world_size: Optional[int]) -> None:
        self.decided_s = now - self.detected_at
        self.decision = decision
        self.world_size = world_size

    def account(self, first: StepReport) -> None:
        """Close the books from the new group's first step (its ``restored``: what it
        resumed from, None when it started afresh; its ``start_marks``: rank 0's moments
        of its loop's build, ``RECOVERY_PHASES``)."""
        step_end = first.time
        moments = first_step_moments(first)
        moments["detected_at"] = self.detected_at
        moments["decided_at"] = self.detected_at + (self.decided_s or 0.0)
        if self.running_at is not None:
            moments["running_at"] = self.running_at
        begun = self.detected_at if self.last_step_at is None else self.last_step_at
        self.phases = phase_chain(begun, moments, RECOVERY_PHASES)
        restored = first.restored or {}
        self.restored_step = restored.get("step", 0)
        self.restore_s = restored.get("total_s", 0.0)
        self.restored_from = restored.get("tier")
        self.restore_phases = restored.get("phases")
        self.restore_bytes = restore_bytes(restored)
        self.steps_redone = max(0, self.last_step - self.restored_step)
        self.first_step_after_s = step_end - self.detected_at

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["kind"] = self.kind.value
        if self.decision is None:
            for key in _DECIDED:
                del out[key]
        else:
            out["decision"] = self.decision.value
        if self.reformed is None:
            del out["reformed"]
        if self.lost is None:
            del out["lost"]
        for key in ("reform_s", "last_step_at", "running_at"):
            if out[key] is None:
                del out[key]
        if self.first_step_after_s is None:
            for key in _ACCOUNTED:
                del out[key]
        return out


@dataclass
class Resize:
    """A planned re-form growing toward ``scaling.max_workers``: in place (the ranks
    pause at a step boundary and warm spares join them) or at a checkpoint boundary
    (every process restarted).  ``pause_s`` (the last step before -> the end of the
    first step after) and ``state_from`` (``peers`` or a checkpoint tier) are filled
    by the grown group's first step."""

    step: int
    from_size: int
    to_size: int
    wanted: int  # the size the grow policy asked for; ``to_size`` is what fit
    decided_s: float
    in_place: bool = False
    last_step_at: Optional[float] = None  # the worker's timestamp of the step before
    reform_s: Optional[float] = None  # placing and joining the grown group
    pause_s: Optional[float] = None
    state_from: Optional[str] = None
    restore_bytes: Optional[Dict[str, int]] = None  # as ``Recovery.restore_bytes``
    restore_phases: Optional[Dict[str, float]] = None  # as ``Recovery.restore_phases``
    decided_at: Optional[float] = None  # every rank stopped, the size decided
    running_at: Optional[float] = None  # the grown group started
    phases: Optional[Dict[str, float]] = None  # RESIZE_PHASES, seconds; add up to pause_s

    def account(self, first: StepReport) -> None:
        """Close the books from the grown group's first step (as ``Recovery.account``)."""
        restored = first.restored or {}
        self.state_from = restored.get("tier")
        self.restore_bytes = restore_bytes(restored)
        self.restore_phases = restored.get("phases")
        if self.last_step_at is None:
            return
        self.pause_s = first.time - self.last_step_at
        moments = first_step_moments(first)
        for key, at in (("decided_at", self.decided_at), ("running_at", self.running_at)):
            if at is not None:
                moments[key] = at
        self.phases = phase_chain(self.last_step_at, moments, RESIZE_PHASES)

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "step": self.step,
            "from": self.from_size,
            "to": self.to_size,
            "wanted": self.wanted,
            "decided_s": self.decided_s,
            "in_place": self.in_place,
        }
        if self.pause_s is not None or self.state_from is not None:
            out.update(pause_s=self.pause_s, state_from=self.state_from, reform_s=self.reform_s)
        optional = {
            "phases": self.phases,
            "restore_bytes": self.restore_bytes,
            "restore_phases": self.restore_phases,
        }
        out.update({key: value for key, value in optional.items() if value is not None})
        return out


def first_step_moments(first: StepReport) -> Dict[str, float]:
    """A new group's first step's moments: rank 0's loop build marks, and the step's own
    start and end (``RECOVERY_PHASES``' last two)."""
    return {
        **(first.start_marks or {}),
        "step_started_at": first.time - first.step_time_s,
        "first_step_at": first.time,
    }


def restore_bytes(restored: Mapping[str, Any]) -> Optional[Dict[str, int]]:
    """Rank 0's checkpoint restore: bytes read from the tier and bytes copied from its own
    shards (``checkpoint.held_chunks``); None when no checkpoint was read."""
    if "read_bytes" not in restored:
        return None
    return {"read": restored["read_bytes"], "held": restored.get("held_bytes", 0)}


@dataclass
class ControllerResult:
    """What a run did.  ``recoveries`` and ``resizes`` are the records in their plain
    form (summary.json); the typed records are in ``recovery_log`` and ``resize_log``."""

    state: RunState
    records: List[Dict[str, Any]] = field(default_factory=list)  # rank 0's, as the sinks got them
    worker_results: List[FitResult] = field(default_factory=list)
    world_size_history: List[Dict[str, int]] = field(default_factory=list)
    transitions: List[Transition] = field(default_factory=list)
    workers: List[Dict[str, Any]] = field(default_factory=list)
    recovery_log: List[Recovery] = field(default_factory=list)
    resize_log: List[Resize] = field(default_factory=list)
    stragglers: List[Dict[str, Any]] = field(default_factory=list)
    backend: Optional[str] = None
    error: Optional[BaseException] = None
    # the moments of the start of the group that made the first step record (the group's
    # and rank 0's; ``metrics.start_phases``)
    start_marks: Dict[str, float] = field(default_factory=dict)

    @property
    def recoveries(self) -> List[Dict[str, Any]]:
        return [r.to_dict() for r in self.recovery_log]

    @property
    def resizes(self) -> List[Dict[str, Any]]:
        return [r.to_dict() for r in self.resize_log]
