"""``ModelSpec`` of the Hugging Face decoder-only families that share Llama's layout.

Llama, Mistral, Qwen2 and Qwen3 causal LMs are ``<Family>ForCausalLM``: ``model.embed_tokens``,
``model.layers[i]`` (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``),
``model.norm``, ``model.rotary_emb`` and ``lm_head``.  One spec serves them all:

- ``blocks``: the decoder layers (FSDP units, activation-checkpoint units, stage splits);
- tensor and sequence parallelism follow the model's own ``base_model_tp_plan`` and module
  names (:mod:`raytrain_ext.models.hf_parallel`);
- pipeline stages hold the model's own modules under their original names, so checkpoints
  and exports are those of the whole model; every stage keeps ``rotary_emb`` (buffers only);
- pretrained weights load after the strategy has placed the model: DCP's
  ``HuggingFaceStorageReader`` reads, for each rank, only the tensors (or, for sharded
  parameters, the slices) that rank holds (:mod:`raytrain_ext.models.hf_weights`); since that
  load fills every value, a sharding strategy builds such a model on the meta device
  (``loads_every_value``), while a random initialisation is built whole on the CPU, so its
  values are the same in every layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import torch
import torch.nn as nn

from raytrain_ext.models.hf_config import SPEC_FAMILIES, hf_config
from raytrain_ext.models.hf_parallel import hf_block_plan, hf_model_plan
from raytrain_ext.models.hf_weights import load_pretrained, loads_pretrained
from raytrain_ext.models.spec import ModelSpec, PipelineStageModule, StageBlocks, stage_layers


def build_hf(model_cfg, seed: int) -> nn.Module:
    """The architecture of ``model.hf``, randomly initialised under a private RNG (so every
    rank builds the same weights); pretrained weights come in after placement.  Under a
    ``torch.device("meta")`` context (a sharding strategy's build of a pretrained model) no
    storage is allocated: the initialisation then runs on meta tensors and costs nothing."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model_cfg)
    config.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def hf_blocks(module: nn.Module) -> List[nn.Module]:
    """The decoder layers of the model or of one of its pipeline stages, in order."""
    return list(module.model.layers)


def hf_logits(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids -> logits: each row one document.  Positions are given rather than
    inferred: under sequence parallelism the embeddings the model would count them from
    hold ``seq / tp`` positions."""
    positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0)
    return hf_document_logits(module, inputs, positions)


def hf_document_logits(
    module: nn.Module, inputs: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Token ids -> logits of packed documents: positions that restart at 0 make
    ``transformers`` build a block-diagonal causal mask (its packed-sequence path) and
    restart the rotary positions, so no token attends across a document boundary."""
    return module(input_ids=inputs, position_ids=positions, use_cache=False).logits


class _StageBody(nn.Module):
    """The ``model.`` part of a stage: embeddings (first stage), its layers, the final norm
    (last stage) and the rotary embedding every stage needs."""


class HFStage(PipelineStageModule):
    """One pipeline stage of a Llama-layout causal LM, holding the model's own modules."""

    def __init__(self, model: nn.Module, stage: int, num_stages: int):
        super().__init__()
        if model.config.tie_word_embeddings and num_stages > 1:
            raise ValueError(
                "parallel.pp > 1: this model ties lm_head to embed_tokens "
                "(tie_word_embeddings), which pipeline stages would hold apart. "
                "Use parallel.pp=1 for it."
            )
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        inner, self.model = model.model, _StageBody()
        if self.is_first:
            self.model.embed_tokens = inner.embed_tokens
        layers = stage_layers(len(inner.layers), num_stages)[stage]
        self.model.layers = StageBlocks({i: inner.layers[i] for i in layers})
        self.model.rotary_emb = inner.rotary_emb
        if self.is_last:
            self.model.norm, self.lm_head = inner.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids -> hidden states on the first stage, hidden states -> logits on the last;
        no attention mask: SDPA's own causal masking, as the whole model uses."""
        hidden = self.model.embed_tokens(x) if self.is_first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.model.rotary_emb(hidden, position_ids=positions)
        for layer in self.model.layers:
            hidden = layer(hidden, position_embeddings=rotary, position_ids=positions)
        return self.lm_head(self.model.norm(hidden)) if self.is_last else hidden


HF_SPEC = ModelSpec(
    name="hf",
    build=build_hf,
    blocks=hf_blocks,
    logits=hf_logits,
    document_logits=hf_document_logits,
    tp_block_plan=hf_block_plan,
    tp_model_plan=hf_model_plan,
    pipeline_stage=HFStage,
    load_pretrained=load_pretrained,
    loads_every_value=loads_pretrained,
)

FAMILY_SPECS = {family: HF_SPEC for family in SPEC_FAMILIES}


def hf_spec(model_cfg) -> ModelSpec:
    """The spec of ``model.hf``'s family (checked on the driver: models/hf_config.py)."""
    return FAMILY_SPECS[hf_config(model_cfg).model_type]


def hf_files(directory: Path) -> List[Path]:
    """The files of a model directory that an export carries along (config, tokenizer)."""
    names = (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "generation_config.json",
    )
    return [directory / name for name in names if (directory / name).is_file()]
