"""Pretrained weights into a placed (and possibly sharded) Hugging Face causal LM.

The strategy places the model first; then every rank calls :func:`load_pretrained` (a
collective), and DCP's ``HuggingFaceStorageReader`` reads, for each rank, only the tensors (or,
for sharded parameters, the slices) that rank holds.  So a sharding strategy may build the module
on the meta device and give it storage only after sharding (``to_empty``): no rank ever holds a
full copy.  What the files do not hold is made here, in either case:

- non-persistent buffers (the rotary ``inv_freq`` / ``original_inv_freq``) are recomputed by the
  owning module's own constructor from its config (the model's rope init), since ``to_empty``
  leaves them uninitialised (for a CPU build this rewrites the same values);
- a tied ``lm_head`` absent from the files is the embedding itself (the same parameter, filled
  with it); any other missing tensor is an error naming it.

Invariant: after :func:`load_pretrained` every parameter and buffer holds a defined value, so
:func:`loads_pretrained` may tell a strategy that the build's own values are never read.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from raytrain_ext.models.hf_config import hf_config, pretrained_dir


def loads_pretrained(model_cfg) -> bool:
    """Whether :func:`load_pretrained` fills every value of this model (``ModelSpec.
    loads_every_value``): ``model.hf.pretrained`` with a directory of safetensors."""
    return pretrained_dir(model_cfg) is not None


def load_pretrained(wrapped: nn.Module, model_cfg) -> None:
    """Fill the placed model from ``model.hf.path``'s safetensors and recompute its
    non-persistent buffers (module doc); nothing to do for a random initialisation."""
    directory = pretrained_dir(model_cfg)
    if directory is None:
        return
    state = get_model_state_dict(wrapped)
    reader = dcp.HuggingFaceStorageReader(str(directory))
    saved = set(reader.read_metadata().state_dict_metadata)
    tied = {"lm_head.weight"} if hf_config(model_cfg).tie_word_embeddings else set()
    missing = sorted(k for k in state if k not in saved and k not in tied)
    if missing:
        raise ValueError(
            f"model.hf.path: {directory} lacks {len(missing)} tensor(s) of the model "
            f"({', '.join(missing[:5])}). Is it a checkpoint of this architecture?"
        )
    wanted = {k: v for k, v in state.items() if k in saved}
    dcp.load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(wrapped, wanted, options=StateDictOptions(strict=False))
    recompute_nonpersistent_buffers(wrapped)


def recompute_nonpersistent_buffers(model: nn.Module) -> None:
    """Give every non-persistent buffer the value its module's constructor computes.

    In the Llama-layout families only the rotary embedding has such buffers; it is rebuilt
    (on the CPU, from its ``config``) and its buffers copied into the placed ones.
    """
    for name, module in model.named_modules():
        buffers = sorted(module._non_persistent_buffers_set)
        if not buffers:
            continue
        if any(True for _ in module.parameters(recurse=False)) or not hasattr(module, "config"):
            raise ValueError(
                f"model.hf: {name} ({type(module).__name__}) has non-persistent buffers "
                f"({', '.join(buffers)}) that its config cannot rebuild after a meta-device "
                "build; give the family a spec that initialises them."
            )
        with torch.device("cpu"):
            fresh = type(module)(config=module.config)
        with torch.no_grad():
            for buffer in buffers:
                getattr(module, buffer).copy_(getattr(fresh, buffer))
