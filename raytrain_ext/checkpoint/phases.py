"""Where a restore spends its time, phase by phase (seconds on this rank).

``plan`` (rank 0 lists the tiers, the plan is broadcast), ``targets`` (the live state dict
DCP loads into), ``fetch`` (bytes brought to this rank: a memory-tier get, S3 downloads or
ranged reads, nothing for local disk), ``verify`` (checksums against the manifest; ranged
S3 reads verify each chunk as it arrives, inside ``fetch``), ``read`` (``dcp.load``:
reading, deserialising and copying into the targets), ``model`` and ``optim`` (installing
them), ``train`` (sampler, scheduler, ledger, RNG).  They go into the restore record and
so into ``summary.json["restored"]["phases"]`` and each recovery.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterator

PHASES = ("plan", "targets", "fetch", "verify", "read", "model", "optim", "train")


class RestorePhases:
    """Accumulates seconds per phase (a phase may run more than once: a skipped step)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {name: 0.0 for name in PHASES}

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - started

    def as_dict(self) -> Dict[str, float]:
        return {f"{name}_s": round(value, 4) for name, value in self.seconds.items()}
