"""A save's collective that met a vanished peer, kept for the step that waits for the save.

A per-step snapshot persists on a thread while the next step computes; that step's
update first waits for it (``CheckpointManager.before_update``).  When a peer vanished
during the persist, the step's own collectives may already be over (FSDP's update needs
none after the reduce-scatter), so without this the survivors would finish one more step
that no committed snapshot holds.  The latch tells the waiting step to fail instead, as
its collective would have.

Invariants: only a collective of the checkpoint group trips the latch (``watch``), never
a tier's own upload, commit or retention, whose network errors are the save's alone and
never stop training; a rank's own failure (not a vanished peer) does not trip it; the
latch keeps text only (an exception would keep the persist's frames and its snapshot
alive); it is tripped on the persist thread and read only after that thread was joined.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from raytrain_ext.errors.text import one_line, peer_loss_marker


class SnapshotPeerLost(RuntimeError):
    """The save an update waited for failed because a peer vanished: an echo of that
    peer's failure (``errors.text.is_peer_loss`` says so from the message)."""


class PeerLossLatch:
    def __init__(self) -> None:
        self._lost: Optional[str] = None  # the collective's error, in one line

    def reset(self) -> None:
        self._lost = None

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Run a checkpoint-group collective; a vanished peer in it trips the latch (the
        error is raised on, for the save to record)."""
        try:
            yield
        except Exception as e:  # DCP's CheckpointException carries other ranks' errors
            if peer_loss_marker(e) is not None:
                self._lost = one_line(e)
            raise

    def raise_if_tripped(self) -> None:
        """Fail the waiting step when the save met a vanished peer; resets the latch."""
        lost, self._lost = self._lost, None
        if lost is not None:
            raise SnapshotPeerLost(
                f"the save this step's update waited for met a vanished peer ({lost}); "
                "the update is not applied, so the group re-forms one step past the newest "
                "committed snapshot"
            )
