"""Which policy weights generate each GRPO step (``rollout.sync_every``).

The engines take the trainers' weights after every ``sync_every``-th update, the *sync
points* (steps 0, k, 2k, ...), and step ``s`` is generated with the weights after the
newest sync point before it: ``k * ((s - 1) // k)``.  With ``k = 1`` that is step
``s - 1``: on-policy.  With ``k > 1`` the engines run up to ``k - 1`` updates behind, and
the loss weighs each token by its ratio against the generating weights (the engines
score their own completions: ``GroupCompletions.policy_logps``).

A trainer group that starts between sync points (a re-form, a resume) keeps the
schedule when the engines still hold the weights it says (a group re-formed in place:
the service outlived the trainers, and replayed training reproduces those weights bit
for bit).  When they do not (a resumed run's new service, or a group set back past them),
the group's own start becomes an *anchor*: its weights are pushed, and the steps up to
the next sync point are generated with them.  Such a run is deterministic, but no longer
the uninterrupted run's.

Invariants:
- ``required(s) <= s - 1``: no step is generated with weights the trainers have not made.
- A step's weights depend only on the schedule, the anchor and the step, never on when
  a push arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class WeightsSchedule:
    """The sync points of ``sync_every`` (module doc)."""

    sync_every: int = 1

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")

    @property
    def off_policy(self) -> bool:
        """Whether a step may be generated with weights older than the previous step's."""
        return self.sync_every > 1

    def is_sync_point(self, step: int) -> bool:
        """Whether the trainers push their weights after ``step`` (step 0: the start)."""
        return step % self.sync_every == 0

    def required(self, step: int, anchor: int = 0) -> int:
        """The version (the step whose weights) that generates ``step``: the newest sync
        point before it, or the ``anchor`` (a group's start off the schedule) when that
        is newer and still before it."""
        scheduled = self.sync_every * ((step - 1) // self.sync_every)
        return max(scheduled, anchor) if anchor <= step - 1 else scheduled

    def start(self, held: int, start: int, anchor: int) -> Tuple[bool, int]:
        """A group starts at step ``start`` while the engines hold the weights ``held``
        and the anchor is ``anchor``: whether the engines keep what they hold (the
        schedule's for the group's next step, made no later than its start), and the
        anchor from then on (``start`` itself when its weights are loaded instead).  An
        anchor past ``start`` was set on a branch the group has left: it counts for
        nothing."""
        kept = anchor if anchor <= start else 0
        if held <= start and held == self.required(start + 1, kept):
            return True, kept
        return False, start
