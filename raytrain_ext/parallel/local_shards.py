"""A state's sharded tensors as their local shards, and back into DTensors.

Live state passes between processes as plain tensors (``parallel.tree_broadcast``): a
DTensor leaves as its local shard and comes back, in the receiving rank's freshly built
model or optimizer, as a DTensor laid out like the tensor it replaces.  Used by the
built-in loop's handover (``train.live_state``) and a user loop's registered state
(``user_loop.registered``).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch.distributed.tensor import DTensor

from raytrain_ext.parallel.tree_broadcast import map_leaves


def local_view(value: Any) -> Any:
    """``value`` with each DTensor replaced by its local shard (a view, not a copy)."""
    return map_leaves(value, lambda v: v.to_local() if isinstance(v, DTensor) else v)


def as_like(value: Any, like: Any) -> Any:
    """A local shard as a DTensor with ``like``'s mesh, placements and global shape, when
    ``like`` is a DTensor and ``value`` has its local shape; else ``value`` as it is."""
    if not (isinstance(like, DTensor) and isinstance(value, torch.Tensor)):
        return value
    if tuple(value.shape) != tuple(like.to_local().shape):
        return value
    return DTensor.from_local(
        value,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def module_state_like(values: Dict[str, Any], targets: Dict[str, Any]) -> Dict[str, Any]:
    """A module's ``values`` with each local shard wrapped as a DTensor like its target."""
    return {key: as_like(value, targets.get(key)) for key, value in values.items()}


def optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The optimizer's parameters in its groups' order: what its state dict's integer
    keys index."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_like(optim: Dict[str, Any], params: List[torch.Tensor]) -> Dict[str, Any]:
    """An optimizer's index-keyed state dict with each local shard wrapped like the
    parameter it belongs to (``params``: the optimizer's, in its groups' order)."""
    state = {
        index: {key: as_like(value, params[int(index)]) for key, value in entry.items()}
        for index, entry in optim["state"].items()
    }
    return {**optim, "state": state}
