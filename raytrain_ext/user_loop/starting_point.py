"""Where a re-formed group of a user's loop starts: rank 0's choice, the same on every rank.

The candidates, newest wins: the newest checkpoint committed in storage (or the trainer's
``resume_from_checkpoint`` before any), the newest report the memory tier holds in full
(``held_reports``), and the newest report whose registered state live processes hold
(``registered.live_start``, taken when nothing else is newer).  A start from a held
report keeps the storage candidate as its fallback: a holder's node lost since the report
was held leaves a file unreadable, and then every rank starts from storage instead.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence, Tuple

from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.dataset_shard import positions_of
from raytrain_ext.user_loop.held_reports import HeldReport, HeldReports
from raytrain_ext.user_loop.registered import LiveResume, Offer, PeerOffer, live_start
from raytrain_ext.user_loop.storage import RunStorage

Positions = Dict[str, Tuple[int, int]]


@dataclass(frozen=True)
class Start:
    """A group's start: after report ``index``, from ``checkpoint`` (what ``get_checkpoint``
    returns), each dataset at ``positions``; ``live`` or ``held`` when the state comes from
    live processes or the memory tier; ``committed``: the newest report committed in
    storage, whose ``committed_checkpoint`` and ``committed_positions`` are the fallback."""

    index: int
    checkpoint: Optional[Checkpoint]
    group_id: str
    positions: Positions
    committed: int = 0
    committed_checkpoint: Optional[Checkpoint] = None
    committed_positions: Optional[Positions] = None
    live: Optional[LiveResume] = None
    held: Optional[HeldReport] = None

    def from_storage(self) -> "Start":
        """This start with the held report given up for storage's newest."""
        return replace(
            self,
            index=self.committed,
            checkpoint=self.committed_checkpoint,
            positions=self.committed_positions or {},
            held=None,
        )


def fall_back(
    start: Start,
    offers: Sequence[Sequence[Offer]],
    world_size: int,
    peers: Sequence[Sequence[PeerOffer]] = (),
) -> Start:
    """``start`` with its held report given up (unreadable on some rank): storage's newest,
    or the live copies when they are newer (the same ``offers`` on every rank, so the same
    choice)."""
    stored = start.from_storage()
    live = live_start(offers, stored.committed, world_size, peers)
    if live is None:
        return stored
    return replace(stored, index=live.index, positions=live.positions, live=live)


def choose_start(
    storage: RunStorage,
    held_reports: Optional[HeldReports],
    offers: Sequence[Sequence[Offer]],
    world_size: int,
    resume_from: Optional[Checkpoint],
    peers: Sequence[Sequence[PeerOffer]] = (),
) -> Start:
    """Rank 0's choice (module doc); a new group id with it."""
    latest = storage.latest()
    committed = 0 if latest is None else latest.index
    checkpoint = resume_from if latest is None else latest.checkpoint
    positions = positions_of(None if latest is None else latest.positions)
    base = Start(committed, checkpoint, uuid.uuid4().hex[:12], positions, committed, checkpoint)
    base = replace(base, committed_positions=positions)
    held = None if held_reports is None else held_reports.newest()
    if held is not None and held.index <= committed:
        held = None
    live = live_start(offers, committed if held is None else held.index, world_size, peers)
    if live is not None:
        return replace(base, index=live.index, positions=live.positions, live=live)
    if held is not None:
        return replace(base, index=held.index, positions=positions_of(held.positions), held=held)
    return base
