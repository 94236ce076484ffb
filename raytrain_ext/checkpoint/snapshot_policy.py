"""Whether every step is snapshotted to the memory tier (``checkpoint.snapshot_every_step``).

Why: a layout whose ranks each hold their own shards (FSDP, TP, PP, EP) has no live peer
holding a lost rank's state, so a lost node costs every step since the newest checkpoint
unless each step is snapshotted (a copy on a second node): with the snapshot, at most one
step is redone.  A replicated layout (DDP) and HSDP's replicas heal from live peers with
nothing redone, and ZeRO saves through DeepSpeed, so for them the default is off.

The default (``null``) is therefore on for own-shard layouts, provided its cost is small.
Its cost is each snapshot's stall (the copy to host memory, and the wait before the next
update for the last save's persist: a regular save's slower tiers included), summed
against the steps' time since the group's first snapshots (``PROBE_SKIP`` allocate the
host buffers and are not counted).  Every ``JUDGED_EVERY`` snapshots the ranks agree on
the largest rank's share; above ``STALL_LIMIT`` the snapshots stop for the rest of the
group's run, and rank 0 says so with the figures and the key that forces them on.  The
share is cumulative, so a long wait behind a regular save counts as what it costs
amortised over the steps between saves.  ``true`` and ``false`` are obeyed unjudged.

Invariant: every rank takes the same decision at the same step (each verdict is one
all-reduce, at a step every rank snapshots), so the snapshots stay collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

STALL_LIMIT = 0.05  # snapshots may cost this share of the steps' time
PROBE_SKIP = 2  # the first snapshots allocate their host buffers: not counted
JUDGED_EVERY = 20  # snapshots between two verdicts


@dataclass
class SnapshotPolicy:
    """``setting``: ``checkpoint.snapshot_every_step`` (None: the layout's default, judged);
    ``own_shards``: whether the layout's ranks hold their own shards."""

    setting: Optional[bool]
    own_shards: bool
    on: bool = field(init=False)
    judged: bool = field(init=False)  # its cost is judged (the default, while on)
    seen: int = 0  # snapshots taken so far
    stall_s: float = 0.0  # summed over the counted snapshots
    step_s: float = 0.0  # the counted snapshots' steps, their stalls included
    verdict: Optional[float] = None  # the last agreed share

    def __post_init__(self) -> None:
        self.on = self.own_shards if self.setting is None else self.setting
        self.judged = self.setting is None and self.on

    def observe(
        self, stall_s: float, step_s: float, agree: Callable[[float], float]
    ) -> Optional[str]:
        """Count one snapshot (its ``stall_s`` within a step of ``step_s``); every
        ``JUDGED_EVERY`` counted ones, ``agree`` (the ranks' maximum of a value) gives the
        verdict.  Returns the line rank 0 logs: the first verdict, and a stop."""
        self.seen += 1
        if not self.judged or self.seen <= PROBE_SKIP:
            return None
        self.stall_s += stall_s
        self.step_s += step_s
        if (self.seen - PROBE_SKIP) % JUDGED_EVERY:
            return None
        first = self.verdict is None
        self.verdict = agree(self.stall_s / self.step_s if self.step_s > 0 else 0.0)
        share = f"{self.verdict:.1%} of the steps' time (limit {STALL_LIMIT:.0%})"
        if self.verdict > STALL_LIMIT:
            self.on = self.judged = False
            return (
                f"per-step snapshots stopped: they stall {share}; a lost node redoes the "
                "steps since the newest checkpoint. Set checkpoint.snapshot_every_step=true "
                "to keep them whatever they cost"
            )
        if first:
            return f"per-step snapshots kept: they stall {share}; a lost node redoes <= 1 step"
        return None
