"""FSDP2 (``fully_shard``), optionally hybrid (HSDP) and composed with tensor parallelism.

Parameters, gradients and optimizer state are sharded over the data-parallel
mesh; each block's parameters are all-gathered just before its forward and
backward and freed after.  With ``parallel.dp_replicate > 1`` the
data-parallel mesh is 2-D (HSDP): shards within a ``dp_shard`` group,
replicas across ``dp_replicate`` groups (e.g. nodes), gradients
reduce-scattered within and all-reduced across.

Apply order (torchtitan's): tensor parallel -> activation checkpointing ->
compile -> ``fully_shard`` per block, then the root.  None of these rename
parameters (composable checkpointing, ``Module.compile``), so checkpoints and
``full_parameters`` use the same names as DDP.

A model whose spec loads every value after placement (pretrained weights,
``ModelSpec.loads_every_value``) is built on the meta device (``build_model``) and
given storage only after sharding (``to_empty``), so no rank holds a full copy;
the spec's ``load_pretrained`` then fills it.  Any other model is built whole on
the CPU, so a random initialisation has DDP's values.

FSDP averages gradients over the data-parallel size (``dp_replicate x
dp_shard``), not the world: the ranks of a TP group compute one replica's
gradient together.  The loop therefore scales each rank's loss by ``dp_size``.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Dict

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from raytrain_ext.parallel.grads import global_grad_norm, group_by_mesh
from raytrain_ext.parallel.strategy import DistContext, Strategy
from raytrain_ext.parallel.tp import apply_tensor_parallel


class FSDPStrategy(Strategy):
    name = "fsdp"
    shards_parameters = True

    @property
    def optimizer_foreach(self) -> bool:
        """The per-tensor step over DTensor parameters (FSDP, HSDP, TP): DTensor plans a
        multi-tensor op's sharding per list element through fake tensors, and reuses a plan
        only for the same mesh and local shapes.  The first update of every new group (a
        start, each re-form) paid 1.2-2.2 s for it on the tiny GPT here (the 14 ops of
        AdamW's multi-tensor step; the per-tensor step plans each op once per shape, in
        milliseconds), and torch 2.12+ keeps growing the fake-tensor cache it plans
        through (NeMo Automodel turned the multi-tensor step off for FSDP2 on that).  The
        two steps compute the same update (not always to the last bit)."""
        return False

    def build_model(self, model_cfg, seed: int) -> nn.Module:
        """The spec's module: on the meta device when the spec fills every value after
        placement (module doc), else built whole."""
        loads = self.spec.loads_every_value
        if loads is not None and loads(model_cfg):
            with torch.device("meta"):
                return self.spec.build(model_cfg, seed)
        return self.spec.build(model_cfg, seed)

    def wrap(self, model: nn.Module, ctx: DistContext) -> nn.Module:
        on_meta = any(p.is_meta for p in model.parameters())
        if not on_meta:
            model = model.to(ctx.device)
        dims = ctx.dims
        self.mesh = dims.build_mesh(ctx.device.type)
        if dims.tp > 1:
            apply_tensor_parallel(model, self.spec, self.mesh["tp"], self.cfg.sequence_parallel)
        blocks = self.spec.blocks(model)
        for block in blocks:
            if self.cfg.activation_checkpointing:
                checkpoint_activations(block)
            if self.cfg.compile:
                block.compile()
        dp_mesh = (
            self.mesh["dp_shard"]
            if dims.dp_replicate == 1
            else self.mesh["dp_replicate", "dp_shard"]
        )
        options = {"mesh": dp_mesh, "mp_policy": self._mixed_precision(ctx)}
        if self.cfg.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        ignored = self.ignored
        for block in blocks:
            fully_shard(block, **options, ignored_params=ignored & set(block.parameters()) or None)
        fully_shard(model, **options, ignored_params=ignored or None)
        if on_meta:  # storage for this rank's shards only; load_pretrained fills it
            model.to_empty(device=ctx.device)
        return model

    @staticmethod
    def _mixed_precision(ctx: DistContext) -> MixedPrecisionPolicy:
        """bf16 compute and all-gathers, fp32 gradient reduction and master weights."""
        if ctx.autocast_dtype == torch.bfloat16:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def accumulate(self, wrapped: nn.Module, sync: bool) -> ContextManager:
        """Reduce gradients only in the last micro-batch's backward.

        Forwards still all-gather parameters, so every rank must run the same
        number of micro-batches (``check_batch_split`` enforces it).
        """
        wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global norm; per mesh, since DTensor ops cannot mix meshes."""
        groups = group_by_mesh([p for p in wrapped.parameters() if p.grad is not None])
        total = global_grad_norm(groups)
        if max_norm > 0:
            for params in groups:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped  # fully_shard works in place

    def full_parameters(self, wrapped: nn.Module) -> Dict[str, torch.Tensor]:
        """Unsharded fp32 parameters in canonical names (a collective: all ranks call it)."""
        with torch.no_grad():
            return {
                name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
                for name, p in wrapped.named_parameters()
            }
