"""A re-form in place, as data: which processes stay, which slots are refilled, the size.

Pure (no Ray): ``decision.in_place_plan`` builds it from the broken group's evidence (its
healthy processes, Ray's verdict on each lost one: ``ray_group.survivors``) and ``sized``
fits it to the scaling policy; the unit tests step it with made-up survivors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from raytrain_ext.elastic.policy import ScalingPolicy


@dataclass(frozen=True)
class InPlacePlan:
    """``keep``: ranks whose processes join the next group (their collectives failed
    cleanly); ``refill``: lost ranks whose node Ray reports alive (a new process takes
    their slot); ``left_out``: lost ranks whose node died, or whose fate is unknown
    (the group goes on without them; their slots wait for a node); ``deferred``: lost
    ranks whose node is alive but whose new process joins later, at a step boundary
    (``elastic.replacement``).  ``spares``: warm
    spares ready to take a lost rank's place.  ``size``: the next group's world size,
    ``from_size``: the failed group's (both set by ``sized``).  ``fates``: Ray's verdict
    on each lost rank (``death.Fate`` values), the record of who was lost and how; the
    failure's first error may come from a survivor whose collective broke (an echo)."""

    keep: List[int]
    refill: List[int]
    left_out: List[int]
    deferred: List[int] = field(default_factory=list)
    spares: int = 0
    size: int = 0
    from_size: int = 0
    fates: Dict[int, str] = field(default_factory=dict)

    @property
    def shrinks(self) -> bool:
        return self.size < self.from_size


def sized(plan: InPlacePlan, policy: ScalingPolicy) -> Optional[InPlacePlan]:
    """The plan at the largest allowed size its processes can fill (never larger than
    the group was); None when that is below ``min_workers`` (wait for capacity instead)
    or keeps no process.  Places are filled by survivors, then spares, then new processes
    in refill slots (``WorkerGroup.reform``); a size that is not a whole number of units
    leaves out refills first, then survivors."""
    before = len(plan.keep) + len(plan.refill) + len(plan.left_out) + len(plan.deferred)
    available = len(plan.keep) + plan.spares + len(plan.refill)
    size = policy.size_for(min(available, before))
    if size < max(1, policy.min_workers) and plan.deferred:  # wait for the replacements
        return sized(replace(plan, refill=plan.refill + plan.deferred, deferred=[]), policy)
    if size < max(1, policy.min_workers):
        return None
    return replace(plan, keep=plan.keep[:size], size=size, from_size=before)
