"""A reported directory held for its upload without copying it: ``report`` blocks on this.

The user may delete the directory as soon as ``report`` returns (the usual
``tempfile.TemporaryDirectory`` pattern), so its files are hard-linked into a private
staging directory: a link costs a system call whatever the file's size, and keeps the data
after the user's name for it is gone.  Where a link is impossible (another filesystem) the
file is copied.  A link shares the file's inode, so a file the user rewrites in place
(``torch.save`` to the same path before the upload ended) would change what is uploaded:
``check_unchanged`` compares each linked file's inode, size and modification time with
what they were at ``report`` and, when one changed, the upload raises and its report is
never committed (nothing half-rewritten is ever returned as a checkpoint).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, Tuple

Stamp = Tuple[int, int, int]  # inode, size, mtime in ns


class RewrittenDuringUpload(RuntimeError):
    """A reported file changed in place before its upload finished."""


@dataclass(frozen=True)
class Staged:
    """``directory``: the private copy; ``names``: every file in it (relative paths);
    ``stamps``: each hard-linked file as it was when reported."""

    directory: str
    names: Tuple[str, ...]
    stamps: Dict[str, Stamp]


def _stamp(path: str) -> Stamp:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def stage(directory: str, run_name: str) -> Staged:
    """``directory``'s files in a new private directory, linked where possible."""
    root = tempfile.mkdtemp(prefix=f"raytrain-ext-{run_name}-report-")
    stamps: Dict[str, Stamp] = {}
    names = []
    try:
        for here, _, files in os.walk(directory):
            relative = os.path.relpath(here, directory)
            os.makedirs(os.path.join(root, relative), exist_ok=True)
            for name in files:
                source = os.path.join(here, name)
                target = os.path.normpath(os.path.join(root, relative, name))
                names.append(os.path.relpath(target, root))
                if _link_or_copy(source, target):
                    stamps[names[-1]] = _stamp(target)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return Staged(root, tuple(names), stamps)


def _link_or_copy(source: str, target: str) -> bool:
    """Hard-link ``source`` at ``target`` (True), else copy it (another filesystem, or
    links not allowed: False)."""
    try:
        os.link(source, target)
        return True
    except OSError:
        shutil.copy2(source, target)
        return False


def check_unchanged(staged: Staged) -> None:
    """Raise ``RewrittenDuringUpload`` naming the linked files that changed since staged."""
    changed = [
        rel
        for rel, stamp in sorted(staged.stamps.items())
        if _stamp(os.path.join(staged.directory, rel)) != stamp
    ]
    if changed:
        raise RewrittenDuringUpload(
            f"{', '.join(changed)} changed in place after report(checkpoint=...) returned and "
            "before its upload ended, so this checkpoint is not kept; write each checkpoint "
            "into a new directory (tempfile.TemporaryDirectory()) or new files"
        )
