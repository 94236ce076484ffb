"""Tiny Hugging Face causal LMs built in the tests (never downloaded): hidden 64, 2 layers,
the byte-level vocabulary of the built-in corpus."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def tiny_config(family: str = "llama", **changes):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**TINY, **changes})


def save_tiny(directory: Path, family: str = "llama", seed: int = 3, **changes) -> Path:
    """A model directory as ``save_pretrained`` writes it: config.json + model.safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config(family, **changes)).save_pretrained(directory)
    return directory


def hf_overrides(directory: Path) -> list:
    return ["model.source=hf", f"model.hf.path={directory}", "model.seq_len=64"]
