"""The run directory as an append-only history of attempts.

``<output_dir>/<name>/attempts/<NNN>/`` holds each ``fit()``'s resolved ``config.yaml``,
its ``summary.json`` and, when it failed, ``error.log`` (the full remote traceback,
without colour codes).  The run's own ``config.yaml`` and ``summary.json`` describe the
run's current state, so they are replaced only by an attempt that trained at least one
step (or when the run has none yet): a resume that fails before its first step (a model
that does not match the checkpoints) leaves them exactly as they were.  ``metrics.jsonl``
holds every step's record, each attempt's appended after the ones before.  A start refused
by the preflight writes nothing at all, since it never gets here.

One attempt writes at a time: :meth:`RunDirectory.begin` takes the run's lock
(:mod:`raytrain_ext.run_lock`) and :meth:`RunDirectory.finish` releases it.  A run whose
summary says it finished at ``run.max_steps`` or later is not started again
(:func:`refuse_finished_run`, before Ray).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from raytrain_ext.elastic.controller import TrainingFailed
from raytrain_ext.errors import InputError
from raytrain_ext.errors.text import full_text, one_line, strip_ansi
from raytrain_ext.run_lock import RunLock

ATTEMPTS = "attempts"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"  # every step's record (metrics.sinks.JsonlSink), appended
CONFIG = "config.yaml"
ERROR_LOG = "error.log"


@dataclass
class Attempt:
    """One ``fit()`` of a run: its number and its directory under ``attempts/``."""

    number: int
    directory: Path


class RunAlreadyFinished(InputError):
    """The run reached ``run.max_steps`` in an earlier attempt: nothing is left to train."""


def refuse_finished_run(root: Path, max_steps: int, resume: str) -> None:
    """Raise :class:`RunAlreadyFinished` when the run's summary says it finished at
    ``max_steps`` or later (a resume would restore that step and stop). An explicit
    ``checkpoint.resume`` (a step, or ``never``) is the user's choice and is let through."""
    path = Path(root) / SUMMARY
    if resume != "auto" or not path.is_file():
        return
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # report and a resume say what is wrong with it
    done = summary.get("steps_completed") or 0
    if summary.get("status") == "finished" and done >= max_steps:
        raise RunAlreadyFinished(
            f"run {Path(root).name} already finished at step {done} ({path}); nothing to "
            f"train. Use a new run.name, or raise run.max_steps above {done} to train on "
            "from its checkpoint."
        )


class RunDirectory:
    """Writes one run's records; every file is replaced atomically (temp file + rename).
    Between :meth:`begin` and :meth:`finish` it holds the run's lock."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.lock = RunLock(self.root)

    def begin(self, config_yaml: str) -> Attempt:
        """Lock the run, then a new attempt directory holding this attempt's config
        (numbers never reused). Raises :class:`RunInUse` when another process trains it."""
        self.lock.acquire()
        try:
            attempts = self.root / ATTEMPTS
            attempts.mkdir(parents=True, exist_ok=True)
            numbers = (int(p.name) for p in attempts.iterdir() if p.name.isdigit())
            number = 1 + max(numbers, default=0)
            directory = attempts / f"{number:03d}"
            directory.mkdir()
            self.lock.record(number)
            write_atomic(directory / CONFIG, config_yaml)
        except BaseException:
            self.lock.release()
            raise
        return Attempt(number, directory)

    def finish(
        self, attempt: Attempt, summary: Dict[str, Any], error: Optional[BaseException] = None
    ) -> bool:
        """Record the attempt; promote it to the run's current state if it trained (True);
        release the run's lock."""
        try:
            return self._record(attempt, summary, error)
        finally:
            self.lock.release()

    def _record(
        self, attempt: Attempt, summary: Dict[str, Any], error: Optional[BaseException]
    ) -> bool:
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
            return True
        return False


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
