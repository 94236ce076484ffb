"""``guards.nan_policy`` applied to a step: skip it, fail, or roll back to a checkpoint.

Every rank sees the same global loss and gradient norm (from the step's exchange),
so every rank takes the same decision and, for a rollback, restores the same step.
The rolled-back step's batch is skipped (``Progress.skip_steps``), so the run goes on
past a poisoned batch instead of repeating it.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import numpy as np

from raytrain_ext.checkpoint.manager import CheckpointManager
from raytrain_ext.checkpoint.train_state import TrainState
from raytrain_ext.train.guards import (
    NonFiniteDecision,
    NonFiniteLossError,
    StepAction,
    nonfinite_decision,
)

log = logging.getLogger(__name__)


class NonFiniteGuard:
    def __init__(self, guards_cfg, state: TrainState, ckpt: Optional[CheckpointManager]):
        self.cfg, self.state, self.ckpt = guards_cfg, state, ckpt
        self.rank = state.ctx.rank
        self.rollback_note: Optional[Dict[str, int]] = None  # for the next step record

    def decide(
        self, step: int, loss: float, grad_norm: float, consumed: np.ndarray
    ) -> NonFiniteDecision:
        """Apply ``guards.nan_policy`` to a NaN/Inf step (every rank decides alike)."""
        progress = self.state.progress
        decision = nonfinite_decision(
            self.cfg.nan_policy,
            loss,
            grad_norm,
            progress.nonfinite_steps,
            self.cfg.max_nan_steps,
            can_rollback=self.ckpt is not None,
        )
        if decision.action == StepAction.OK:
            return decision
        progress.nonfinite_steps += 1
        batch = ", ".join(str(i) for i in sorted(consumed.tolist())[:32])
        message = f"non-finite step {step + 1}: {decision.reason}; batch sample indices [{batch}]"
        if decision.action == StepAction.FAIL:
            raise NonFiniteLossError(message)
        if self.rank == 0:
            log.warning(message)
        return decision

    def rollback(self, step: int) -> bool:
        """Restore the newest committed checkpoint and mark ``step``'s batch to be skipped.

        Returns False (the step then stays a plain skipped update) when there is
        no committed checkpoint to go back to.
        """
        if self.ckpt is None:  # checkpoints off: nothing to go back to
            return False
        self.ckpt.wait()
        self.state.progress.skip_steps.add(step)
        restored = self.ckpt.restore(self.state, newest=True)
        if restored is None:
            if self.rank == 0:
                log.warning(
                    "guards.nan_policy=rollback: no committed checkpoint; "
                    "the step's update was skipped instead"
                )
            return False
        if self.rank == 0:
            log.warning(
                "rolled back to step %d; step %d's batch will be skipped",
                restored["step"],
                step + 1,
            )
        self.rollback_note = {"from_step": step + 1, "to_step": restored["step"]}
        return True
