"""Growing a running group toward ``scaling.max_workers``: the watch RUNNING keeps between
two polls of the ranks, and the plan RESIZING re-forms in place with.

Two ways to grow.  When warm spares wait in the gang's slots (a lost node's slot Ray
placed again), every rank pauses at the next step boundary and the spares join the paused
ranks in place (``in_place_plan``).  Else, once the grow policy sees stable capacity for
more workers, rank 0 is asked for a checkpoint boundary (every rank saves, then stops) and
the controller re-forms bigger from that checkpoint.

Invariant: at most one grow is pending (``GrowWatch.pending``) from the moment it is asked
for until RESIZING takes it or a failure overtakes it (``cancel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from raytrain_ext.elastic.capacity import Capacity
from raytrain_ext.elastic.group_port import GroupPort
from raytrain_ext.elastic.in_place import InPlacePlan
from raytrain_ext.elastic.records import Resize
from raytrain_ext.parallel.dims import state_from_peers


@dataclass(frozen=True)
class PendingGrow:
    """The size asked for, and how: spares joining paused ranks (``in_place``), or a
    re-form from a checkpoint boundary."""

    target: int
    in_place: bool


class GrowWatch:
    """RUNNING's look for room to grow (``watch``, between polls); what it asked for is
    ``pending`` until RESIZING takes it (``take``) or a failure cancels it."""

    def __init__(self, cfg, group: GroupPort, capacity: Capacity):
        self.cfg, self.group, self.capacity = cfg, group, capacity
        self.pending: Optional[PendingGrow] = None

    def watch(self, last_reform_at: float) -> None:
        """Below max_workers: when warm spares wait in the gang's slots, pause every rank at
        the next step boundary to re-form in place with them.  Else watch for capacity; when
        the grow policy agrees, ask for a checkpoint boundary and re-form bigger from it."""
        if self.pending is not None:
            return
        world, s = self.group.world_size, self.cfg.scaling
        if world < s.max_workers and (self.cfg.checkpoint.enabled or state_from_peers(self.cfg)):
            self.group.replenish(self.cfg.elastic.spare_workers + s.max_workers - world)
            with_spares = self.capacity.scaling.size_for(world + self.group.ready_spare_count())
            if with_spares > world:
                self.pending = PendingGrow(with_spares, in_place=True)
                self.group.pause()
                return
        if not self.cfg.checkpoint.enabled:
            return  # growing onto new slots re-forms from a checkpoint: without one, never
        target = self.capacity.grow_target(world, self.group.avoid_nodes, last_reform_at)
        if target is None:
            return
        self.pending = PendingGrow(target, in_place=False)
        self.group.preempt([0], self.cfg.checkpoint.preemption_grace_s)

    def cancel(self) -> None:
        """A failure overtook the grow: the recovery decides the size."""
        self.pending = None

    def take(self) -> PendingGrow:
        """RESIZING takes the pending grow (it is entered with one)."""
        if self.pending is None:
            raise RuntimeError("controller: a resize without a target size")
        pending, self.pending = self.pending, None
        return pending

    def in_place_plan(
        self, wanted: int, last_step: int, last_step_at: Optional[float], now: float
    ) -> Tuple[InPlacePlan, Resize, str]:
        """Every rank paused at a step boundary, state in memory: the ready spares join them
        (the group's state comes from the ranks, or, sharded, from the checkpoint saved at
        the pause).  The plan, the resize's record and the reason."""
        before = self.group.world_size
        spares = self.group.ready_spare_count()
        size = max(before, self.capacity.scaling.size_for(before + spares))
        plan = InPlacePlan(list(range(before)), [], [], spares=spares, size=size, from_size=before)
        resize = Resize(last_step, before, size, wanted, 0.0, True, last_step_at, decided_at=now)
        reason = (
            f"growing {before} -> {size} in place at step {last_step}: "
            f"{size - before} warm spare(s) join"
        )
        return plan, resize, reason
