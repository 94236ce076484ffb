"""How the parallel layouts cut the reference GPT: its tensor-parallel plans and its
pipeline stages (the GPT members of its ``ModelSpec``, :mod:`raytrain_ext.models.gpt_spec`).

Tensor parallelism: Megatron-style column/row splits per block.  In each block the q/k/v
projections and the MLP up-projection are split by output features (``ColwiseParallel``:
every rank computes ``n_heads / tp`` whole heads and ``hidden / tp`` MLP units), the
attention output and MLP down-projection by input features (``RowwiseParallel``, whose
output is all-reduced).  So each block costs two all-reduces forward and two backward,
and the activations between blocks stay replicated plain tensors.

A mixture-of-experts feed-forward stays whole on every rank of the TP group (attention
is still split): its input, the residual stream, is replicated, so routing, capacity and
expert outputs are the same on every TP rank, and so are the router and expert gradients;
FSDP reduces them over the data-parallel mesh like the LayerNorms'.

With ``parallel.sequence_parallel`` (dense, unpipelined models) the residual stream
between sublayers is split along the sequence instead of replicated, and so is the work
of the LayerNorms; the embeddings are split by rows and ``lm_head`` by columns
(``sequence_parallel_model_plan``).  Without it, embeddings, LayerNorms and ``lm_head``
stay replicated.  Parameter names do not change, so checkpoints and ``params_sha256``
are comparable with DDP runs.

Pipeline stages: stage ``s`` of ``pp`` holds a contiguous run of blocks (``stage_layers``);
stage 0 also holds the embeddings, the last stage the final norm and ``lm_head``, all
under their original names.  A MoE block's balance loss enters the backward where it
arises: the schedule backpropagates only from a stage's output, so the stage ties each
MoE layer's weighted loss to its activations (``AttachAuxLoss``).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from raytrain_ext.models.moe import MoEFeedForward
from raytrain_ext.models.spec import PipelineStageModule, StageBlocks, stage_layers


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


def tp_block_plan(block: nn.Module, sequence_parallel: bool) -> Dict[str, object]:
    """The plan of one ``Block``: sequence parallel, or Megatron's with a MoE kept whole."""
    if sequence_parallel:
        return sequence_parallel_block_plan()
    return block_plan(isinstance(block.ffn, MoEFeedForward))


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also seeds ``weighted_aux`` with gradient 1, as if
    it had been added to the loss (Megatron's MoE aux-loss scaler does the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weighted_aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_like = (weighted_aux.shape, weighted_aux.dtype, weighted_aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


class GPTStage(PipelineStageModule):
    """One pipeline stage of a ``GPT``; its modules are the GPT's own (shared, not copied)."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int):
        super().__init__()
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        layers = stage_layers(len(model.blocks), num_stages)[stage]
        self.blocks = StageBlocks({i: model.blocks[i] for i in layers})
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.kept_tokens: Optional[torch.Tensor] = None  # MoE: per expert, since the last take

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids -> activations on the first stage, activations -> logits on the last."""
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
            if isinstance(block.ffn, MoEFeedForward):
                x = self._moe_bookkeeping(x, block.ffn)
        return self.lm_head(self.ln_f(x)) if self.is_last else x

    def _moe_bookkeeping(self, x: torch.Tensor, moe: MoEFeedForward) -> torch.Tensor:
        """Count the layer's kept tokens and tie its weighted balance loss to ``x``, in
        training forwards only (``TrainingForwardStage``)."""
        if not self.training_forward:
            return x
        load = moe.expert_load
        self.kept_tokens = load if self.kept_tokens is None else self.kept_tokens + load
        if self.aux_weight:
            x = AttachAuxLoss.apply(x, moe.aux_loss * self.aux_weight)
        return x

    def take_kept_tokens(self) -> Optional[torch.Tensor]:
        tokens, self.kept_tokens = self.kept_tokens, None
        return tokens
