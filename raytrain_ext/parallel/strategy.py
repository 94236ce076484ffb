"""The small interface every distribution strategy implements.

The trainer loop only talks to a ``Strategy``: wrap the model, accumulate
gradients without communication until the last micro-batch, clip, and hand
back the full (unsharded) parameters for hashing and export.  FSDP, ZeRO, TP
and PP plug in behind the same methods.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Dict, Protocol

import torch
import torch.nn as nn


@dataclass(frozen=True)
class DistContext:
    """What a strategy needs to know about this process's place in the group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: full fp32


class Strategy(Protocol):
    name: str

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module: ...

    def accumulate(self, wrapped: nn.Module, sync: bool) -> ContextManager: ...

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor: ...

    def unwrap(self, wrapped: nn.Module) -> nn.Module: ...

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]: ...


def build_strategy(name: str) -> Strategy:
    from raytrain_ext.parallel.ddp import DDPStrategy

    strategies = {"ddp": DDPStrategy}
    if name not in strategies:
        raise ValueError(f"parallel.strategy: unknown strategy {name!r}; choose one of "
                         f"{', '.join(strategies)}")
    return strategies[name]()


def null_context() -> ContextManager:
    return contextlib.nullcontext()
