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

With ``parallel.sequence_parallel`` (dense, unpipelined models) the residual
stream between sublayers is split along the sequence instead of replicated,
and so is the work of the LayerNorms; the embeddings are split by rows and
``lm_head`` by columns (``sequence_parallel_model_plan``).  Activation memory
outside attention and the MLP drops by ``tp``; each sublayer's all-reduce
becomes an all-gather before and a reduce-scatter after it.

Without it, embeddings, LayerNorms and ``lm_head`` stay replicated (at this
model's size, vocab 256, splitting them alone saves little).  Their gradients are identical on every rank of a TP group
(the colwise inputs' gradients are all-reduced by DTensor), so FSDP reduces
them over the data-parallel mesh only.  Parameter names do not change, so
checkpoints and ``params_sha256`` are comparable with DDP runs.
"""

from __future__ import annotations

from typing import Dict

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from raytrain_ext.models.moe import MoEFeedForward


def block_plan(moe: bool = False) -> Dict[str, object]:
    """Submodule name (relative to a ``Block``) -> its TP style (a MoE feed-forward stays whole)."""
    plan: Dict[str, object] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
    }
    if not moe:
        plan.update({"ffn.up": ColwiseParallel(), "ffn.down": RowwiseParallel()})
    return plan


def sequence_parallel_block_plan() -> Dict[str, object]:
    """Megatron sequence parallelism (torchtitan's plan): the residual stream and the
    LayerNorms hold ``seq / tp`` positions per rank; each sublayer all-gathers its input
    along the sequence and reduce-scatters its output back (``Shard(1)``)."""
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "ln1": SequenceParallel(),
        "attn": gather,
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "ffn": gather,
        "ffn.up": ColwiseParallel(),
        "ffn.down": RowwiseParallel(output_layouts=Shard(1)),
    }


def sequence_parallel_model_plan() -> Dict[str, object]:
    """The ends of the model under sequence parallelism: embeddings split by rows (token
    and position tables) whose outputs are reduce-scattered along the sequence, the final
    norm on sequence shards, and ``lm_head`` gathering the sequence for whole logits."""
    return {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> None:
    """Shard every block of ``model`` over the 1-D ``tp_mesh``, in place."""
    if sequence_parallel:
        parallelize_module(model, tp_mesh, sequence_parallel_model_plan())
    for block in model.blocks:
        plan = (
            sequence_parallel_block_plan()
            if sequence_parallel
            else block_plan(isinstance(block.ffn, MoEFeedForward))
        )
        parallelize_module(block, tp_mesh, plan)
