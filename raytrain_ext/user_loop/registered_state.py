"""The objects a user loop registers (``raytrain_ext.train.register``) and their state.

What a value may be: a module (DDP-wrapped or not: kept by the module's own keys, so a copy
loads at any world size), an optimizer, anything else with ``state_dict`` and
``load_state_dict`` (a scheduler), or a dict of plain values restored in place.  Sharded
state (FSDP's or HSDP's DTensors) is kept as this rank's local shards with its
:class:`Layout`, the part of the whole they are; it loads back into a group of the same
layout, each shard wrapped again like the tensor it replaces, and, when one mesh
dimension shards every tensor along one tensor dimension (FSDP2 and HSDP do), into a
group of any size or layout: the parts are joined into whole tensors and each rank keeps
its own chunk of them (``user_loop.reshard``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Shard

from raytrain_ext.checkpoint.state import snapshot
from raytrain_ext.parallel.local_shards import (
    module_state_like,
    optimizer_params,
    optimizer_state_like,
)
from raytrain_ext.parallel.tree_broadcast import map_leaves


@dataclass(frozen=True)
class Layout:
    """Which part of the whole state a rank holds: part ``index`` of ``shards``, cut for a
    group of ``world`` ranks.  Replicated state (DDP, one rank) is the one part of one,
    which loads at any world size; sharded state (a ``Shard`` placement, even on a mesh
    dimension of size 1) loads as it is only into a group of the same size (the same code
    builds the same mesh there), and into a group of any size when its parts join
    (``join_dim``, ``reshardable``: each rank cuts its own part from them)."""

    world: int
    shards: int = 1
    index: int = 0
    sharded: bool = False
    # the tensor dimension the parts are cut along, when one mesh dimension cuts every
    # sharded tensor (FSDP2, HSDP): the parts join into whole tensors; None: they do not
    join_dim: Optional[int] = None

    def loads_into(self, world: int) -> bool:
        return not self.sharded or self.world == world

    @property
    def reshardable(self) -> bool:
        """Its parts join into the whole state, which loads into any layout."""
        return not self.sharded or self.join_dim is not None

    def same_cut(self, other: "Layout") -> bool:
        """Copies of one report that together make one whole (replicated copies taken at
        different world sizes do)."""
        if (self.sharded, self.shards) != (other.sharded, other.shards):
            return False
        return not self.sharded or self.world == other.world


def unwrapped(obj: Any) -> Any:
    """A DDP-wrapped module's own module: its state has the same keys at any world size
    (``prepare_model`` wraps only when the group has more than one rank)."""
    return obj.module if isinstance(obj, nn.parallel.DistributedDataParallel) else obj


def check_registrable(objects: Dict[str, Any]) -> None:
    """Each value must carry a state (module doc)."""
    if not objects:
        raise ValueError(
            "register() needs the objects to keep, by name: register(model=model, "
            "optimizer=optimizer[, lr_scheduler=..., progress={'epoch': 0}])"
        )
    for name, obj in objects.items():
        if not isinstance(obj, (Stateful, dict)):
            raise TypeError(
                f"register({name}=...): a {type(obj).__name__} has no state_dict() and "
                "load_state_dict(); pass a module, an optimizer, a scheduler or a dict of "
                "plain values (numbers, strings, lists) updated in place"
            )


def state_of(objects: Dict[str, Any]) -> Dict[str, Any]:
    """The objects' states (references into the live objects, DTensors as they are)."""
    return {
        name: dict(obj) if isinstance(obj, dict) else unwrapped(obj).state_dict()
        for name, obj in objects.items()
    }


def layout_of(state: Dict[str, Any], world: int) -> Layout:
    """The part of the whole ``state`` is on this rank: from its DTensors' mesh and
    placements (all must share one), the mesh dimensions that shard giving the parts."""
    found: List[DTensor] = []
    map_leaves(state, lambda v: found.append(v) if isinstance(v, DTensor) else None)
    if not found:
        return Layout(world)
    kinds: Set[Tuple[Any, ...]] = {
        (tuple(t.device_mesh.mesh.flatten().tolist()), t.device_mesh.shape, t.placements)
        for t in found
    }
    if len(kinds) > 1:
        raise ValueError(
            "register(): the state is sharded over more than one mesh or placement (tensor "
            "parallelism with FSDP?); register keeps replicated state or state sharded by "
            "FSDP/HSDP on one mesh. Save the rest with report(checkpoint=...)"
        )
    mesh, placements = found[0].device_mesh, found[0].placements
    dims = [d for d, placement in enumerate(placements) if placement.is_shard()]
    coordinate = mesh.get_coordinate()
    if not dims or coordinate is None:
        return Layout(world)
    sizes = [mesh.size(d) for d in dims]
    index = 0
    for d, size in zip(dims, sizes, strict=True):
        index = index * size + coordinate[d]
    only = placements[dims[0]]
    joins = len(dims) == 1 and type(only) is Shard
    return Layout(world, math.prod(sizes), index, True, only.dim if joins else None)


def sharded_leaves(state: Dict[str, Any]) -> Any:
    """``state``'s structure with each leaf True where it is a DTensor: which leaves of a
    rank's copy are its part of a whole tensor (``user_loop.reshard``)."""
    return map_leaves(state, lambda v: isinstance(v, DTensor))


def install(objects: Dict[str, Any], state: Dict[str, Any]) -> None:
    """Load ``state`` (a copy: each tensor is copied again, so the copy stays this
    process's own) into the freshly built objects, local shards wrapped like the tensors
    they replace; the same names must be registered."""
    if set(state) != set(objects):
        raise ValueError(
            f"register(): this group registered {sorted(objects)}, the state it resumes "
            f"holds {sorted(state)}; register the same objects, by the same names, in "
            "every group of the run"
        )
    for name, obj in objects.items():
        value = snapshot(state[name])
        target = unwrapped(obj)
        if isinstance(obj, dict):
            obj.clear()
            obj.update(value)
        elif isinstance(target, nn.Module):
            with torch.no_grad():
                target.load_state_dict(module_state_like(value, target.state_dict()))
        elif isinstance(obj, torch.optim.Optimizer):
            obj.load_state_dict(optimizer_state_like(value, optimizer_params(obj)))
        else:
            obj.load_state_dict(value)
