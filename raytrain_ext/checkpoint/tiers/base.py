"""The interface of a checkpoint tier: a place that holds ``step-<N>/`` file sets.

A tier stores files and manifests; it knows nothing about tensors.  ``upload``
is called by every rank for the files it wrote, ``commit`` once all ranks'
files have landed (the manifest goes in last), and ``materialize`` returns a
local directory holding a committed checkpoint's files for DCP to read.

What differs between tiers is declared on the class, so the checkpoint manager and the
restore never ask which tier they hold: ``holds_snapshots`` (per-step snapshots go
there), ``node_local`` (who commits), ``kept_steps`` (retention) and ``fetch_mode`` (how
a restore reads it).  A tier is one module plus a line in ``tiers/__init__.build_tiers``.
"""

from __future__ import annotations

import abc
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from raytrain_ext.checkpoint.manifest import Manifest, step_dir_name

if TYPE_CHECKING:
    from raytrain_ext.checkpoint.tiers.s3_ranged import PlannedS3Fetch


class TierError(RuntimeError):
    """A tier is unusable (missing bucket, bad credentials, unreachable endpoint...)."""


class FetchMode(StrEnum):
    """How a restore reads a committed step from a tier (``checkpoint/fetch.py``)."""

    directory = "directory"  # materialize() a local directory, then map the files planned
    views = "views"  # read_files(): the planned files' bytes as memory views, no directory
    ranged = "ranged"  # ranged_fetch(): only the byte ranges this rank's load plan reads


class Tier(abc.ABC):
    """A place that holds ``step-<N>/`` file sets (module doc); ``retries`` counts failed
    requests that were retried (a flaky store shows up here; 0 where nothing retries)."""

    name: str = ""
    retries: int = 0
    holds_snapshots: bool = False  # checkpoint.snapshot_every_step's snapshots go here
    node_local: bool = False  # a copy per node, committed by its first rank (else rank 0)
    fetch_mode: FetchMode = FetchMode.directory

    def kept_steps(self, ckpt_cfg: Any) -> int:
        """How many committed steps retention keeps here (``checkpoint.keep_last``)."""
        return ckpt_cfg.keep_last

    def location(self, step: int) -> str:
        """Where a step lives, for messages (``local step-12``)."""
        return f"{self.name} {step_dir_name(step)}"

    def read_files(self, step: int, names: List[str]) -> Dict[str, memoryview]:
        """The files' bytes (``FetchMode.views``); a tier that declares it implements it."""
        raise NotImplementedError(f"tier {self.name!r} fetches by {self.fetch_mode}, not views")

    def ranged_fetch(
        self, step: int, manifest: Manifest, cache_dir: Path, threads: Optional[int] = None
    ) -> "PlannedS3Fetch":
        """A fetch of byte ranges (``FetchMode.ranged``); a tier that declares it implements it."""
        raise NotImplementedError(f"tier {self.name!r} fetches by {self.fetch_mode}, not ranges")

    @abc.abstractmethod
    def probe(self) -> None:
        """Write, read back and delete a small object; raise ``TierError`` naming the fix."""

    @abc.abstractmethod
    def upload(self, step: int, src_dir: Path, names: List[str]) -> None:
        """Store these files of ``src_dir`` under the step (called by every rank)."""

    @abc.abstractmethod
    def commit(self, manifest: Manifest) -> None:
        """Store the manifest last: the step is committed once it is readable."""

    @abc.abstractmethod
    def committed_steps(self) -> List[int]:
        """Steps whose manifest is stored, oldest first."""

    @abc.abstractmethod
    def manifest_text(self, step: int) -> Optional[str]:
        """The manifest as stored, or None when the step has none (never committed)."""

    @abc.abstractmethod
    def materialize(self, step: int, names: List[str], cache_dir: Path) -> Path:
        """A local directory holding these files of a committed step."""

    @abc.abstractmethod
    def all_steps(self) -> List[int]:
        """Every step with anything stored, committed or not (for retention)."""

    @abc.abstractmethod
    def delete(self, step: int) -> None:
        """Remove everything stored under the step."""


def prune(tier: Tier, keep_last: int) -> List[int]:
    """Keep the newest ``keep_last`` committed steps; delete older ones and stale partial ones.

    The newest committed checkpoint is never deleted, and neither is a partial
    step newer than it (it may be a save in progress).  Returns the deleted steps.
    """
    committed = sorted(tier.committed_steps())
    keep = set(committed[-keep_last:]) if committed else set()
    newest = committed[-1] if committed else -1
    doomed = []
    for step in tier.all_steps():
        if step in keep:
            continue
        if step in committed or step < newest:  # old committed, or a partial one left behind
            tier.delete(step)
            doomed.append(step)
    return doomed
