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
training reproduces those weights bit for bit).  A checkpoint carries the results of the
generations made with weights older than its own (``carried``: the one in flight with
``overlap``, the current one mid-way through μ steps, those up to the next sync point),
so a run resumed from it with new engines keeps the schedule too.  When neither holds (a
checkpoint saved under a preemption deadline, which carries only the generation the next
step trains on, or a group set back past the kept weights), the group's own start becomes an
*anchor*: the steps up to the next sync point are generated with its weights.  Such a
run is deterministic, but no longer the uninterrupted run's.

With ``objective.grpo.num_iterations`` = μ > 1 each generation trains μ steps (TRL's μ):
generations are named by their first step (``key``), generated with the schedule's
weights for that step, and their completions' generating log-probs are the ratio's
denominator on every one of the μ steps.  A group that starts mid-generation without its
result (a resumed run) generates it anew with its start's weights.

Invariants:
- ``required(s)`` precedes a step that trains on generation ``s``: no step trains on
  completions of weights the trainers had not made before it.
- A step's weights depend only on the schedule, the anchor and the step, never on when
  a push arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, List, Tuple


def generation_of(step: int, iterations: int) -> int:
    """The first step of the generation ``step`` trains on, each generation training
    ``iterations`` steps (``objective.grpo.num_iterations``)."""
    return (step - 1) // iterations * iterations + 1


@dataclass(frozen=True)
class WeightsSchedule:
    """The sync points of ``sync_every``, generated ``lag`` steps late, each generation
    training ``iterations`` steps (module doc)."""

    sync_every: int = 1
    lag: int = 0
    iterations: int = 1

    def __post_init__(self) -> None:
        if self.sync_every < 1 or self.lag not in (0, 1) or self.iterations < 1:
            raise ValueError(
                f"sync_every and iterations must be >= 1 and lag 0 or 1, got "
                f"{self.sync_every}, {self.iterations} and {self.lag}"
            )

    @classmethod
    def of(cls, cfg) -> "WeightsSchedule":
        """The schedule of a run's ``rollout`` section and ``objective.grpo``."""
        r = cfg.rollout
        return cls(r.sync_every, 1 if r.overlap else 0, cfg.objective.grpo.num_iterations)

    @property
    def off_policy(self) -> bool:
        """Whether a step may train on completions of weights older than the previous
        step's."""
        return self.sync_every > 1 or self.lag > 0 or self.iterations > 1

    def key(self, step: int) -> int:
        """The generation that ``step`` trains on, named by its first step."""
        return generation_of(step, self.iterations)

    def pushes_after(self, step: int) -> bool:
        """Whether some generation is generated with the weights after ``step`` (step 0:
        the start), so the trainers push them."""
        last = step + 1 + self.lag + self.sync_every + self.iterations
        return any(self.required(g) == step for g in range(step + 1, last) if self.key(g) == g)

    def required(self, step: int, anchor: int = 0) -> int:
        """The version (the step whose weights) that generates the generation ``step``
        (a generation's first step): the schedule's, or the ``anchor`` (a group's start
        off the schedule) when that is newer and still before one of the steps that
        train on it."""
        scheduled = self.sync_every * (max(0, step - 1 - self.lag) // self.sync_every)
        last_use = step - 1 + self.iterations - 1
        return max(scheduled, anchor) if anchor <= last_use else scheduled

    def carried(self, step: int, last_step: int) -> List[int]:
        """The generations a checkpoint after ``step`` carries (their results, not their
        weights): each that trains a step after ``step``, up to ``last_step``, and is
        generated with weights older than ``step``'s, which a run resumed from the
        checkpoint no longer has (its group pushes only its start's).  None on-policy;
        with ``overlap``, the generation made while ``step`` updated; part-way through a
        generation's μ steps, that generation; between sync points, those up to the next
        one."""
        found, generation = [], self.key(step + 1)
        while generation <= last_step and self.required(generation) < step:
            found.append(generation)
            generation += self.iterations
        return found

    @property
    def reach(self) -> int:
        """How many steps past the trainers' a generation may be asked for (a checkpoint's
        ``carried``): results that recent are kept."""
        return self.sync_every + self.lag + self.iterations

    def start(
        self, start: int, anchor: int, next_step: int, held: Collection[int]
    ) -> Tuple[bool, int]:
        """A group has started at step ``start`` and ``next_step`` is the first generation
        not generated yet: whether it keeps the schedule, and the anchor from then on.  It
        keeps it when the service holds (``held``) the version that generation needs, or
        when that version comes after ``start`` (the group will push it); else its own
        start is the anchor.  An anchor past ``start`` was set on a branch the group has
        left: it counts for nothing."""
        kept = anchor if anchor <= start else 0
        needed = self.required(next_step, kept)
        if needed > start or needed in held:
            return True, kept
        return False, start
