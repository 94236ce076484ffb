"""``RankLoop``: what the worker actor asks of the loop one rank runs for one group.

Two loops implement it: the built-in ``train.loop.TrainLoop`` and the user's own function
(``user_loop.function_loop.FunctionLoop``, Ray Train's API); the actor, and so the
controller, treat both alike.
"""

from __future__ import annotations

from typing import Any, Dict, Protocol

from raytrain_ext.messages import FitResult


class RankLoop(Protocol):
    @property
    def finished(self) -> bool:
        """The run is complete: no next group takes anything from this one."""
        ...

    @property
    def build_marks(self) -> Dict[str, float]:
        """When the parts of this group's start happened on this rank (wall clock, by
        ``elastic.records.RECOVERY_PHASES``'s names); the first report carries them."""
        ...

    def fit(self) -> FitResult:
        """Run until the end of the run, a pause or a preemption; raise on a failure."""
        ...

    def live_state(self) -> Any:
        """The state a survivor keeps for the next group (None: nothing)."""
        ...

    def held_chunks(self) -> Any:
        """This rank's own checkpoint shards kept for the next group's restore (None)."""
        ...
