"""A failed save, in one line that says what to do: which key and path, and for a full
disk how much is free and how much the step needed, and what the run does next.

A save never stops training (:class:`CheckpointManager`): the step is left uncommitted,
its partial files are removed so the space they took is free again, the newest
committed step stays loadable, and the next due save tries again.  DCP's own error
(``CheckpointException``, a ``BaseException``) carries every rank's traceback in its
text; that goes to the debug log, not the console.

Invariant: this module imports no torch, since the CLI imports it before it starts Ray
(torch's import is a second of the command's start).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, List, Mapping, Optional

from raytrain_ext.errors.text import one_line


def free_bytes(directory: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def save_failure_text(
    error: BaseException,
    step: int,
    directory: Path,
    key: str,
    needed: int,
    newest_committed: Optional[int],
) -> str:
    """One line: a full disk named with its key, path and sizes, else the error's first
    line; then what the run does next."""
    free = free_bytes(directory)
    newest = "none yet" if newest_committed is None else f"step {newest_committed}"
    next_ = (
        f"Training goes on; the newest committed checkpoint ({newest}) stays loadable, and "
        "the next due save tries again."
    )
    if free is not None and (free < needed or _says_disk_full(error)):
        return (
            f"{key}: {directory} is full ({free / 2**20:.1f} MiB free; this rank's part of "
            f"step {step} needs about {needed / 2**20:.1f} MiB): step {step} was not saved. "
            f"{next_} Free space there, or point {key} at a larger disk."
        )
    return f"checkpoint of step {step} failed: {one_line(error)}. {next_}"


def failed_save_alarms(stats: Optional[Mapping[str, Any]]) -> List[str]:
    """A run's failed saves (rank 0's checkpoint stats), one ``ALARM:`` line each, for the
    driver to print when the run ends.

    Why: rank 0 logs each failure as it happens, but that line reaches the console through
    Ray's log forwarding, which holds back a line repeated but for its numbers (the next
    save to the same full disk) and loses what is still in flight when a private Ray shuts
    down (the final save's).  The driver's own lines are neither."""
    return [
        f"ALARM: step {f['step']} not committed to tier {f['tier']}: {f['error']}"
        if "tier" in f
        else f"ALARM: {f['error']}"
        for f in (stats or {}).get("failed", [])
    ]


def _says_disk_full(error: BaseException) -> bool:
    return "No space left on device" in str(error)
