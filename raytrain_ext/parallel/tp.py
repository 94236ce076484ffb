"""Tensor parallelism (and sequence parallelism) applied through a model's ``ModelSpec``.

The spec says how each block is split (``tp_block_plan``) and, under sequence
parallelism, how the ends of the model are (``tp_model_plan``); this module applies
them over the ``tp`` mesh in place.  The reference GPT's plans, with why they are
what they are, live in :mod:`raytrain_ext.models.gpt_parallel`.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import parallelize_module

from raytrain_ext.models.spec import ModelSpec


def apply_tensor_parallel(
    model: nn.Module, spec: ModelSpec, tp_mesh, sequence_parallel: bool = False
) -> None:
    """Shard every block of ``model`` (and, with sequence parallelism, its ends) over the
    1-D ``tp_mesh``, in place."""
    block_plan = spec.require("tp_block_plan", "parallel.tp > 1")
    if sequence_parallel:
        model_plan = spec.require("tp_model_plan", "parallel.sequence_parallel")
        parallelize_module(model, tp_mesh, model_plan())
    for block in spec.blocks(model):
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
