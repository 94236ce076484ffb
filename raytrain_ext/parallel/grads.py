"""Gradient helpers shared by the sharded strategies (FSDP, pipeline stages, experts).

Parameters of one model may live on several device meshes (TP-sharded ones on the
(dp, tp) mesh, the rest on the dp mesh, experts on their own groups), and DTensor
cannot combine norms across meshes: so gradients are grouped by mesh first.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def global_grad_norm(groups: List[List[nn.Parameter]]) -> torch.Tensor:
    """The 2-norm over all gradients, as a plain tensor equal on every rank.

    Each mesh's norm is reduced to a full tensor first and the squares are summed.
    """
    norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in group])) for group in groups]
    if not norms:
        return torch.zeros(())
    return torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()


def group_by_mesh(params: List[nn.Parameter]) -> List[List[nn.Parameter]]:
    """``params`` grouped by the device mesh of each (plain tensors form one group)."""
    groups: Dict[object, List[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values())


def _full(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
