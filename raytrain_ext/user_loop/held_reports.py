"""Reported checkpoints held in the memory tier, so that a re-formed group resumes from the
newest report without waiting for, or losing, its upload to storage.

Why: ``report(checkpoint=...)`` persists in the background (``uploader``).  A rank lost
while its upload is in flight (a large model going to S3) leaves that report uncommitted
in storage, and the next group would go back to an older one and redo every report in
between; the survivors would also wait for their own uploads before starting.  So each
uploading rank first hands its staged files to the run's memory tier
(``checkpoint.tiers.memory``: a holder on its node reads them, a holder on another node
copies them, so a lost node loses none): a memory copy, not an upload.

What the tier's registry holds under a report's index:

- each file as ``<group>/<relative path>``, so a group's files never mix with those of an
  earlier group that reported the same index;
- each uploading rank's marker ``<group>/.held-rank-<r>``, added once all its files are held;
- rank 0's record of the report (the tier's manifest text): its group, the uploading ranks,
  the metrics and each dataset shard's position, written at the report.

Invariant: a report is held (``newest`` returns it) only when its record and the marker of
every uploading rank of the record's group are there, so every file was put on two nodes
(one, on a single node); ``materialize`` raises when the nodes holding a file were lost
since, and the group then starts from storage (``starting_point``).  Nothing waits on
another rank: completeness is read when a group starts.  Two ranks that report a file of
the same name keep one of them, as storage keeps the last upload.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from raytrain_ext.checkpoint.tiers.memory import MemoryTier
from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.staging import Staged, check_unchanged

MARKER = ".held-rank-"


@dataclass(frozen=True)
class HeldReport:
    """Rank 0's record of a report whose files went to the memory tier."""

    index: int
    group: str
    ranks: Tuple[int, ...]  # the ranks that passed a checkpoint
    metrics: Dict[str, Any] = field(default_factory=dict)
    positions: Dict[str, Any] = field(default_factory=dict)  # each dataset shard's [epoch, row]


class HeldReports:
    """One run's reported checkpoints in its memory tier (picklable: every rank has one).
    ``keep``: how many held reports stay (``checkpoint.keep_in_memory``)."""

    def __init__(self, run: str, keep: int):
        self.run, self.keep = run, keep
        self._tier: Optional[MemoryTier] = None

    @property
    def tier(self) -> MemoryTier:
        if self._tier is None:
            self._tier = MemoryTier(self.run)
        return self._tier

    def hold(self, index: int, group: str, rank: int, staged: Staged) -> None:
        """Hold this rank's staged files of report ``index``, then mark them held, unless
        one changed in place since ``report`` (``staging.check_unchanged`` raises)."""
        files = {f"{group}/{name}": Path(staged.directory) / name for name in staged.names}
        self.tier.hold_files(index, files)
        check_unchanged(staged)
        self.tier.mark(index, f"{group}/{MARKER}{rank}")

    def record(self, report: HeldReport) -> None:
        """Rank 0: the report's record (its files may still be on their way)."""
        self.tier.commit_text(report.index, json.dumps(asdict(report)))

    def newest(self) -> Optional[HeldReport]:
        """The newest report whose every uploading rank's files are held, or None."""
        for index in reversed(self.tier.committed_steps()):
            report = self._held_report(index)
            if report is not None:
                return report
        return None

    def retain(self) -> List[int]:
        """Keep the newest ``keep`` held reports and anything newer (still arriving);
        release everything older.  Returns the released indices."""
        committed = reversed(self.tier.committed_steps())
        held = [i for i in committed if self._held_report(i) is not None]
        if not held:
            return []
        oldest_kept = held[: self.keep][-1]
        released = [i for i in self.tier.all_steps() if i < oldest_kept]
        for index in released:
            self.tier.delete(index)
        return released

    def discard_after(self, index: int) -> None:
        """Release every report after ``index`` (a new group reports those again)."""
        for later in [i for i in self.tier.all_steps() if i > index]:
            self.tier.delete(later)

    def materialize(self, report: HeldReport, target: str) -> Checkpoint:
        """The report's files written into the local directory ``target``."""
        prefix = f"{report.group}/"
        names = [
            name
            for name in self.tier.where(report.index)
            if name.startswith(prefix) and not name[len(prefix) :].startswith(MARKER)
        ]
        for name, data in self.tier.read_files(report.index, names).items():
            path = os.path.join(target, name[len(prefix) :])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as out:
                out.write(data)
        return Checkpoint(target)

    def _held_report(self, index: int) -> Optional[HeldReport]:
        """Report ``index``'s record when every uploading rank's marker is there, else None."""
        text = self.tier.manifest_text(index)
        if text is None:
            return None
        fields = json.loads(text)
        report = HeldReport(**{**fields, "ranks": tuple(fields["ranks"])})
        names = self.tier.where(report.index)
        if all(f"{report.group}/{MARKER}{rank}" in names for rank in report.ranks):
            return report
        return None
