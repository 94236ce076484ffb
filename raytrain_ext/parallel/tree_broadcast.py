"""One rank's nested state (dicts and lists of tensors and plain values) on every rank.

Both ways a re-formed group takes state from live processes use it: the built-in loop's
handover (``train.live_state``) and a user loop's registered state
(``user_loop.registered``).  The structure travels once as a pickled skeleton in which
each tensor is a placeholder; the tensors follow coalesced into one flat buffer per
dtype, so a state of thousands of tensors costs a handful of broadcasts.

Invariant: every rank of ``group`` calls :func:`broadcast_tree` with the same ``src``;
receivers get new tensors (on ``device``) shaped as the sender's.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value``'s structure of dicts and lists, with ``leaf`` applied to everything else."""
    if isinstance(value, dict):
        return {k: map_leaves(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [map_leaves(v, leaf) for v in value]
    return leaf(value)


@dataclass(frozen=True)
class _Placeholder:
    """Where a broadcast tensor goes back into the state's structure."""

    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _split(value: Any, tensors: List[torch.Tensor], device: torch.device) -> Any:
    """The structure of ``value`` with each tensor on ``device`` replaced by a placeholder
    (collected into ``tensors``); other values (CPU scalars, ints) stay inline."""

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.device == device and v.numel() > 1:
            tensors.append(v)
            return _Placeholder(len(tensors) - 1, tuple(v.shape), v.dtype)
        return v

    return map_leaves(value, leaf)


def _join(value: Any, tensors: List[torch.Tensor]) -> Any:
    return map_leaves(value, lambda v: tensors[v.index] if isinstance(v, _Placeholder) else v)


def _placeholders(skeleton: Any) -> List[_Placeholder]:
    """The skeleton's placeholders, in tensor order."""
    found: List[_Placeholder] = []
    map_leaves(skeleton, lambda v: found.append(v) if isinstance(v, _Placeholder) else None)
    return sorted(found, key=lambda p: p.index)


def _broadcast_tensors(
    placeholders: List[_Placeholder],
    tensors: List[torch.Tensor],
    src: int,
    device: torch.device,
    group: Optional[dist.ProcessGroup],
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
        dist.broadcast(flat, src=src, group=group)
        shaped = [torch.empty(p.shape, dtype=dtype, device="meta") for p in members]
        for p, t in zip(members, _unflatten_dense_tensors(flat, shaped), strict=True):
            out[p.index] = t
    return out


def broadcast_tree(
    value: Any,
    src: int,
    device: torch.device,
    group: Optional[dist.ProcessGroup] = None,
) -> Tuple[Any, int]:
    """``src``'s ``value`` on every rank (``value`` is ignored elsewhere), and the bytes
    of its tensors; ``src`` is a global rank.  Tensors on ``device`` travel coalesced,
    everything else (and tensors elsewhere) in the skeleton."""
    tensors: List[torch.Tensor] = []
    box = [_split(value, tensors, device) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    skeleton = box[0]
    received = _broadcast_tensors(_placeholders(skeleton), tensors, src, device, group)
    sent = tensors if dist.get_rank() == src else received
    return _join(skeleton, sent), sum(t.numel() * t.element_size() for t in sent)


def _swap(
    outgoing: List[torch.Tensor],
    incoming: List[torch.Tensor],
    dst: int,
    src: int,
    group: Optional[dist.ProcessGroup],
) -> None:
    """Send ``outgoing`` to ``dst`` while receiving ``incoming`` from ``src``, in order."""
    ops = [dist.P2POp(dist.isend, t, dst, group) for t in outgoing]
    ops += [dist.P2POp(dist.irecv, t, src, group) for t in incoming]
    if ops:  # neither side has a tensor to move
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def exchange_tree(
    value: Any,
    dst: int,
    src: int,
    device: torch.device,
    group: Optional[dist.ProcessGroup] = None,
    buffers: Optional[Dict[torch.dtype, torch.Tensor]] = None,
) -> Tuple[Any, int]:
    """Send ``value`` to rank ``dst`` and receive rank ``src``'s, and the bytes received:
    every rank of ``group`` calls it at once, the ``dst`` of all ranks a permutation (so
    each receives exactly one value).  The skeleton travels pickled, then the tensors on
    ``device``, received into one flat buffer per dtype.
    ``buffers``: the flat buffers (by dtype) an earlier call received into, written over
    when their size fits (the tensors it returned are views of them) and replaced in the
    dict when not, so a repeated exchange of one layout touches no fresh memory.  Each
    tensor travels as its own message, straight from the caller's memory."""
    tensors: List[torch.Tensor] = []
    skeleton = _split(value, tensors, device)
    blob = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8)
    size = torch.empty(1, dtype=torch.int64)
    _swap([torch.tensor([blob.numel()], dtype=torch.int64)], [size], dst, src, group)
    theirs_blob = torch.empty(int(size.item()), dtype=torch.uint8)
    _swap([blob], [theirs_blob], dst, src, group)
    theirs = pickle.loads(theirs_blob.numpy().tobytes())
    mine, wanted = _placeholders(skeleton), _placeholders(theirs)
    dtypes = sorted({p.dtype for p in mine} | {p.dtype for p in wanted}, key=str)
    kept = {} if buffers is None else buffers
    # each tensor sent as it is (no staging copy: the state may be most of the host's
    # memory), in the order the peer's views of its flat buffers are listed below
    outgoing = [
        tensors[p.index].detach().contiguous() for dtype in dtypes for p in mine if p.dtype == dtype
    ]
    flats: Dict[torch.dtype, torch.Tensor] = {}
    for dtype in dtypes:
        numel = sum(int(torch.Size(p.shape).numel()) for p in wanted if p.dtype == dtype)
        if numel == 0:
            continue
        old = kept.get(dtype)
        fits = old is not None and old.numel() == numel and old.device == device
        flats[dtype] = kept[dtype] = old if fits else torch.empty(numel, dtype=dtype, device=device)
    for unused in [d for d in kept if d not in flats]:
        del kept[unused]
    received: List[Optional[torch.Tensor]] = [None] * len(wanted)
    for dtype, flat in flats.items():
        members = [p for p in wanted if p.dtype == dtype]
        shaped = [torch.empty(p.shape, dtype=dtype, device="meta") for p in members]
        for p, t in zip(members, _unflatten_dense_tensors(flat, shaped), strict=True):
            received[p.index] = t
    incoming = [received[p.index] for dtype in dtypes for p in wanted if p.dtype == dtype]
    _swap(outgoing, [t for t in incoming if t is not None], dst, src, group)
    got = [t for t in received if t is not None]
    return _join(theirs, received), sum(t.numel() * t.element_size() for t in got)
