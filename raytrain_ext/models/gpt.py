"""The reference GPT: a decoder-only transformer sized by ``ModelConfig``.

Written for the parallel strategies that come later: ``blocks`` is a
``ModuleList`` of self-contained ``Block``s (FSDP wraps each one, PP splits the
list by layer count), and attention/MLP use separate q/k/v and up/down
``nn.Linear`` layers so that tensor-parallel colwise/rowwise plans apply
directly.  The feed-forward is dense or a mixture of experts (``moe.num_experts``).
Initialization is deterministic given the seed and independent of the device.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_ext.models.moe import MoEFeedForward


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads, so that a tensor-parallel shard with fewer local heads works unchanged.
        q, k, v = (
            w(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.wo(y.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block; ``aux_loss`` holds the MoE balance loss of the last forward."""

    def __init__(self, cfg):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.moe.num_experts:
            self.ffn: nn.Module = MoEFeedForward(
                cfg.d_model, hidden, cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor
            )
        else:
            self.ffn = FeedForward(cfg.d_model, hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.ffn(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights(cfg.n_layers)

    def _init_weights(self, n_layers: int) -> None:
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # LayerNorm affine keeps (1, 0)
            std = 0.02
            if name.endswith(("wo.weight", "down.weight")) or ".w_down" in name:
                std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2 scaling of residual projections
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(model_cfg, seed: int) -> GPT:
    """Build on CPU under a private RNG, so the result depends only on (config, seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(model_cfg)
