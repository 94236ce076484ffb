"""Helpers for tests that run the trainer: small overrides, a run in a thread, waiting for a
committed checkpoint."""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from pathlib import Path
from typing import List

# The packaged default's model at half its width and sequence length, for tests that need
# many steps.  A chaos test whose fault must land before the run ends gives its steps a
# floor (``step_floor``: a sleep, which changes no number) rather than a bigger model; the
# in-place grow-back test keeps the packaged one, whose steps give its spare the 20 s it
# needs to warm up and join on a loaded machine (tests/cluster/test_elastic_in_place.py).
FAST_MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=64"]


def tiny_overrides(tmp_path, *extra):
    """The packaged default, shortened for tests, writing under tmp_path."""
    return [
        f"run.output_dir={tmp_path}",
        "run.max_steps=6",
        "run.log_every=2",
        "run.tensorboard=false",
        *extra,
    ]


def wait_for_checkpoint(
    directory: Path, min_step: int, timeout_s: float = 120.0, while_running=None
) -> int:
    """Block until a committed checkpoint of step >= ``min_step`` is in ``directory``; its step.

    Not one exact step: with ``checkpoint.on_busy=skip`` (the default) a save that falls
    due while the previous one is still persisting is skipped, which a loaded machine does
    now and then.  ``while_running``: a ``Popen`` that must still run (to be interrupted).
    """
    from raytrain_ext.checkpoint.tiers.disk import DiskTier

    tier = DiskTier(directory)
    deadline = time.time() + timeout_s
    while time.time() < deadline and (while_running is None or while_running.poll() is None):
        steps = tier.committed_steps()
        if steps and steps[-1] >= min_step:
            return steps[-1]
        time.sleep(0.02)
    raise AssertionError(
        f"no checkpoint of step >= {min_step} in {directory} within "
        f"{timeout_s:.0f} s" + (" while the run ran" if while_running else "")
    )


def wait_until(predicate, what: str, timeout_s: float = 120.0):
    """Poll ``predicate`` until it returns something truthy, and return that; fail naming
    ``what`` after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while not (value := predicate()):
        if time.time() >= deadline:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        assert time.time() < deadline, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(0.05)
    return value


def last_step(trainer) -> int:
    """The run's newest step (0 before the controller exists)."""
    records = trainer.controller.result.records if trainer.controller else []
    return records[-1]["step"] if records else 0


def recovered(trainer, count: int) -> bool:
    """``count`` recoveries closed by their group's first report: the controller forwards
    rank 0's reports in batches, so a count of reports alone can run ahead of a fault."""
    log = [] if trainer.controller is None else trainer.controller.result.recovery_log
    return len(log) >= count and log[count - 1].first_step_after_s is not None


class FitThread:
    """``trainer.fit()`` in a thread, for tests that inject faults while it runs.

    A test cannot leave the run behind: leaving the ``with`` block (an assertion
    failed, or the run outlived the timeout of ``join``/``summary``) stops the
    trainer and joins its thread, so a cluster fixture never tears Ray down under
    a live run.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.outcome: list = []
        self.thread = threading.Thread(target=self._fit, daemon=True, name="fit")

    def _fit(self) -> None:
        try:
            self.outcome.append(self.trainer.fit())
        except Exception as e:
            self.outcome.append(e)

    def __enter__(self) -> "FitThread":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.thread.is_alive():
            self.trainer.stop("the test ended before the run")
            self.thread.join(timeout=120)

    def join(self, timeout_s: float):
        """The run's summary, or the exception that ended it."""
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            raise AssertionError(
                f"the run was still going after {timeout_s:.0f} s "
                "(every thread's stack is on stderr)"
            )
        (outcome,) = self.outcome
        return outcome

    def summary(self, timeout_s: float) -> dict:
        """The summary of a run that must finish."""
        outcome = self.join(timeout_s)
        assert isinstance(outcome, dict), f"the run failed: {outcome!r}"
        return outcome


def step_floor(seconds: float, rank: int = 0, attempts: int = 5) -> List[str]:
    """Overrides that make every step of the first ``attempts`` groups last at least
    ``seconds`` (rank ``rank`` sleeps in each: a sleep changes no number), so that on a fast
    machine a run still outlasts what a test waits for mid-run."""
    return [f"chaos.slow_rank={rank}", f"chaos.slow_s={seconds}", f"chaos.attempts={attempts}"]
