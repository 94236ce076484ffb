"""The recovery decision: evidence + budgets + scaling -> REPLACE, SHRINK, RESTART or FAIL.

One pure function decides; the worker group only gathers the evidence (which processes
came out of the broken group healthy, Ray's verdict on each lost one, the warm spares;
``ray_group.survivors.gather_evidence``) and acts on the plan it is handed, and the
capacity check only measures what fits (``capacity.Capacity``).  As Ray Train v2's
failure and scaling policies return decision objects, ``decide_recovery`` returns a
``Decision`` whose ``plan`` says, for a re-form in place, which processes stay, which
slots are refilled now or later and which are left out.

Why a restart may be decided in two calls: the workers that fit are measured only after
the broken group has stopped and released its resources, which is done only when no
re-form in place is possible.  The first call (``capacity`` None) either re-forms in place
or says RESTART without a size; the second, with the capacity, sizes it or fails.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from raytrain_ext.elastic.config import Replacement
from raytrain_ext.elastic.in_place import InPlacePlan, sized
from raytrain_ext.elastic.policy import Action, Budget, Decision, ScalingPolicy, recovery_decision
from raytrain_ext.messages import FitResult


class Fate(enum.StrEnum):
    """What became of a lost worker, in Ray's own words (``ray_group.death``)."""

    ALIVE = "alive"  # it answered after all, through its node's object store
    PROCESS_DIED = "process_died"  # replace in place, same node
    NODE_DIED = "node_died"  # shrink away from the node
    UNKNOWN = "unknown"  # no verdict by the deadline


# a lost rank on a node in these states gets a new process in its own slot
ON_A_LIVE_NODE = (Fate.PROCESS_DIED, Fate.ALIVE)


@dataclass(frozen=True)
class Evidence:
    """What the broken group showed.  ``healthy``: ranks whose ``fit`` ended and left a
    process fit to join a new group; ``fates``: Ray's verdict on every other rank (left
    empty when no process was healthy: nothing would be kept); ``spares``: warm spares
    ready to take a place now; ``warm``: lost ranks whose node holds the pool's process
    with its imports done (``worker.process_pool``)."""

    world_size: int
    healthy: List[int]
    fates: Dict[int, Fate] = field(default_factory=dict)
    spares: int = 0
    warm: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class Situation:
    """Everything a recovery decision reads.  ``evidence``: None when no re-form in place
    is considered (``in_place_considered``) or nothing ran; ``capacity``: the workers that
    fit once the group stopped, None before it was measured; ``replacement``:
    ``elastic.replacement`` (whether a lost rank on a live node is waited for or joins
    later; the config's default is ``auto``, a bare situation's is waiting)."""

    failures: int
    evidence: Optional[Evidence] = None
    capacity: Optional[int] = None
    replacement: Replacement = Replacement.in_place


def in_place_considered(failure: bool, reuse_survivors: bool) -> bool:
    """Only a failure re-forms in place (``elastic.reuse_survivors``): a preemption or an
    eviction re-forms away from nodes that are still alive."""
    return failure and reuse_survivors


def in_place_plan(evidence: Evidence, replacement: Replacement) -> Optional[InPlacePlan]:
    """Who stays and where new processes go, before sizing; None when no process survived
    or none was lost.  A lost rank whose node is alive is refilled in its own slot, now or
    later (``replaced_now``); a dead node, or no verdict in time, leaves the rank out (a ping
    can still be answered between a node's workers' and its raylet's death, so a
    live-looking node is not proof enough)."""
    keep = sorted(evidence.healthy)
    lost = [rank for rank in range(evidence.world_size) if rank not in keep]
    if not keep or not lost:
        return None
    fates = {rank: evidence.fates.get(rank, Fate.UNKNOWN) for rank in lost}
    on_live_nodes = [rank for rank in lost if fates[rank] in ON_A_LIVE_NODE]
    left_out = [rank for rank in lost if rank not in on_live_nodes]
    refill = replaced_now(on_live_nodes, evidence, replacement)
    deferred = [rank for rank in on_live_nodes if rank not in refill]
    return InPlacePlan(
        keep,
        refill,
        left_out,
        deferred,
        spares=evidence.spares,
        fates={rank: str(fate) for rank, fate in fates.items()},
    )


def replaced_now(ranks: List[int], evidence: Evidence, replacement: Replacement) -> List[int]:
    """Which of ``ranks`` (lost, node alive) get a new process in their slot now; the
    others' slots take one that joins at a step boundary once warm.  ``auto`` starts one
    now only where the pool's process waits with its imports done; ready spares are
    counted apart (``sized``: a re-form takes them first), so a place one fills is
    waited for whatever the mode."""
    if replacement is Replacement.in_place:
        return list(ranks)
    if replacement is Replacement.background:
        return []
    return [rank for rank in ranks if rank in evidence.warm]


def decide_recovery(situation: Situation, budget: Budget, scaling: ScalingPolicy) -> Decision:
    """The one recovery decision (module doc): FAIL once ``budget`` is spent; REPLACE or
    SHRINK with a sized plan when surviving processes can fill an allowed size; else
    RESTART, sized by ``capacity`` (without one yet: unsized, measure it and ask again),
    or FAIL below ``scaling.min_workers``."""
    if not budget.allows(situation.failures):
        return Decision(Action.FAIL, budget.spent(situation.failures, "failure"))
    evidence = situation.evidence
    plan = None if evidence is None else in_place_plan(evidence, situation.replacement)
    plan = None if plan is None else sized(plan, scaling)
    if plan is not None:
        action = Action.SHRINK if plan.shrinks else Action.REPLACE
        return Decision(action, _in_place_reason(plan), plan.size, plan)
    if situation.capacity is None:
        return Decision(Action.RESTART, "no surviving process can be kept: every rank restarts")
    return recovery_decision(situation.failures, situation.capacity, budget, scaling)


def _in_place_reason(plan: InPlacePlan) -> str:
    lost = ", ".join(f"rank {rank} ({fate})" for rank, fate in sorted(plan.fates.items()))
    short = plan.from_size - plan.size
    later = min(len(plan.deferred), short)  # a deferred place a spare filled is not short
    left_out = short - later
    return (
        f"re-forming {plan.size} workers in place: {len(plan.keep)} surviving process(es) kept"
        + (f"; lost {lost}" if lost else "")
        + (f", {left_out} lost rank(s) left out (node lost)" if left_out > 0 else "")
        + (f", {later} to rejoin once a new process is warm (elastic.replacement)" if later else "")
    )


def run_complete(returned: Dict[int, FitResult], max_steps: int) -> bool:
    """Whether a rank's process or node was lost after the run was done: rank 0 had
    returned (``returned``, by rank) from the run's last step, neither paused nor
    preempted.  Every rank took part in that step's collectives, and rank 0 returns only
    after its final checkpoint (when one is saved) is committed, which every rank's part
    is part of."""
    first = returned.get(0)
    return (
        first is not None
        and first.steps >= max_steps
        and first.paused_at is None
        and first.preempted_at is None
    )
