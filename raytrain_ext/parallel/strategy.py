"""The small interface every distribution strategy implements.

The trainer loop only talks to a ``Strategy``: wrap the model, accumulate
gradients without communication until the last micro-batch, clip, and hand
back the full (unsharded) parameters for hashing and export.  FSDP, ZeRO, TP
and PP plug in behind the same methods.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, Optional, Protocol

import torch
import torch.nn as nn

from raytrain_ext.parallel.dims import ParallelDims


@dataclass(frozen=True)
class DistContext:
    """What a strategy needs to know about this process's place in the group.

    ``dims`` defaults to plain data parallelism (``dp_rank == rank``,
    ``dp_size == world_size``), which is what DDP runs on.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: full fp32
    dims: Optional[ParallelDims] = None

    def __post_init__(self) -> None:
        if self.dims is None:
            object.__setattr__(self, "dims", ParallelDims.data_parallel(self.world_size))
        if self.dims.world_size != self.world_size:
            raise ValueError(
                f"ParallelDims {self.dims} describe {self.dims.world_size} ranks, "
                f"but the world size is {self.world_size}"
            )

    @property
    def dp_rank(self) -> int:
        """Which share of the global batch this rank computes (shared by its TP group)."""
        return self.dims.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def counts_samples(self) -> bool:
        """True on exactly one rank per data-parallel group (tp rank 0 of the first pipeline
        stage): it reports the group's samples, so the ledger counts every sample once."""
        return self.dims.tp_rank(self.rank) == 0 and self.dims.is_first_stage(self.rank)

    @property
    def counts_loss(self) -> bool:
        """True on exactly one rank per data-parallel group (tp rank 0 of the last pipeline
        stage, the only one that computes the loss): it reports the group's loss sum."""
        return self.dims.tp_rank(self.rank) == 0 and self.dims.is_last_stage(self.rank)


class Strategy(Protocol):
    name: str

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module: ...

    def accumulate(self, wrapped: nn.Module, sync: bool) -> ContextManager: ...

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor: ...

    def unwrap(self, wrapped: nn.Module) -> nn.Module: ...

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]: ...


def null_context() -> ContextManager:
    return contextlib.nullcontext()


def _prepare(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Any) -> nn.Module:
    return model


def _backward(wrapped: nn.Module, loss: torch.Tensor) -> None:
    loss.backward()


def _step(wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _zero_grad(wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)


# Optional Strategy methods and the default (DDP/FSDP) behaviour of each.  A strategy
# that owns the optimizer step (DeepSpeed ZeRO) overrides them; ``state_dicts`` /
# ``load_state_dicts`` replace ``get_state_dict`` / ``set_state_dict`` in checkpoints.
# ``forward_backward(wrapped, batches, loss_scale, autocast) -> token-loss sum`` replaces
# the loop's own micro-batch loop (a pipeline schedule runs all micro-batches at once).
OPTIONAL_HOOKS = {
    "prepare": _prepare,
    "backward": _backward,
    "step": _step,
    "zero_grad": _zero_grad,
}


def hook(strategy: Any, name: str):
    """``strategy.<name>`` when the strategy defines it, else the default behaviour."""
    return getattr(strategy, name, None) or OPTIONAL_HOOKS[name]
