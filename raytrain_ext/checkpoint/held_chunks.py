"""A survivor's own shards as a source for a checkpoint load: only lost shards are read.

Why: a sharded layout (FSDP) that loses a rank must restore, since no live rank holds
the lost shards.  But every survivor still holds its own shards, bit for bit what it
saved at that step.  When the checkpoint being loaded is of the step the survivor's
tensors are at, each item whose saved chunk is one of those shards is copied from the
survivor's memory instead of the medium; DCP's planner still decides what each rank
reads for its new layout (resharded as usual), so only the lost shards, and the parts
of other ranks' shards a new layout moves, come from storage.

Invariants: a chunk is taken from memory only when its key, global offsets and sizes
equal what this rank saved (DCP's own chunk of the rank's tensor) and the checkpoint is
of ``step`` under the same config; the held tensors are references, captured at a step
boundary, and never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.tensor import DTensor

from raytrain_ext.checkpoint.state import model_and_optim
from raytrain_ext.checkpoint.train_state import TrainState

ChunkKey = Tuple[str, Tuple[int, ...]]  # (DCP key, global offsets of the chunk)


@dataclass
class HeldChunks:
    """This rank's tensors at the boundary of ``step``, keyed as its checkpoint saved them."""

    step: int
    config_digest: str
    tensors: Dict[ChunkKey, torch.Tensor]

    def find(self, key: str, offsets, sizes) -> Optional[torch.Tensor]:
        """The held tensor saved as chunk (``offsets``, ``sizes``) of ``key``, or None."""
        held = self.tensors.get((key, tuple(offsets)))
        if held is None or tuple(held.shape) != tuple(sizes):
            return None
        return held

    def usable_for(self, step: int, config_digest: str) -> bool:
        return step == self.step and config_digest == self.config_digest


def hold_chunks(state: TrainState) -> HeldChunks:
    """This rank's model and optimizer chunks, as DCP keys and chunks them when saving
    (the same state dicts, flattened by DCP's own function)."""
    model_sd, optim_sd = model_and_optim(state)
    flat, _ = flatten_state_dict({"model": model_sd, "optim": optim_sd})
    tensors: Dict[ChunkKey, torch.Tensor] = {}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        for chunk in _create_chunk_list(value):
            if tuple(chunk.sizes) == tuple(local.shape):  # one chunk: this rank's shard
                tensors[(key, tuple(chunk.offsets))] = local.detach()
    return HeldChunks(state.progress.step, state.config_digest, tensors)
