"""Tensor parallelism of the reference GPT: Megatron-style column/row splits per block.

In each block the q/k/v projections and the MLP up-projection are split by
output features (``ColwiseParallel``: every rank computes ``n_heads / tp``
whole heads and ``hidden / tp`` MLP units), the attention output and MLP
down-projection by input features (``RowwiseParallel``, whose output is
all-reduced).  So each block costs two all-reduces forward and two backward,
and the activations between blocks stay replicated plain tensors.

A mixture-of-experts feed-forward stays whole on every rank of the TP group
(attention is still split): its input, the residual stream, is replicated, so
routing, capacity and expert outputs are the same on every TP rank, and so are
the router and expert gradients (the residual stream's gradient is replicated
too); FSDP reduces them over the data-parallel mesh like the LayerNorms'.

Embeddings, LayerNorms and ``lm_head`` stay replicated: at this model's size
(vocab 256) splitting them saves little and would need sequence parallelism
for the norms.  Their gradients are identical on every rank of a TP group
(the colwise inputs' gradients are all-reduced by DTensor), so FSDP reduces
them over the data-parallel mesh only.  Parameter names do not change, so
checkpoints and ``params_sha256`` are comparable with DDP runs.
"""

from __future__ import annotations

from typing import Dict

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from raytrain_ext.models.moe import MoEFeedForward


def block_plan(moe: bool = False) -> Dict[str, object]:
    """Submodule name (relative to a ``Block``) -> its TP style (a MoE feed-forward stays whole)."""
    plan: Dict[str, object] = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                               "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel()}
    if not moe:
        plan.update({"ffn.up": ColwiseParallel(), "ffn.down": RowwiseParallel()})
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Shard every block of ``model`` over the 1-D ``tp_mesh``, in place."""
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan(isinstance(block.ffn, MoEFeedForward)))
