"""Training state held by live processes and handed to the ranks of a re-formed group.

When a group breaks (a peer died) or pauses (it is about to grow), each surviving
worker keeps its training state in memory as a :class:`LiveState` instead of
dropping it with the process group.  The next group's ranks call
:func:`restore_from_peers` together before any checkpoint is read.  Each live state is
one shard ``(degree, index)`` of the whole: ``(1, 0)`` when the layout replicates the
whole state on every rank (``parallel.dims.replicates_state``: DDP), ``(dp_shard,
shard_index)`` under HSDP (``parallel.dims.shards_from_replicas``), where the ranks of
every replica hold the same shards.  When live ranks hold every shard of the next group's
degree at the same newest step, each shard is broadcast by one of its holders and the
ranks that hold it in the new layout install it: nothing is read from storage and no
step is redone.  Otherwise (another shard degree, a shard nobody holds, or no live
state at all) it returns None and the checkpoint restore runs as before.

Invariants: a ``LiveState`` is at a step boundary (model and optimizer after step
``step``'s update, the sampler, scheduler and ledger of that same boundary; see
``TrainLoop.live_state``); either every rank of the group installs the same state or
none installs anything (the decision is taken from one all-gather, identically).
RNG is not carried: the loop re-seeds every step from (seed, step, rank).
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from raytrain_ext.checkpoint.state import REFERENCE_KEY, TRAIN_KEY, apply_train, train_items
from raytrain_ext.checkpoint.train_state import TrainState
from raytrain_ext.parallel.local_shards import (
    local_view,
    module_state_like,
    optimizer_params,
    optimizer_state_like,
)
from raytrain_ext.parallel.tree_broadcast import broadcast_tree

PEERS = "peers"  # ``restored["tier"]`` of a state taken from live peers


@dataclass
class LiveState:
    """One rank's state at a step boundary; tensors are the live ones (not copies)."""

    step: int
    config_digest: str
    model: Dict[str, torch.Tensor]  # the unwrapped module's state_dict
    optim: Dict[str, Any]  # the optimizer's state_dict (index-keyed)
    train: Dict[str, Any]  # the replicated train items (``checkpoint.state.train_items``)
    reference: Optional[bytes] = None  # DPO's reference log-probs
    shard: Tuple[int, int] = (1, 0)  # (degree, index): which part of the whole state


def capture_live(
    state: TrainState,
    sampler_at_boundary: Optional[Dict[str, Any]],
    shard: Tuple[int, int] = (1, 0),
) -> LiveState:
    """This rank's ``state`` as a live state (references, not copies; a sharded tensor
    as its local shard); the sampler's position is ``sampler_at_boundary`` when given
    (the step under way took its batch).  ``shard``: the part of the whole it holds."""
    items = train_items(state)
    if sampler_at_boundary is not None:
        items["sampler"] = sampler_at_boundary
    return LiveState(
        state.progress.step,
        state.config_digest,
        local_view(state.strategy.unwrap(state.model).state_dict()),
        local_view(state.optimizer.state_dict()),
        items,
        None if state.reference is None else state.reference.to_bytes(),
        shard,
    )


Offer = Tuple[int, Tuple[int, int]]  # (live step or -1, shard) of one rank


def _offers(live: Optional[LiveState], digest: str) -> List[Offer]:
    """Every rank's live step (-1: none, or one from another config) and shard, from one
    all-gather."""
    mine = (live.step, live.shard) if live is not None and live.config_digest == digest else None
    offers: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(offers, mine or (-1, (0, 0)))
    return [(int(step), (int(shard[0]), int(shard[1]))) for step, shard in offers]


def _sources(offers: List[Offer], degree: int) -> Optional[Tuple[int, List[int]]]:
    """(step, the rank broadcasting each shard ``0..degree-1``): the newest step whose
    every shard of ``degree`` some rank holds, each from its lowest such rank; None when
    no step is complete.  Pure, and identical on every rank (it reads the all-gather)."""
    steps = sorted({step for step, shard in offers if step >= 0 and shard[0] == degree})
    for step in reversed(steps):
        holders: Dict[int, int] = {}
        for rank, (held, shard) in enumerate(offers):
            if held == step and shard[0] == degree:
                holders.setdefault(shard[1], rank)
        if len(holders) == degree:
            return step, [holders[index] for index in range(degree)]
    return None


def restore_from_peers(
    state: TrainState,
    live: Optional[LiveState],
    enabled: bool,
    shard: Tuple[int, int] = (1, 0),
) -> Optional[Dict[str, Any]]:
    """Install the newest complete live state the ranks hold (a collective: every rank
    calls it).  ``shard``: the part of the whole this rank holds in the new layout.

    Returns the restore record (``tier`` is ``"peers"``), or None when not ``enabled`` (a
    layout whose state is not handed over, or ``elastic.state_from_peers`` off) or no
    step's shards are all held (by ranks of this run's config).
    """
    if not enabled:  # decided from the config: identical on every rank, no collective needed
        return None
    started = time.perf_counter()
    found = _sources(_offers(live, state.config_digest), shard[0])
    if found is None:
        return None
    step, sources = found
    mine, moved = None, 0
    for index, src in enumerate(sources):  # one shard at a time: its holders keep it
        whole, nbytes = _broadcast_state(live, src, state.ctx.device)
        moved += nbytes
        if index == shard[1]:
            mine = whole
    transferred = time.perf_counter()
    if mine is None:  # sources has one entry per shard of the degree, this rank's among them
        raise RuntimeError(f"no live shard {shard[1]} of {shard[0]} came to this rank")
    _install(state, mine)
    return {
        "step": step,
        "tier": PEERS,
        "source_rank": sources[shard[1]],
        "path": None,
        "saved_world_size": None,
        "bytes": moved,
        "total_s": time.perf_counter() - started,
        "phases": {
            "transfer": transferred - started,
            "install": time.perf_counter() - transferred,
        },
    }


def _broadcast_state(
    live: Optional[LiveState], src: int, device: torch.device
) -> Tuple[Dict[str, Any], int]:
    """``src``'s live state on every rank (its structure, then its tensors coalesced per
    dtype), and the bytes of its tensors."""
    whole: Optional[Dict[str, Any]] = None
    if dist.get_rank() == src:
        assert live is not None
        whole = {"model": live.model, "optim": live.optim, TRAIN_KEY: live.train}
        whole[REFERENCE_KEY] = live.reference
    return broadcast_tree(whole, src, device)


def _install(state: TrainState, whole: Dict[str, Any]) -> None:
    """Load the handed-over state into this rank's freshly built loop (local shards go
    back into DTensors laid out like this rank's parameters)."""
    module = state.strategy.unwrap(state.model)
    with torch.no_grad():
        module.load_state_dict(module_state_like(whole["model"], module.state_dict()))
    params = optimizer_params(state.optimizer)
    state.optimizer.load_state_dict(optimizer_state_like(whole["optim"], params))
    loaded = {TRAIN_KEY: io.BytesIO(json.dumps(whole[TRAIN_KEY]).encode())}
    if state.reference is not None:
        loaded[REFERENCE_KEY] = io.BytesIO(whole[REFERENCE_KEY])
    apply_train(state, loaded)
