"""The reference GPT's ``ModelSpec``: dense or mixture-of-experts, every layout."""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from raytrain_ext.models.gpt import build_model
from raytrain_ext.models.gpt_parallel import GPTStage, sequence_parallel_model_plan, tp_block_plan
from raytrain_ext.models.spec import ModelSpec


def gpt_blocks(module: nn.Module) -> Sequence[nn.Module]:
    """The GPT's (or a stage's) transformer blocks, in order."""
    return list(module.blocks)


GPT_SPEC = ModelSpec(
    name="gpt",
    build=build_model,
    blocks=gpt_blocks,
    tp_block_plan=tp_block_plan,
    tp_model_plan=sequence_parallel_model_plan,
    pipeline_stage=GPTStage,
)
