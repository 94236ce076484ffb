"""The global order of a GRPO run: prompt groups by step, each named by its step.

A GRPO sample is a prompt *group at a step*: the same prompt at another step has other
completions, from other weights and other seeds.  So the sample ids this order hands the
loop are ``(step - 1) * num_prompts + prompt index`` (steps from 1): the ledger counts
each step's groups once, a batch's ids say which step's rollout they come from (the
prefetcher assembles the next step's micro-batches before the loop reaches it), and the
prompts follow the world-size-independent :class:`GlobalSampler` underneath, each once
per epoch.

With ``objective.grpo.num_iterations`` = μ > 1 (TRL's μ), each generation trains μ
steps: steps ``s0 .. s0 + μ - 1`` (``s0 = generation_step(s)``) take the same prompt
groups (the sampler advances once per generation), each under its own step's ids, and
the rollout service is asked for them once, under ``s0``.

Invariants:
- ``next_global_batch`` of step ``s`` returns ids of step ``s`` only; ``peek`` those of
  ``s + 1``; the order's state is its sampler's plus the step and the current
  generation's prompts, so a restored run and a re-formed group continue at the same
  step with the same prompts, mid-generation too.
- ``prompts_of(step)`` is the step's prompt indices in the global batch's order, the
  order every rank asks the rollout service for them.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Tuple

import numpy as np

from raytrain_ext.data.sampler import GlobalSampler
from raytrain_ext.rollout.schedule import generation_of

KEPT_STEPS = 4  # the steps whose prompts are remembered (this one, the next, a few back)


class RolloutOrder:
    """A :class:`GlobalOrder` over (step, prompt) ids (module doc)."""

    fingerprint: Optional[str] = None

    def __init__(self, prompts: GlobalSampler, iterations: int = 1):
        self.prompts = prompts
        self.num_prompts = prompts.num_samples
        self.iterations = iterations  # steps per generation (num_iterations)
        self.step = 0  # the steps handed out
        self._current: np.ndarray = np.zeros(0, dtype=np.int64)  # the step handed out's prompts
        self._batches: Dict[int, np.ndarray] = {}

    def generation_step(self, step: int) -> int:
        """The first step of ``step``'s generation (module doc)."""
        return generation_of(step, self.iterations)

    def next_global_batch(self) -> np.ndarray:
        self.step += 1
        if self.generation_step(self.step) == self.step:
            self._current = self.prompts.next_global_batch()
        return self._ids(self.step, self._current)

    def peek_global_batch(self) -> np.ndarray:
        upcoming = self.step + 1
        starts = self.generation_step(upcoming) == upcoming
        return self._ids(upcoming, self.prompts.peek_global_batch() if starts else self._current)

    def _ids(self, step: int, prompts: np.ndarray) -> np.ndarray:
        self._batches[step] = prompts
        for old in [s for s in self._batches if s <= step - KEPT_STEPS]:
            del self._batches[old]
        return (step - 1) * self.num_prompts + prompts

    def prompts_of(self, step: int) -> np.ndarray:
        """Step ``step``'s prompt indices, in global-batch order."""
        if step not in self._batches:
            raise KeyError(
                f"step {step}'s prompts are not known here (steps {sorted(self._batches)})"
            )
        return self._batches[step]

    def prompts_ahead(self, step: int) -> np.ndarray:
        """Step ``step``'s prompt indices, however far past the steps handed out (a copy
        of this order advances to it; this one does not move)."""
        if step in self._batches:
            return self._batches[step]
        ahead = copy.deepcopy(self)
        while ahead.step < step:
            ahead.next_global_batch()
        return ahead.prompts_of(step)

    def split(self, ids: np.ndarray) -> Tuple[int, np.ndarray]:
        """(the step, the prompt indices) of ids of one step."""
        steps: np.ndarray = ids // self.num_prompts + 1
        if len(ids) == 0 or (steps != steps[0]).any():
            raise ValueError(f"ids {ids.tolist()} are not of one step")
        return int(steps[0]), ids % self.num_prompts

    def state_dict(self) -> Dict[str, Any]:
        return {
            **self.prompts.state_dict(),
            "rollout_step": self.step,
            "rollout_prompts": self._current.tolist(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "rollout_step" not in state:
            from raytrain_ext.errors import InputError

            raise InputError(
                "objective.name: the checkpoint was not trained with objective.name=grpo; "
                "resume it with its own objective, or start a new run.name"
            )
        self.prompts.load_state_dict(state)
        self.step = int(state["rollout_step"])
        self._current = np.asarray(state.get("rollout_prompts", []), dtype=np.int64)
        self._batches.clear()
