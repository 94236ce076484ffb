"""The latch that fails a step whose awaited save met a vanished peer (no Ray, no group)."""

import pytest

from raytrain_ext.checkpoint.peer_loss_latch import PeerLossLatch, SnapshotPeerLost
from raytrain_ext.errors.text import is_peer_loss

ECHO = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:39856"


def run_watched(latch: PeerLossLatch, error: BaseException) -> None:
    """A collective that raises ``error`` under the latch; the save records it and goes on."""
    with pytest.raises(type(error)), latch.watch():
        raise error


def test_a_vanished_peer_in_a_collective_fails_the_waiting_step_once():
    latch = PeerLossLatch()
    run_watched(latch, RuntimeError(ECHO))
    with pytest.raises(SnapshotPeerLost) as refused:
        latch.raise_if_tripped()
    assert "Connection closed by peer" in str(refused.value)
    assert is_peer_loss(refused.value)  # the controller blames the dead rank, not this one
    assert refused.value.__cause__ is None  # text only: no frame of the save is kept
    latch.raise_if_tripped()  # read once: the next step goes on


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),  # the save's own failure: training goes on
        RuntimeError("Timed out waiting 1800000ms for recv operation"),  # not a vanished peer
    ],
)
def test_a_save_that_failed_otherwise_never_stops_training(error):
    latch = PeerLossLatch()
    run_watched(latch, error)
    latch.raise_if_tripped()


def test_a_new_save_forgets_what_the_previous_one_met():
    latch = PeerLossLatch()
    run_watched(latch, RuntimeError(ECHO))
    latch.reset()  # the next persist starts
    latch.raise_if_tripped()
