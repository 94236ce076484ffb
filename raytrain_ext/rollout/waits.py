"""A rank's waits on the rollout service, which a re-form cuts short.

Why: a rank waiting for its step's rollout is in no collective, so a lost peer does not
wake it; the controller's re-form asks every survivor to leave what it is waiting in
(``TrainWorker.abort_collectives``) and keeps only the survivors whose ``fit`` returns
within ``elastic.reuse_wait_s``.  A long generation, or a replacement engine still
building, would make a healthy survivor miss that and be restarted.  So the wait is in
slices, and :func:`abandon_waits` (from the actor's control thread) makes it raise
:class:`AbandonedWait`, an echo of the peer's loss (``errors.text.PEER_LOSS_MARKERS``).

Invariant: one event per process; a new training loop's rollout input clears it
(:func:`arm`), so a re-form's abandon never reaches the group after it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

SLICE_S = 0.2  # how soon an abandoned wait notices

_abandoned = threading.Event()


class AbandonedWait(RuntimeError):
    """The group is re-forming: this rank's wait on the rollout was given up."""


def abandon_waits() -> None:
    _abandoned.set()


def arm() -> None:
    """A new group's loop waits again (clears an earlier group's abandon)."""
    _abandoned.clear()


def wait_for(ref: Any, timeout_s: float, what: str) -> Any:
    """``ray.get(ref)`` within ``timeout_s``, given up when the group re-forms."""
    import ray

    deadline = time.monotonic() + timeout_s
    while not ray.wait([ref], timeout=SLICE_S)[0]:
        if _abandoned.is_set():
            raise AbandonedWait(f"{what}: given up, the group is re-forming (a peer was lost)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no answer within {timeout_s:.0f} s")
    return ray.get(ref)
