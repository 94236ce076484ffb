"""Where a step's time goes: its phases, timed back to back on one clock.

Why: a step-time regression once hid for weeks in time that no record named (a process
importing torch beside the ranks).  Each step's record now carries ``phases_s``, and the
summary their medians, so a slower step says which phase grew.

Invariant: the phases of a step add up to its ``step_time_s`` exactly (the last phase,
``bookkeeping``, is what the others leave), and every phase is one of :data:`PHASES`.
A phase measured inside another (the micro-batch fetches inside the forward/backward)
is moved out of it, never counted twice.  ``bookkeeping`` of a step includes the
previous step's reporting (building and sending its record), which ended after that
step's clock stopped.
"""

from __future__ import annotations

import time
from typing import Dict

# data: waiting for micro-batches; forward_backward: the model's forward and backward,
# with the gradient all-reduce DDP/FSDP overlap with it; optimizer: clipping, the update,
# the LR schedule and zeroing; exchange: the per-step all-gather of the ledger and votes;
# weights_sync: GRPO's policy gathered and sent to the rollout engines (0 for other
# objectives); checkpoint: the save stall; bookkeeping: the framework's own work (sampler,
# seeding, guards, records), what is left.
PHASES = (
    "data",
    "forward_backward",
    "optimizer",
    "exchange",
    "weights_sync",
    "checkpoint",
    "bookkeeping",
)


class StepClock:
    """Laps of one step: ``lap(phase)`` charges the time since the last lap to ``phase``."""

    def __init__(self, carried_s: float = 0.0):
        """``carried_s``: time spent for the previous step after its clock stopped."""
        self.start = time.perf_counter()
        self._last = self.start
        self.spent: Dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.spent["bookkeeping"] = carried_s
        self._carried_s = carried_s
        self.seconds = 0.0  # the step's time, once stopped

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        now = time.perf_counter()
        self.spent[phase] += now - self._last
        self._last = now

    def move(self, seconds: float, source: str, target: str) -> None:
        """Re-charge ``seconds`` of ``source`` (a phase timed inside it) to ``target``."""
        self.spent[source] -= seconds
        self.spent[target] += seconds

    def stop(self) -> None:
        """End the step: what no phase claimed is bookkeeping; ``seconds`` becomes the
        step's time (the previous step's carried reporting included)."""
        self.lap("bookkeeping")
        self.seconds = self._last - self.start + self._carried_s

    def since_stop(self) -> float:
        """Seconds since ``stop``: the step's reporting, carried into the next step."""
        return time.perf_counter() - self._last

    def phases(self) -> Dict[str, float]:
        return dict(self.spent)
