"""DistributedDataParallel: replicated parameters, gradients all-reduced once per step."""

from __future__ import annotations

from typing import Callable, ContextManager, Dict

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from raytrain_ext.parallel.strategy import DistContext, Strategy, null_context


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        model = model.to(ctx.device)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def settle(self, wrapped: nn.Module, forward: Callable[[], torch.Tensor]) -> None:
        """Run one zero-weighted backward, so that the wrapper's one-time bucket rebuild
        happens before the first step instead of after it.

        Why: a fresh DDP wrapper buckets its first backward's gradients in parameter order,
        then rebuilds its buckets in the order that backward produced them, for every later
        step.  With three or more ranks the all-reduce's sum of a gradient depends on
        where its bucket puts it (gloo's and NCCL's rings start each chunk's sum at another
        rank), so a group re-formed mid-run, whose new wrappers reduced their first step in
        the initial layout, ended with other parameters than the uninterrupted run.
        Settled, every step of every wrapper reduces in the rebuilt layout.  The gradients
        are zero and dropped; nothing else changes (the step reseeds its generators).
        Costs one micro-batch's forward and backward per group start or re-form."""
        (forward().float().sum() * 0.0).backward()
        for param in wrapped.parameters():
            param.grad = None

    def accumulate(self, wrapped: nn.Module, sync: bool) -> ContextManager:
        """Skip the all-reduce for every micro-batch but the last of a step.

        Each rank does exactly one synchronised backward per step, so ranks whose
        share of an uneven global batch has fewer micro-batches stay in step.
        """
        return null_context() if sync else wrapped.no_sync()

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        params = wrapped.parameters()
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped.module

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in wrapped.module.named_parameters()}
