"""The one recovery decision, table-driven: evidence + budget + scaling -> what to do.

Unit rung: ``elastic.decision`` is pure; each row is a broken group as the Ray side would
report it (healthy ranks, Ray's verdict on the others, warm spares) and the decision it
must get.  The controller's tests (``test_controller_states.py``) then execute decisions.
"""

from __future__ import annotations

import pytest

from raytrain_ext.elastic.config import Replacement
from raytrain_ext.elastic.decision import (
    Evidence,
    Fate,
    Situation,
    decide_recovery,
    in_place_considered,
)
from raytrain_ext.elastic.policy import Action, Budget, ScalingPolicy

DIED, NODE, ALIVE, UNKNOWN = Fate.PROCESS_DIED, Fate.NODE_DIED, Fate.ALIVE, Fate.UNKNOWN
BACKGROUND, AUTO = Replacement.background, Replacement.auto
BUDGET = Budget(2, "elastic.max_failures")

# (situation, scaling (min, max, unit), action, size, keep, refill, left_out, deferred)
ROWS = {
    "process died: refilled in its slot": (
        Situation(1, Evidence(4, [0, 1, 3], {2: DIED})),
        (2, 4, 1), Action.REPLACE, 4, [0, 1, 3], [2], [], [],
    ),
    "answered after all: refilled in its slot": (
        Situation(1, Evidence(2, [0], {1: ALIVE})),
        (1, 2, 1), Action.REPLACE, 2, [0], [1], [], [],
    ),
    "node died: shrink without it": (
        Situation(1, Evidence(3, [0, 1], {2: NODE})),
        (2, 3, 1), Action.SHRINK, 2, [0, 1], [], [2], [],
    ),
    "no verdict in time: left out like a dead node": (
        Situation(1, Evidence(3, [0, 1], {2: UNKNOWN})),
        (2, 3, 1), Action.SHRINK, 2, [0, 1], [], [2], [],
    ),
    "a warm spare takes the dead node's place": (
        Situation(1, Evidence(3, [0, 1], {2: NODE}, spares=1)),
        (2, 3, 1), Action.REPLACE, 3, [0, 1], [], [2], [],
    ),
    "whole model-parallel groups: a survivor is left out": (
        Situation(1, Evidence(4, [0, 1, 3], {2: NODE})),
        (2, 4, 2), Action.SHRINK, 2, [0, 1], [], [2], [],
    ),
    "in the background: the live node's rank joins later": (
        Situation(1, Evidence(3, [0, 1], {2: DIED}), replacement=BACKGROUND),
        (2, 3, 1), Action.SHRINK, 2, [0, 1], [], [], [2],
    ),
    "in the background below min: refilled now instead": (
        Situation(1, Evidence(2, [0], {1: DIED}), replacement=BACKGROUND),
        (2, 2, 1), Action.REPLACE, 2, [0], [1], [], [],
    ),
    "auto, a warm process on the node: waited for": (
        Situation(1, Evidence(3, [0, 1], {2: DIED}, warm=[2]), replacement=AUTO),
        (2, 3, 1), Action.REPLACE, 3, [0, 1], [2], [], [],
    ),
    "auto, the node's process still importing: joins later": (
        Situation(1, Evidence(3, [0, 1], {2: DIED}), replacement=AUTO),
        (2, 3, 1), Action.SHRINK, 2, [0, 1], [], [], [2],
    ),
    "auto, one warm node and one spare: two places filled now, one later": (
        Situation(1, Evidence(5, [0, 1], {2: DIED, 3: DIED, 4: DIED}, spares=1, warm=[4]),
                  replacement=AUTO),
        (2, 5, 1), Action.SHRINK, 4, [0, 1], [4], [], [2, 3],
    ),
    "auto, a spare for the one cold rank: the group keeps its size": (
        Situation(1, Evidence(3, [0, 1], {2: DIED}, spares=1), replacement=AUTO),
        (2, 3, 1), Action.REPLACE, 3, [0, 1], [], [], [2],
    ),
    "auto below min: the cold process is waited for": (
        Situation(1, Evidence(2, [0], {1: DIED}), replacement=AUTO),
        (2, 2, 1), Action.REPLACE, 2, [0], [1], [], [],
    ),
    "auto: a warm process on a lost node is no use": (
        Situation(1, Evidence(3, [0, 1], {2: NODE}, warm=[2]), replacement=AUTO),
        (2, 3, 1), Action.SHRINK, 2, [0, 1], [], [2], [],
    ),
    "survivors below min: restart, size to be measured": (
        Situation(1, Evidence(3, [0], {1: NODE, 2: NODE})),
        (2, 3, 1), Action.RESTART, None, None, None, None, None,
    ),
    "no healthy process: restart": (
        Situation(1, Evidence(2, [])), (1, 2, 1), Action.RESTART, None, None, None, None, None,
    ),
    "no evidence (a preemption): restart": (
        Situation(0), (1, 2, 1), Action.RESTART, None, None, None, None, None,
    ),
    "restart sized by what fits": (
        Situation(1, capacity=3), (2, 4, 2), Action.RESTART, 2, None, None, None, None,
    ),
    "restart below min: fail": (
        Situation(1, capacity=1), (2, 4, 1), Action.FAIL, None, None, None, None, None,
    ),
    "budget spent: fail whatever survived": (
        Situation(3, Evidence(2, [0], {1: DIED})),
        (1, 2, 1), Action.FAIL, None, None, None, None, None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", ROWS.values(), ids=list(ROWS))
def test_the_recovery_decision(row):
    situation, (lo, hi, unit), action, size, keep, refill, left_out, deferred = row
    decision = decide_recovery(situation, BUDGET, ScalingPolicy(lo, hi, unit))
    assert (decision.action, decision.world_size) == (action, size), decision.reason
    plan = decision.plan
    if keep is None:
        assert plan is None
        return
    assert (plan.keep, plan.refill, plan.left_out, plan.deferred) == (
        keep,
        refill,
        left_out,
        deferred,
    )
    assert plan.size == size and plan.from_size == situation.evidence.world_size
    assert set(plan.fates) == set(range(plan.from_size)) - set(situation.evidence.healthy)


def test_the_reasons_name_what_was_lost_and_what_is_spent():
    node = Situation(1, Evidence(3, [0, 1], {2: NODE}))
    reason = decide_recovery(node, BUDGET, ScalingPolicy(2, 3)).reason
    assert reason == (
        "re-forming 2 workers in place: 2 surviving process(es) kept; lost rank 2 "
        "(node_died), 1 lost rank(s) left out (node lost)"
    )
    cold = Situation(1, Evidence(3, [0, 1], {2: DIED}), replacement=AUTO)
    assert decide_recovery(cold, BUDGET, ScalingPolicy(2, 3)).reason == (
        "re-forming 2 workers in place: 2 surviving process(es) kept; lost rank 2 "
        "(process_died), 1 to rejoin once a new process is warm (elastic.replacement)"
    )
    spent = decide_recovery(Situation(3), BUDGET, ScalingPolicy(1, 2)).reason
    assert spent == "failure 3 exceeds elastic.max_failures=2"


@pytest.mark.parametrize(
    "failure, reuse, considered",
    [(True, True, True), (True, False, False), (False, True, False), (False, False, False)],
)
def test_only_a_failure_considers_survivors(failure, reuse, considered):
    assert in_place_considered(failure, reuse) is considered
