"""How the ranks of the checkpoint group learn what every rank saw (save and restore)."""

from __future__ import annotations

from typing import Any, List

import torch.distributed as dist


def gather_from_all(value: Any, group) -> List[Any]:
    """Every rank's ``value``, in rank order, over ``group`` (a collective)."""
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered
