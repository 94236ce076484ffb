"""The run directory as an append-only history of attempts.

``<output_dir>/<name>/attempts/<NNN>/`` holds each ``fit()``'s resolved ``config.yaml``,
its ``summary.json`` and, when it failed, ``error.log`` (the full remote traceback,
without colour codes).  The run's own ``config.yaml`` and ``summary.json`` describe the
run's current state, so they are replaced only by an attempt that trained at least one
step (or when the run has none yet): a resume that fails before its first step (a model
that does not match the checkpoints) leaves them exactly as they were.  A start refused
by the preflight writes nothing at all, since it never gets here.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from raytrain_ext.elastic.controller import TrainingFailed
from raytrain_ext.elastic.failure_text import full_text, one_line, strip_ansi

ATTEMPTS = "attempts"
SUMMARY = "summary.json"
CONFIG = "config.yaml"
ERROR_LOG = "error.log"


@dataclass
class Attempt:
    """One ``fit()`` of a run: its number and its directory under ``attempts/``."""

    number: int
    directory: Path


class RunDirectory:
    """Writes one run's records; every file is replaced atomically (temp file + rename)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def begin(self, config_yaml: str) -> Attempt:
        """A new attempt directory holding this attempt's config (numbers never reused)."""
        attempts = self.root / ATTEMPTS
        attempts.mkdir(parents=True, exist_ok=True)
        number = 1 + max((int(p.name) for p in attempts.iterdir() if p.name.isdigit()), default=0)
        while True:
            directory = attempts / f"{number:03d}"
            try:
                directory.mkdir()
                break
            except FileExistsError:  # another fit() of the same run took it
                number += 1
        write_atomic(directory / CONFIG, config_yaml)
        return Attempt(number, directory)

    def finish(
        self, attempt: Attempt, summary: Dict[str, Any], error: Optional[BaseException] = None
    ) -> None:
        """Record the attempt; promote it to the run's current state if it trained."""
        if error is not None:
            log_path = attempt.directory / ERROR_LOG
            write_atomic(log_path, full_text(error))
            summary["error"] = (
                strip_ansi(str(error)) if isinstance(error, TrainingFailed) else one_line(error)
            )
            summary["error_log"] = str(log_path)
        summary["attempt"] = attempt.number
        text = json.dumps(summary, indent=2)
        write_atomic(attempt.directory / SUMMARY, text)
        if summary.get("loss_history") or not (self.root / SUMMARY).exists():
            write_atomic(self.root / CONFIG, (attempt.directory / CONFIG).read_text())
            write_atomic(self.root / SUMMARY, text)


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
