"""Where a restore spends its time, phase by phase (seconds on this rank).

``plan`` (rank 0 lists the tiers, the plan is broadcast), ``targets`` (the live state dict
DCP loads into), ``fetch`` (bytes brought to this rank: a memory-tier get, S3 downloads or
ranged reads, nothing for local disk), ``verify`` (sizes and DCP's ``.metadata`` before the
load; a native load's whole files), ``read`` (``dcp.load``: reading, verifying the data
files' checksum chunks and copying into the targets, overlapped; ranged S3 reads verify each
chunk as it arrives, inside ``fetch``), ``model`` and ``optim`` (installing them), ``train``
(sampler, scheduler, ledger, RNG).  They go into the restore record and
so into ``summary.json["restored"]["phases"]`` and each recovery.  ``MemoryWatch`` adds the
restore's peak private memory beside this rank's share of the state (``["memory"]``).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

# "agree": the ranks' agreements on a step's problems, after fetching and after loading;
# each rank loads alone, so a rank waits there for the slowest one
PHASES = ("plan", "targets", "fetch", "verify", "read", "agree", "model", "optim", "train")


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


def anonymous_rss() -> Optional[int]:
    """This process's private resident memory in bytes (``RssAnon``), or None off Linux.

    Mapped checkpoint files and object-store buffers are page cache or shared memory, not
    the process's own, so they are left out: they exist whether or not a restore runs.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class MemoryWatch:
    """The peak of ``anonymous_rss`` while a restore runs, sampled every ``interval_s``.

    ``transient_bytes`` is how far the peak rose above what the process holds once the
    restore is over (the state itself stays): the restore's own working memory.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.peak = self.after = anonymous_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="restore-memory", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak or 0, anonymous_rss() or 0)

    def __enter__(self) -> "MemoryWatch":
        if self.peak is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.peak is not None:
            self._stop.set()
            self._thread.join()
            self.after = anonymous_rss()
            self.peak = max(self.peak, self.after or 0)

    def record(self, state_bytes: int) -> Dict[str, float]:
        """``peak_over_state``: (this rank's state + the transient peak) / the state."""
        if self.peak is None or self.after is None or not state_bytes:
            return {}
        transient = max(0, self.peak - self.after)
        return {
            "state_mb": round(state_bytes / 2**20, 1),
            "transient_peak_mb": round(transient / 2**20, 1),
            "peak_over_state": round((state_bytes + transient) / state_bytes, 3),
        }
