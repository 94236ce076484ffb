"""Expert-parallel strategies: DDP or FSDP for the dense parameters, MoE experts sharded
over groups of ``parallel.ep`` data-parallel ranks (the groups, the all-to-all dispatch and
the gradient invariant are in :mod:`raytrain_ext.parallel.ep_shards`).

The sharded-expert behaviour is one component (``ExpertShards``) that each strategy holds
and calls from its ``wrap``, ``accumulate``, ``clip_grad_norm`` and ``state_dicts``.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Dict, Iterator

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel

from raytrain_ext.parallel.ddp import DDPStrategy
from raytrain_ext.parallel.ep_shards import ExpertShards
from raytrain_ext.parallel.fsdp import FSDPStrategy
from raytrain_ext.parallel.grads import global_grad_norm, group_by_mesh
from raytrain_ext.parallel.strategy import DistContext


@contextlib.contextmanager
def _then_average_experts(
    accumulate: ContextManager, experts: ExpertShards, sync: bool
) -> Iterator[None]:
    """The wrapper's accumulation for the dense gradients; after the synchronising backward,
    the experts' gradients are averaged over their EDP group."""
    with accumulate:
        yield
    if sync:
        experts.average_gradients()


class ExpertParallelStrategy(DDPStrategy):
    """DDP for the dense parameters; experts sharded over ``parallel.ep`` ranks."""

    name = "ddp"

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        self.experts = ExpertShards(model, ctx)
        model = model.to(ctx.device)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, self.experts.names
        )
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def accumulate(self, wrapped: nn.Module, sync: bool) -> ContextManager:
        return _then_average_experts(super().accumulate(wrapped, sync), self.experts, sync)

    def state_dicts(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer):
        """Each expert once, on its owner (``ExpertShards.state_dicts``)."""
        return self.experts.state_dicts(*get_state_dict(wrapped, optimizer))

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient: dense grads are replicated, expert
        grads are sharded over the EP group, so their squares are summed over it."""
        params = [p for p in wrapped.module.parameters() if p.grad is not None]
        dense = [p.grad for p in params if id(p) not in self.experts.ids]
        dense_sq = torch.nn.utils.get_total_norm(dense).double() ** 2
        total = torch.sqrt(dense_sq + self.experts.grad_norm_squared()).float()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]:
        """Every parameter under its global name: the EP group's experts gathered."""
        params = {name: p.detach() for name, p in wrapped.module.named_parameters()}
        return self.experts.gather(params)


class FSDPExpertParallelStrategy(FSDPStrategy):
    """FSDP (optionally with TP) for the dense parameters; experts sharded over ``parallel.ep``
    ranks and left out of FSDP, which would shard them a second time."""

    name = "fsdp"

    @property
    def optimizer_foreach(self) -> bool:
        """Plain expert tensors beside FSDP's DTensors need the per-tensor step (train/optim.py)."""
        return False

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        self.experts = ExpertShards(model, ctx)
        self.ignored = set(self.experts.params)
        return super().wrap(model, ctx)

    def accumulate(self, wrapped: nn.Module, sync: bool) -> ContextManager:
        return _then_average_experts(super().accumulate(wrapped, sync), self.experts, sync)

    def state_dicts(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer):
        """Each expert once, on its owner (``ExpertShards.state_dicts``)."""
        return self.experts.state_dicts(*get_state_dict(wrapped, optimizer))

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """FSDP's per-mesh norms of the dense gradients plus the experts' (see ``ExpertShards``)."""
        dense = [
            p for p in wrapped.parameters() if p.grad is not None and id(p) not in self.experts.ids
        ]
        groups = group_by_mesh(dense)
        dense_sq = global_grad_norm(groups).double() ** 2
        total = torch.sqrt(dense_sq + self.experts.grad_norm_squared()).float()
        if max_norm > 0:
            for params in groups + [self.experts.params]:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]:
        return self.experts.gather(super().full_parameters(wrapped))
