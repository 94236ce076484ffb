"""Fault injection in one place: the named hooks the runtime calls, driven by ``chaos.*``.

Kept in the package, not in the tests: operators rehearse failures on real clusters with
the same keys (``chaos.kill_rank=3 chaos.kill_at_step=100``).  The training loop, the
worker actor and the checkpoint manager each call a hook at one point and know nothing of
the faults behind it.

Invariant: every hook is a no-op unless its fault is configured for this rank and the
injector is armed, i.e. on the first ``chaos.attempts`` attempts (0 = the first start).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from raytrain_ext.typed_config.fields import at_least, minus_one_or_more, positive

if TYPE_CHECKING:
    import torch


log = logging.getLogger(__name__)


@dataclass
class ChaosConfig:
    """Fault injection for rehearsals and tests; everything is off by default."""

    stall_save_s: float = at_least(0, 0.0)  # hold each checkpoint between writing and committing it
    kill_rank: int = minus_one_or_more(-1)  # this rank's process exits abruptly ...
    kill_at_step: int = at_least(0, 0)  # ... right after this step (first attempt only)
    hang_rank: int = minus_one_or_more(-1)  # this rank stops making progress ...
    hang_at_step: int = at_least(0, 0)  # ... right after this step (first attempt only)
    # faults fire on the first this-many attempts (2: back-to-back failures)
    attempts: int = positive(1)
    # chaos.kill_rank also dies right after the first re-form's restore
    kill_during_recovery: bool = False
    nan_rank: int = minus_one_or_more(-1)  # this rank's loss becomes NaN ...
    nan_at_step: int = at_least(0, 0)  # ... at this step (first attempt only)
    slow_rank: int = minus_one_or_more(-1)  # this rank sleeps ...
    slow_s: float = at_least(0, 0.0)  # ... this long in every step (a straggler)


class FaultInjector:
    """The ``chaos.*`` faults of one rank in one attempt."""

    def __init__(self, chaos_cfg: Any, rank: int, attempt: int = 0):
        self.cfg, self.rank, self.attempt = chaos_cfg, rank, attempt
        self.armed = attempt < chaos_cfg.attempts

    @classmethod
    def disarmed(cls, chaos_cfg: Any, rank: int) -> "FaultInjector":
        """An injector that never fires (a run past its chaos attempts)."""
        return cls(chaos_cfg, rank, attempt=chaos_cfg.attempts)

    @property
    def save_stall_s(self) -> float:
        """``chaos.stall_save_s``: how long each save waits between writing and committing
        (on the first ``chaos.attempts`` attempts, as every fault)."""
        return self.cfg.stall_save_s if self.armed else 0.0

    def before_compute(self) -> None:
        """``chaos.slow_rank`` computes ``chaos.slow_s`` slower every step (a straggler)."""
        if self.armed and self.rank == self.cfg.slow_rank:
            time.sleep(self.cfg.slow_s)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``chaos.nan_rank`` poisons the loss of step ``chaos.nan_at_step``."""
        if self.armed and self.rank == self.cfg.nan_rank and step == self.cfg.nan_at_step:
            return loss * float("nan")
        return loss

    def after_step(self, step: int, mark: Callable[[str], None]) -> None:
        """``chaos.kill_rank`` dies as on a crash, ``chaos.hang_rank`` stops forever."""
        if self.armed and self.rank == self.cfg.kill_rank and step == self.cfg.kill_at_step:
            log.warning("chaos: killing rank %d after step %d", self.rank, step)
            os._exit(1)
        if self.armed and self.rank == self.cfg.hang_rank and step == self.cfg.hang_at_step:
            log.warning("chaos: hanging rank %d after step %d", self.rank, step)
            mark("hung")
            threading.Event().wait()

    def after_restore(self) -> None:
        """With ``chaos.kill_during_recovery``, ``chaos.kill_rank`` also dies right after the
        first re-form's restore, before its first step (a failure during recovery)."""
        if self.attempt == 1 and self.cfg.kill_during_recovery and self.rank == self.cfg.kill_rank:
            os._exit(1)
