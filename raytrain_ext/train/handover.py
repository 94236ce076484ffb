"""What this rank keeps for the next group when its group breaks or pauses.

A re-formed group takes its state from live ranks instead of a checkpoint where the layout
allows (``parallel.catalog.live_state``): the whole state from any rank of a replicated
layout (DDP), each shard from a rank of another replica (HSDP), and, for every sharded
layout but ZeRO, a rank's own shards, which a checkpoint restore of their step copies
instead of reading.  What is kept must be a step boundary: the position within the step
(``BOUNDARY``, ``BATCH_TAKEN``, ``UPDATING``) says whether the state now is one, is one
once the sampler is rewound to the step's start, or may be half-updated.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from raytrain_ext.checkpoint.held_chunks import HeldChunks, hold_chunks
from raytrain_ext.checkpoint.manager import REQUEST_EMERGENCY
from raytrain_ext.checkpoint.train_state import TrainState
from raytrain_ext.data.sampler import GlobalOrder
from raytrain_ext.parallel import DistContext
from raytrain_ext.parallel.dims import restores_own_shards, shards_from_replicas, state_from_peers
from raytrain_ext.train.live_state import LiveState, capture_live, restore_from_peers

# where a step stands
BOUNDARY, BATCH_TAKEN, UPDATING = "boundary", "batch_taken", "updating"
log = logging.getLogger(__name__)


class Handover:
    """The live state and held shards this rank offers, and where its step stands."""

    def __init__(self, cfg: Any, ctx: DistContext):
        self.hands_over = state_from_peers(cfg)  # every rank holds the whole state (DDP)
        # HSDP: each rank holds a shard that the ranks of the other replicas hold too
        replicas = shards_from_replicas(cfg)
        self.keeps_live = self.hands_over or replicas
        self.holds_shards = restores_own_shards(cfg)
        dims = ctx.dims
        self.shard = (dims.dp_shard, dims.shard_index(ctx.rank)) if replicas else (1, 0)
        self.position = BOUNDARY
        self._sampler_at_boundary: Optional[Dict[str, Any]] = None  # set as a step begins

    def restore(self, state: TrainState, live: Optional[LiveState]) -> Optional[Dict[str, Any]]:
        """The new group's state from its live ranks' offers; None to restore otherwise."""
        return restore_from_peers(state, live, self.keeps_live, self.shard)

    def batch_taken(self, sampler: GlobalOrder) -> None:
        """The step is about to take its batch: remember the sampler's boundary first."""
        self._sampler_at_boundary = sampler.state_dict()
        self.position = BATCH_TAKEN

    def updating(self) -> None:
        self.position = UPDATING

    def at_boundary(self) -> None:
        self.position = BOUNDARY

    def save_request(self, request: float, paused: bool) -> float:
        """The step's agreed save request; a pause whose state the ranks do not hand over
        (a sharded layout) saves first, synchronously, so the grown group restores that step."""
        if paused and not self.hands_over:
            return max(request, REQUEST_EMERGENCY)
        return request

    def live_state(self, state: TrainState) -> Optional[LiveState]:
        """This rank's state (or shard) at the last step boundary, for the next group's
        ranks; None when it is not handed over (``state_from_peers``,
        ``shards_from_replicas``) or the failure struck mid-update (between the optimizer
        step and the step count), where model and bookkeeping may disagree.  A failure
        after the step's batch was taken hands over the boundary before it: the sampler's
        position saved at the step's start."""
        if not self.keeps_live or self.position == UPDATING:
            return None
        boundary = self._sampler_at_boundary if self.position == BATCH_TAKEN else None
        return capture_live(state, boundary, self.shard)

    def held_chunks(self, state: TrainState) -> Optional[HeldChunks]:
        """This rank's own shards at the last step boundary, for a checkpoint restore of
        that step in the next group (``parallel.dims.restores_own_shards``); None as for
        ``live_state``, or when capturing them fails (the restore then reads them)."""
        if not self.holds_shards or self.position == UPDATING:
            return None
        try:
            return hold_chunks(state)
        except Exception as e:  # a broken group's state dict: read from storage instead
            log.warning(
                "could not keep this rank's shards for the next group (%s: %s); its restore "
                "reads them from the checkpoint",
                type(e).__name__,
                e,
            )
            return None
