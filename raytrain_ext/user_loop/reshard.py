"""Registered FSDP/HSDP copies into a group of another size or cut, one part at a time.

Why: a group re-formed after a lost node (smaller) or a node back (larger) cuts its
sharded state differently from the copies its live processes hold.  When the copies are
the chunks of one tensor dimension cut by one mesh dimension (``Layout.reshardable``:
FSDP2 and HSDP), each part is a known range of rows of every sharded tensor, and each
rank of the new group needs a known range too: it keeps the overlap of every part it
receives with its own range and drops the rest: beyond the copies it holds itself, a
rank holds its own new part and the one part in flight, never the whole state.

Invariants: parts are ``torch.chunk``'s pieces of the whole along ``Layout.join_dim``
(empty ones past the end), as a ``Shard`` placement and FSDP2 cut them; a target DTensor
is cut the same way by at most one mesh dimension, along the same tensor dimension (a
replicated target takes every row).  Leaves that were not sharded are equal on every part
and come from the first.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from raytrain_ext.parallel.local_shards import optimizer_params
from raytrain_ext.user_loop.registered_state import Layout, unwrapped


def _rows(total: int, parts: int, index: int) -> Tuple[int, int]:
    """The [start, end) rows of chunk ``index`` when ``torch.chunk`` cuts ``total`` rows
    into ``parts``."""
    size = math.ceil(total / parts) if total else 0
    start = min(total, index * size)
    return start, min(total, start + size)


def _target_rows(like: DTensor, dim: int) -> Tuple[int, int]:
    """The rows along ``dim`` of the whole that ``like``'s local chunk holds."""
    total = like.shape[dim]
    cuts = [(d, p) for d, p in enumerate(like.placements) if not p.is_replicate()]
    if not cuts:
        return 0, total
    (mesh_dim, placement), *more = cuts
    if more or type(placement) is not Shard or placement.dim != dim:
        raise ValueError(
            f"register(): the copies were cut along dimension {dim} by one mesh dimension, "
            f"this group cuts a tensor as {like.placements}; a group of another size "
            "resumes FSDP/HSDP copies only into FSDP/HSDP (one sharding mesh dimension)"
        )
    coordinate = like.device_mesh.get_coordinate()
    assert coordinate is not None  # every rank of the group is in its mesh
    return _rows(total, like.device_mesh.size(mesh_dim), coordinate[mesh_dim])


def targets_of(objects: Dict[str, Any], state: Dict[str, Any]) -> Dict[str, Any]:
    """For each object's state in ``state``'s structure, the tensor of the freshly built
    ``objects`` each leaf goes into (a module's by key, an optimizer moment its
    parameter's), None where there is none."""
    targets: Dict[str, Any] = {}
    for name, obj in objects.items():
        value, target = state[name], unwrapped(obj)
        if isinstance(target, nn.Module):
            mine = target.state_dict()
            targets[name] = {k: mine.get(k) for k in value}
        elif isinstance(obj, torch.optim.Optimizer):
            params = optimizer_params(obj)
            entries = {i: {k: params[int(i)] for k in e} for i, e in value["state"].items()}
            targets[name] = {"state": entries}
        else:
            targets[name] = {}
    return targets


class PartJoiner:
    """This rank's new part of the whole, filled from the copies' parts as they arrive
    (module doc); ``local()`` is then ready for ``registered_state.install``."""

    def __init__(self, cut: Layout, objects: Dict[str, Any]):
        if cut.join_dim is None:
            raise ValueError("register(): these copies are not cut in parts that join")
        self.cut, self.objects, self.dim = cut, objects, cut.join_dim
        self._local: Optional[Dict[str, Any]] = None
        self._targets: Dict[str, Any] = {}
        self._sharded: Any = None
        self._added = 0  # parts 0 .. _added - 1 are in: each one's rows fill their range

    def add(self, index: int, state: Dict[str, Any], sharded: Any) -> None:
        """Part ``index`` of the copies (its state and which leaves are sharded), in part
        order: once all are in, every row of this rank's range was filled."""
        if index != self._added:
            raise ValueError(f"register(): part {index} of the copies came after {self._added}")
        if self._local is None:
            self._targets, self._sharded = targets_of(self.objects, state), sharded
            self._local = state  # its unsharded leaves are everyone's; sharded ones replaced
        elif sharded != self._sharded:
            raise ValueError(
                f"register(): part {index} of the copies holds other tensors than part 0; "
                "every rank must register the same objects, built the same way"
            )
        self._local = self._fill(self._local, state, sharded, self._targets, index)
        self._added += 1

    def _fill(self, local: Any, part: Any, sharded: Any, target: Any, index: int) -> Any:
        if isinstance(sharded, dict):
            targets = target if isinstance(target, dict) else {}
            return {
                k: self._fill(local[k], part[k], v, targets.get(k), index)
                for k, v in sharded.items()
            }
        if isinstance(sharded, list):
            return [self._fill(local[i], part[i], v, None, index) for i, v in enumerate(sharded)]
        if not sharded:
            return local
        if not isinstance(target, torch.Tensor):
            raise ValueError(
                "register(): a sharded tensor has no counterpart in this group's objects; "
                "register the same objects, built the same way, in every group of the run"
            )
        return self._rows_into(local, part, target, index)

    def _rows_into(
        self, local: torch.Tensor, part: torch.Tensor, target: torch.Tensor, index: int
    ) -> torch.Tensor:
        """``local`` (this rank's new chunk; on the first part, that part itself, which is
        replaced) with the rows of ``part`` that fall in it copied in.  ``target``: the
        tensor it goes into, a DTensor (its chunk's rows) or a whole tensor (every row)."""
        dim, total = self.dim, target.shape[self.dim]
        begin, end = _target_rows(target, dim) if isinstance(target, DTensor) else (0, total)
        if index == 0:
            shape = list(part.shape)
            shape[dim] = end - begin
            local = torch.empty(shape, dtype=part.dtype)
        p_begin, p_end = _rows(total, self.cut.shards, index)
        lo, hi = max(begin, p_begin), min(end, p_end)
        if hi > lo:
            local.narrow(dim, lo - begin, hi - lo).copy_(part.narrow(dim, lo - p_begin, hi - lo))
        return local

    def local(self) -> Dict[str, Any]:
        if self._local is None or self._added != self.cut.shards:
            raise ValueError(
                f"register(): {self._added} of the copies' {self.cut.shards} parts came in"
            )
        return self._local
