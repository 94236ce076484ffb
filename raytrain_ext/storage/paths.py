"""Local paths the user names: will a directory or a file there be writable?

Each check probes for real (an existing directory gets a temporary file; a missing one
has its first missing component created and removed again), because permission bits
alone do not tell (root passes ``os.access`` on ``/proc``), and returns a message that
names the key, the path, what is wrong and the fix.  Nothing is left behind.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Optional


def writable_dir_problem(path: str | Path, key: str) -> Optional[str]:
    """Why ``path`` cannot be used (created if need be) as a writable directory, or None."""
    target = Path(path)
    existing = target
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return (
            f"{key}: cannot use {target}: {existing} is a file, not a directory. Point "
            f"{key} somewhere else, or move that file away."
        )
    probe = target if existing == target else _first_missing(target, existing)
    try:
        if existing == target:
            _probe_file(target)
        else:
            probe.mkdir()
            probe.rmdir()
    except OSError as e:
        action = "write to" if existing == target else "create"
        return f"{key}: cannot {action} {probe}: {_reason(e)}. {_fix(key, e)}"
    return None


def _first_missing(target: Path, existing: Path) -> Path:
    while target.parent != existing:
        target = target.parent
    return target


def writable_file_problem(path: str | Path, key: str) -> Optional[str]:
    """Why a file cannot be written at ``path`` (its directory created if need be), or None."""
    target = Path(path)
    if target.is_dir():
        return (
            f"{key}: {target} is a directory; give the path of the file to write, for "
            f"example {target / 'model.safetensors'}."
        )
    return writable_dir_problem(target.parent, key)


def _probe_file(directory: Path) -> None:
    fd, name = tempfile.mkstemp(dir=directory, prefix=".write-probe-")
    os.close(fd)
    os.unlink(name)


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _fix(key: str, error: OSError) -> str:
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"Point {key} at a directory this user may write, or fix its permissions."
    if error.errno == errno.ENOSPC:
        return f"Free space there, or point {key} at another disk."
    return f"Point {key} at a writable local directory."
