"""``ModelSpec`` of the Hugging Face decoder-only families that share Llama's layout.

Llama, Mistral, Qwen2 and Qwen3 causal LMs are ``<Family>ForCausalLM``: ``model.embed_tokens``,
``model.layers[i]`` (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``),
``model.norm``, ``model.rotary_emb`` and ``lm_head``.  One spec serves them all:

- ``blocks``: the decoder layers (FSDP units, activation-checkpoint units, stage splits);
- tensor parallelism follows the model's own ``base_model_tp_plan`` (what ``transformers``
  ships for each family); a plan style without a torch equivalent here is refused by name;
- pipeline stages hold the model's own modules under their original names, so checkpoints
  and exports are those of the whole model; every stage keeps ``rotary_emb`` (buffers only);
- pretrained weights load after the strategy has placed the model: DCP's
  ``HuggingFaceStorageReader`` reads, for each rank, only the tensors (or, for sharded
  parameters, the slices) that rank holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from raytrain_ext.models.hf_config import SPEC_FAMILIES, hf_config, pretrained_dir
from raytrain_ext.models.spec import ModelSpec, PipelineStageModule, StageBlocks, stage_layers

TP_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
BLOCK_PREFIX = "layers.*."


def build_hf(model_cfg, seed: int) -> nn.Module:
    """The architecture of ``model.hf``, randomly initialised under a private RNG (so every
    rank builds the same weights); pretrained weights come in after placement."""
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
    return module(input_ids=inputs, use_cache=False).logits


def hf_block_plan(block: nn.Module, sequence_parallel: bool) -> Dict[str, object]:
    """The family's own per-layer plan (``config.base_model_tp_plan``) as torch styles."""
    config = block.self_attn.config
    plan = {}
    for pattern, style in (config.base_model_tp_plan or {}).items():
        if not pattern.startswith(BLOCK_PREFIX):
            continue
        if style not in TP_STYLES:
            raise ValueError(
                f"parallel.tp > 1: the {config.model_type} plan splits "
                f"{pattern[len(BLOCK_PREFIX) :]} as {style!r}, which has no torch style here "
                f"(supported: {', '.join(TP_STYLES)}). Train {config.model_type} with "
                "parallel.tp=1, or add the style to raytrain_ext/models/hf_spec.py."
            )
        plan[pattern[len(BLOCK_PREFIX) :]] = TP_STYLES[style]()
    return plan


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


def load_pretrained(wrapped: nn.Module, model_cfg) -> None:
    """Fill the placed model from ``model.hf.path``'s safetensors (a collective: every rank
    calls it and reads only what it holds).  A tied ``lm_head`` absent from the files is
    the embedding itself; any other missing tensor is an error naming it."""
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


HF_SPEC = ModelSpec(
    name="hf",
    build=build_hf,
    blocks=hf_blocks,
    logits=hf_logits,
    tp_block_plan=hf_block_plan,
    pipeline_stage=HFStage,
    load_pretrained=load_pretrained,
)

FAMILY_SPECS = {family: HF_SPEC for family in SPEC_FAMILIES}


def hf_spec(model_cfg) -> ModelSpec:
    """The spec of ``model.hf``'s family (checked on the driver: models/hf_config.py)."""
    return FAMILY_SPECS[hf_config(model_cfg).model_type]


def hf_files(directory: Path) -> List[Path]:
    """The files of a model directory that an export carries along (config, tokenizer)."""
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    names += ("tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
    return [directory / name for name in names if (directory / name).is_file()]
