"""The interface every distribution strategy implements, and where each rank sits.

The trainer loop and the checkpoint code only talk to a ``Strategy``: wrap the
model, accumulate gradients without communication until the last micro-batch,
clip, step, hand back the full (unsharded) parameters for hashing and export, and
give and take FQN-keyed state dicts.  DDP, FSDP, ZeRO, TP, PP and EP plug in behind
the same members; the base class declares all of them, with defaults.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from raytrain_ext.models.spec import ModelSpec
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
    # None given: plain data parallelism, set by __post_init__ (never None once built)
    dims: ParallelDims = None  # type: ignore[assignment]

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


class Strategy(abc.ABC):
    """Every member the training loop and the checkpoint code use, with the DDP/FSDP default.

    A strategy subclasses this and overrides what it does differently; nothing is
    probed with ``getattr``.  The abstract methods are what every layout must say;
    the rest default to "torch's optimizer, torch's autograd, torch's state dicts":

    - ``build_model``: the module to place (FSDP: on the meta device for a pretrained load);
    - ``prepare``: after the optimizer exists (DeepSpeed builds its engine here);
    - ``settle``: before a new wrapper's first step (DDP rebuilds its buckets);
    - ``backward`` / ``step`` / ``zero_grad``: the optimizer step (ZeRO owns it);
    - ``runs_microbatches`` + ``forward_backward``: a strategy that runs a step's
      micro-batches itself (a pipeline schedule) instead of the loop's own loop;
    - ``take_kept_tokens``: MoE tokens kept per expert, when the strategy counted them;
    - ``optimizer_foreach``: whether the multi-tensor optimizer step suits the
      parameters (not when plain tensors sit beside DTensors);
    - ``state_dicts`` / ``load_state_dicts``: FQN-keyed (model, optimizer) state in
      ``get_state_dict``'s format; ``owns_optimizer_state`` when the optimizer's
      state lives outside the torch optimizer (DeepSpeed's partitions);
    - ``native_checkpoint`` + ``native_*``: a strategy's own checkpoint files.
    """

    name: str = ""
    # parameters become DTensors sharded over a mesh that ``wrap`` builds (``self.mesh``);
    # a pipeline stage then shards under it instead of building its own mesh (parallel/pp.py)
    shards_parameters: bool = False
    runs_microbatches: bool = False
    owns_optimizer_state: bool = False

    def __init__(self, parallel_cfg: Any, spec: ModelSpec):
        self.cfg = parallel_cfg  # the ``parallel`` config section
        self.spec = spec  # what this strategy may know about the model
        # a sharding strategy's DeviceMesh, built by ``wrap``: FSDP's (dp_replicate,
        # dp_shard, tp), a pipeline's (pp, dp_replicate, dp_shard, tp)
        self.mesh: Any = None
        # parameters a sharding strategy must not shard or reduce (EP's experts)
        self.ignored: Set[nn.Parameter] = set()

    @property
    def optimizer_foreach(self) -> bool:
        return True

    @property
    def native_checkpoint(self) -> bool:
        return False

    def build_model(self, model_cfg: Any, seed: int) -> nn.Module:
        """The module ``wrap`` places: the spec's build, whole (FSDP builds on the meta device
        when the spec's ``load_pretrained`` fills every value)."""
        return self.spec.build(model_cfg, seed)

    @abc.abstractmethod
    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        """Place and distribute the model; returns what the loop trains."""

    @abc.abstractmethod
    def accumulate(self, wrapped: nn.Module, sync: bool) -> ContextManager:
        """The context of one micro-batch; gradients are reduced only when ``sync``."""

    @abc.abstractmethod
    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """The global gradient norm (before clipping); clips when ``max_norm > 0``."""

    @abc.abstractmethod
    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The user's module inside the wrapper."""

    @abc.abstractmethod
    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]:
        """Whole parameters under their canonical names (a collective: all ranks call it)."""

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Any) -> nn.Module:
        return model

    def settle(self, wrapped: nn.Module, forward: Callable[[], torch.Tensor]) -> None:
        """Before a new wrapper's first step (a group's start and every re-form): bring it
        to the state it keeps for every later step; ``forward`` computes one micro-batch's
        logits.  Nothing by default (DDP: its bucket layout)."""
        return None

    def backward(self, wrapped: nn.Module, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def zero_grad(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def forward_backward(
        self,
        wrapped: nn.Module,
        batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
        loss_scale: float,
        autocast: Callable[[], ContextManager],
        aux_weight: float = 0.0,
    ) -> torch.Tensor:
        """All of a step's micro-batches; the token-loss sum (``runs_microbatches`` only)."""
        raise NotImplementedError(f"strategy {self.name!r} does not run micro-batches itself")

    def take_kept_tokens(self) -> Optional[torch.Tensor]:
        """MoE tokens each expert kept since the last call, when ``forward_backward`` counted
        them; None leaves the counting to the loop."""
        return None

    def state_dicts(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[Any, Any]:
        """(model, optimizer) state dicts, FQN-keyed; tensors are the live ones."""
        return get_state_dict(wrapped, optimizer)

    def load_state_dicts(
        self,
        wrapped: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_sd: Dict[str, Any],
        optim_sd: Dict[str, Any],
        timed: Callable[[str], ContextManager] = lambda _phase: contextlib.nullcontext(),
    ) -> None:
        """Install loaded state; ``timed(phase)`` times the ``model`` and ``optim`` parts."""
        with timed("model"):
            set_model_state_dict(wrapped, model_sd)
        with timed("optim"):
            set_optimizer_state_dict(wrapped, optimizer, optim_sd)

    def native_info(self) -> Dict[str, Any]:
        """What a native checkpoint must match to be loaded (``native_checkpoint`` only)."""
        raise NotImplementedError(f"strategy {self.name!r} has no checkpoint format of its own")

    def native_save(self, wrapped: nn.Module, save_dir: Path, tag: str) -> None:
        raise NotImplementedError(f"strategy {self.name!r} has no checkpoint format of its own")

    def native_load(self, wrapped: nn.Module, load_dir: Path, tag: str) -> None:
        raise NotImplementedError(f"strategy {self.name!r} has no checkpoint format of its own")


def null_context() -> ContextManager:
    return contextlib.nullcontext()
