"""Mixture-of-experts feed-forward with top-k routing and a capacity limit.

Expert weights are stacked into ``w_up [E, d, h]`` and ``w_down [E, h, d]`` so
that expert parallelism can shard dim 0 across an ``ep`` mesh axis.  Tokens
routed beyond an expert's capacity are dropped (the residual path carries
them).  ``aux_loss`` is the Switch-Transformer load-balancing loss
``E * sum_e f_e * P_e`` and ``expert_load`` counts the tokens each expert kept,
so routing imbalance is visible.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MoEFeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int, num_experts: int, top_k: int,
                 capacity_factor: float):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.aux_loss = torch.zeros(())
        self.expert_load = torch.zeros(num_experts, dtype=torch.long)  # not a buffer: rank-local

    def capacity(self, num_tokens: int) -> int:
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.aux_loss = self._balance_loss(probs, experts)

        assignment = experts.reshape(-1)  # token-major: token t's choices at t*k .. t*k+k-1
        one_hot = F.one_hot(assignment, self.num_experts)
        slot = (one_hot.cumsum(0) - 1).gather(1, assignment[:, None]).squeeze(1)
        kept = slot < self.capacity(flat.shape[0])
        gate = weights.reshape(-1)
        out = torch.zeros_like(flat)
        for e in range(self.num_experts):
            chosen = torch.nonzero((assignment == e) & kept).squeeze(1)
            if chosen.numel() == 0:
                continue
            tokens = chosen // self.top_k
            hidden = F.gelu(flat[tokens] @ self.w_up[e]) @ self.w_down[e]
            out.index_add_(0, tokens, hidden * gate[chosen, None].to(hidden.dtype))
        self.expert_load = torch.bincount(assignment[kept], minlength=self.num_experts).detach()
        return out.view(shape)

    def _balance_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        routed = F.one_hot(experts, self.num_experts).sum(dim=1).float()
        fraction = routed.mean(dim=0) / self.top_k
        return self.num_experts * (fraction * probs.mean(dim=0)).sum()
