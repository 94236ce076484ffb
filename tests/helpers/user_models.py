"""A user's own language model for ``model.source=python`` (``model.factory``): not a GPT
of ours, not a Hugging Face model; its repeated blocks are ``TinyBlock``s."""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(self.norm(x)))


class TinyLM(nn.Module):
    """Token ids -> logits; causal because each position sees only itself."""

    def __init__(self, vocab: int, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.stack = nn.ModuleList(TinyBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.stack:
            x = block(x)
        return self.out(x)


def build_tiny_lm(model_cfg, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(model_cfg.vocab_size, model_cfg.d_model, model_cfg.n_layers)
