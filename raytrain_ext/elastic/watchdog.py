"""Hang detection from step heartbeats, on the driver's clock.

A group is hung when no rank has completed a step for longer than
``max(factor x median step time, floor)``.  The culprits are the ranks that
are not waiting in the step's collective (their peers are, since a collective
waits for everyone); when every rank waits in it, the network is to blame and
all are named.  A rank waiting on a stream's reader (phase ``data``: it may be reading the
dataset again to the position) is not hung: that wait has its own limit,
``data.stream_timeout_s``, on the rank.  Pure logic: the controller feeds it observations.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class HangVerdict:
    ranks: List[int]
    stalled_s: float
    deadline_s: float


class HangWatchdog:
    def __init__(self, factor: float, floor_s: float):
        self.factor, self.floor_s = factor, floor_s
        self.progress: Dict[int, Tuple[int, float, str]] = {}  # rank -> (step, since, phase)
        self.step_times: List[float] = []

    def observe(self, rank: int, step: int, phase: str, now: float) -> None:
        previous = self.progress.get(rank)
        since = previous[1] if previous and previous[0] == step else now
        self.progress[rank] = (step, since, phase)

    def record_step_time(self, seconds: float) -> None:
        self.step_times = (self.step_times + [seconds])[-50:]

    def deadline_s(self) -> float:
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(self.factor * median, self.floor_s)

    def check(self, now: float) -> Optional[HangVerdict]:
        """A verdict once every rank has stepped and none has progressed within the deadline."""
        if not self.progress or any(step == 0 for step, _, _ in self.progress.values()):
            return None  # still starting up (setup and restore are not steps)
        if any(phase == "data" for _, _, phase in self.progress.values()):
            return None  # waiting on a stream's reader: bounded by data.stream_timeout_s
        stalled = now - max(since for _, since, _ in self.progress.values())
        deadline = self.deadline_s()
        if stalled <= deadline:
            return None
        culprits = sorted(r for r, (_, _, phase) in self.progress.items() if phase != "exchange")
        return HangVerdict(culprits or sorted(self.progress), stalled, deadline)
