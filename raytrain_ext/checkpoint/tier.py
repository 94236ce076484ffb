"""The interface of a checkpoint tier: a place that holds ``step-<N>/`` file sets.

A tier stores files and manifests; it knows nothing about tensors.  ``upload``
is called by every rank for the files it wrote, ``commit`` once all ranks'
files have landed (the manifest goes in last), and ``materialize`` returns a
local directory holding a committed checkpoint's files for DCP to read.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Protocol

from raytrain_ext.checkpoint.manifest import Manifest


class TierError(RuntimeError):
    """A tier is unusable (missing bucket, bad credentials, unreachable endpoint...)."""


class Tier(Protocol):
    name: str

    def probe(self) -> None:
        """Write, read back and delete a small object; raise ``TierError`` naming the fix."""

    def upload(self, step: int, src_dir: Path, names: List[str]) -> None: ...

    def commit(self, manifest: Manifest) -> None: ...

    def committed_steps(self) -> List[int]: ...

    def manifest_text(self, step: int) -> Optional[str]:
        """The manifest as stored, or None when the step has none (never committed)."""

    def materialize(self, step: int, names: List[str], cache_dir: Path) -> Path: ...

    def all_steps(self) -> List[int]:
        """Every step with anything stored, committed or not (for retention)."""

    def delete(self, step: int) -> None: ...


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
