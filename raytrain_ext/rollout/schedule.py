"""Which policy weights generate each GRPO step (``rollout.sync_every``,
``rollout.overlap``).

The trainers push their weights after every ``sync_every``-th update, the *sync points*
(steps 0, k, 2k, ...).  Step ``s`` is generated with the weights of the newest sync point
at or before ``s - 1 - lag``: ``lag`` is 1 with ``rollout.overlap`` (step ``s`` is
generated while step ``s - 1`` updates, so with the weights from before it), else 0.
With ``k = 1`` and no overlap that is step ``s - 1``: on-policy.  Otherwise the engines
run behind the trainers, and the loss weighs each token by its ratio against the
generating weights (the engines score their own completions:
``GroupCompletions.policy_logps``).

The service keeps the last few versions pushed and loads, right before generating a
step, the one the schedule names: so a push never overtakes a generation that needs older
weights.  A trainer group that starts (a re-form, a resume) pushes its own weights and
keeps the schedule when the service still holds the version its next ungenerated step
needs (a group re-formed in place: the service outlived the trainers, and replayed
training reproduces those weights bit for bit).  When it does not (a resumed run's new
service, or a group set back past them), the group's own start becomes an *anchor*: the
steps up to the next sync point are generated with its weights.  Such a run is
deterministic, but no longer the uninterrupted run's.

Invariants:
- ``required(s) <= s - 1``: no step is generated with weights the trainers have not made.
- A step's weights depend only on the schedule, the anchor and the step, never on when
  a push arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection


@dataclass(frozen=True)
class WeightsSchedule:
    """The sync points of ``sync_every``, generated ``lag`` steps late (module doc)."""

    sync_every: int = 1
    lag: int = 0

    def __post_init__(self) -> None:
        if self.sync_every < 1 or self.lag not in (0, 1):
            raise ValueError(
                f"sync_every must be >= 1 and lag 0 or 1, got {self.sync_every} and {self.lag}"
            )

    @classmethod
    def of(cls, rollout_cfg) -> "WeightsSchedule":
        """The schedule of the ``rollout`` section."""
        return cls(rollout_cfg.sync_every, 1 if rollout_cfg.overlap else 0)

    @property
    def off_policy(self) -> bool:
        """Whether a step may be generated with weights older than the previous step's."""
        return self.sync_every > 1 or self.lag > 0

    def is_sync_point(self, step: int) -> bool:
        """Whether the trainers push their weights after ``step`` (step 0: the start)."""
        return step % self.sync_every == 0

    def required(self, step: int, anchor: int = 0) -> int:
        """The version (the step whose weights) that generates ``step``: the schedule's,
        or the ``anchor`` (a group's start off the schedule) when that is newer and still
        before ``step``."""
        scheduled = self.sync_every * (max(0, step - 1 - self.lag) // self.sync_every)
        return max(scheduled, anchor) if anchor <= step - 1 else scheduled

    def start(self, start: int, anchor: int, next_step: int, held: Collection[int]) -> int:
        """The anchor once a group has started at step ``start`` and ``next_step`` is the
        first step not generated yet: unchanged when the service holds (``held``) the
        version that step needs, else ``start`` itself.  An anchor past ``start`` was set
        on a branch the group has left: it counts for nothing."""
        kept = anchor if anchor <= start else 0
        return kept if self.required(next_step, kept) in held else start
