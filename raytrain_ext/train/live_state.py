"""Training state held by live processes and handed to the ranks of a re-formed group.

When a group breaks (a peer died) or pauses (it is about to grow), each surviving
worker keeps its training state in memory as a :class:`LiveState` instead of
dropping it with the process group.  The next group's ranks call
:func:`restore_from_peers` together before any checkpoint is read: when the layout
replicates the whole state on every rank (``parallel.dims.replicates_state``: DDP), the rank
holding the newest live state broadcasts it and every rank installs it, so nothing is
read from storage and no step is redone.  Otherwise (sharded layouts, or no rank
holds state) it returns None and the checkpoint restore runs as before.

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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from raytrain_ext.checkpoint.state import REFERENCE_KEY, TRAIN_KEY, apply_train, train_items
from raytrain_ext.checkpoint.train_state import TrainState

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


def capture_live(state: TrainState, sampler_at_boundary: Optional[Dict[str, Any]]) -> LiveState:
    """This rank's ``state`` as a live state (references, not copies); the sampler's
    position is ``sampler_at_boundary`` when given (the step under way took its batch)."""
    items = train_items(state)
    if sampler_at_boundary is not None:
        items["sampler"] = sampler_at_boundary
    return LiveState(
        state.progress.step,
        state.config_digest,
        state.strategy.unwrap(state.model).state_dict(),
        state.optimizer.state_dict(),
        items,
        None if state.reference is None else state.reference.to_bytes(),
    )


@dataclass(frozen=True)
class _Placeholder:
    """Where a broadcast tensor goes back into the state's structure."""

    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _split(value: Any, tensors: List[torch.Tensor], device: torch.device) -> Any:
    """The structure of ``value`` with each tensor on ``device`` replaced by a placeholder
    (collected into ``tensors``); other values (CPU scalars, ints) stay inline."""
    if isinstance(value, torch.Tensor) and value.device == device and value.numel() > 1:
        tensors.append(value)
        return _Placeholder(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _split(v, tensors, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_split(v, tensors, device) for v in value]
    return value


def _join(value: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(value, _Placeholder):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    return value


def _broadcast_tensors(
    placeholders: List[_Placeholder], tensors: List[torch.Tensor], src: int, device: torch.device
) -> List[torch.Tensor]:
    """Broadcast the tensors from ``src``, coalesced into one flat buffer per dtype;
    receivers get new tensors of the placeholders' shapes."""
    out: List[Optional[torch.Tensor]] = [None] * len(placeholders)
    dtypes = sorted({p.dtype for p in placeholders}, key=str)
    for dtype in dtypes:
        members = [p for p in placeholders if p.dtype == dtype]
        if dist.get_rank() == src:
            flat = _flatten_dense_tensors([tensors[p.index].detach() for p in members])
        else:
            numel = sum(int(torch.Size(p.shape).numel()) for p in members)
            flat = torch.empty(numel, dtype=dtype, device=device)
        dist.broadcast(flat, src=src)
        shaped = [torch.empty(p.shape, dtype=dtype, device="meta") for p in members]
        for p, t in zip(members, _unflatten_dense_tensors(flat, shaped)):
            out[p.index] = t
    return out  # type: ignore[return-value]


def _offers(live: Optional[LiveState], digest: str) -> List[int]:
    """Every rank's live step (-1: none, or one from another config), from one all-gather."""
    mine = live.step if live is not None and live.config_digest == digest else -1
    offers: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(offers, mine)
    return [int(o) for o in offers]


def restore_from_peers(
    state: TrainState, live: Optional[LiveState], enabled: bool
) -> Optional[Dict[str, Any]]:
    """Install the newest live state held by any rank (a collective: every rank calls it).

    Returns the restore record (``tier`` is ``"peers"``), or None when not ``enabled`` (a
    sharded layout, or ``elastic.state_from_peers`` off) or no rank holds a live state
    of this run's config.
    """
    if not enabled:  # decided from the config: identical on every rank, no collective needed
        return None
    started = time.perf_counter()
    offers = _offers(live, state.config_digest)
    best = max(offers)
    if best < 0:
        return None
    src = offers.index(best)
    rank, device = dist.get_rank(), state.ctx.device
    tensors: List[torch.Tensor] = []
    skeleton = None
    if rank == src:
        assert live is not None
        skeleton = _split(
            {"model": live.model, "optim": live.optim, TRAIN_KEY: live.train}, tensors, device
        )
        skeleton[REFERENCE_KEY] = live.reference
    box = [skeleton]
    dist.broadcast_object_list(box, src=src)
    skeleton = box[0]
    placeholders: List[_Placeholder] = []
    _collect(skeleton, placeholders)
    placeholders.sort(key=lambda p: p.index)
    received = _broadcast_tensors(placeholders, tensors, src, device)
    transferred = time.perf_counter()
    sent = tensors if rank == src else received
    _install(state, _join(skeleton, sent))
    return {
        "step": best,
        "tier": PEERS,
        "source_rank": src,
        "path": None,
        "saved_world_size": None,
        "bytes": sum(t.numel() * t.element_size() for t in sent),
        "total_s": time.perf_counter() - started,
        "phases": {
            "transfer": transferred - started,
            "install": time.perf_counter() - transferred,
        },
    }


def _collect(value: Any, into: List[_Placeholder]) -> None:
    if isinstance(value, _Placeholder):
        into.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, into)
    elif isinstance(value, list):
        for v in value:
            _collect(v, into)


def _install(state: TrainState, whole: Dict[str, Any]) -> None:
    """Load the handed-over state into this rank's freshly built loop."""
    module = state.strategy.unwrap(state.model)
    with torch.no_grad():
        module.load_state_dict(whole["model"])
    state.optimizer.load_state_dict(whole["optim"])
    loaded = {TRAIN_KEY: io.BytesIO(json.dumps(whole[TRAIN_KEY]).encode())}
    if state.reference is not None:
        loaded[REFERENCE_KEY] = io.BytesIO(whole[REFERENCE_KEY])
    apply_train(state, loaded)
