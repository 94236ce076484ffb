"""Mixture-of-experts feed-forward with top-k routing and a capacity limit.

Each expert is its own module under ``experts[str(global_index)]``, so a
parameter's name (``blocks.0.ffn.experts.3.w_up``) is the same whichever rank
holds it: expert parallelism (:mod:`raytrain_ext.parallel.ep`) keeps only a
rank's own experts and DCP reshards checkpoints by those global names.
Tokens routed beyond an expert's capacity are dropped (the residual path
carries them).  ``aux_loss`` is the Switch-Transformer load-balancing loss
``E * sum_e f_e * P_e``; ``expert_load`` counts the tokens each expert kept,
so routing imbalance is visible.

Invariant: routing, capacity and the gate-weighted combine run on the rank
that owns the tokens, in (token, choice) order, whatever ``dispatch`` does;
so sharding the experts changes only where expert matmuls run, not the result.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# (moe, pair_inputs [P, d], pair_experts [P]) -> pair_outputs [P, d]
Dispatch = Callable[["MoEFeedForward", torch.Tensor, torch.Tensor], torch.Tensor]


class Expert(nn.Module):
    """One expert's two-layer GELU MLP."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_up = nn.Parameter(torch.empty(d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(hidden, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.w_up) @ self.w_down


class MoEFeedForward(nn.Module):
    def __init__(
        self, d_model: int, hidden: int, num_experts: int, top_k: int, capacity_factor: float
    ):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert(d_model, hidden) for e in range(num_experts)})
        self.dispatch: Optional[Dispatch] = None  # None: every expert is local
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
        kept = torch.nonzero(slot < self.capacity(flat.shape[0])).squeeze(1)
        tokens, pair_experts = kept // self.top_k, assignment[kept]
        run = self.dispatch or MoEFeedForward.run_experts
        hidden = run(self, flat[tokens], pair_experts)
        gate = weights.reshape(-1)[kept, None].to(hidden.dtype)
        out = torch.zeros_like(flat).index_add(0, tokens, hidden * gate)
        self.expert_load = torch.bincount(pair_experts, minlength=self.num_experts).detach()
        return out.view(shape)

    def run_experts(self, inputs: torch.Tensor, pair_experts: torch.Tensor) -> torch.Tensor:
        """Apply this module's (local) experts to the rows routed to them.

        Every local expert runs, on zero rows if need be, so each expert
        parameter gets a gradient every step (DDP requires that of the
        parameters it reduces; expert parallelism reduces expert grads itself).
        """
        out = torch.zeros_like(inputs)
        for key, expert in self.experts.items():
            rows = torch.nonzero(pair_experts == int(key)).squeeze(1)
            out = out.index_add(0, rows, expert(inputs[rows]))
        return out

    def _balance_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        routed = F.one_hot(experts, self.num_experts).sum(dim=1).float()
        fraction = routed.mean(dim=0) / self.top_k
        return self.num_experts * (fraction * probs.mean(dim=0)).sum()


def moe_layers(model: nn.Module) -> List[MoEFeedForward]:
    """The model's MoE feed-forwards, in module order (empty for a dense model); found
    once, since strategies wrap or shard modules in place without replacing them."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(layers: List[MoEFeedForward]) -> Optional[torch.Tensor]:
    """Sum of the layers' load-balancing losses of the last forward (None when dense)."""
    losses = [moe.aux_loss for moe in layers]
    return torch.stack(losses).sum() if losses else None


def moe_expert_load(layers: List[MoEFeedForward]) -> Optional[torch.Tensor]:
    """Tokens each expert kept in the last forward, summed over MoE layers (None when dense).

    Counts this rank's tokens for all experts, local or not (routing runs where the
    tokens are), so a sum over ranks is the global load.
    """
    loads = [moe.expert_load for moe in layers]
    return torch.stack(loads).sum(dim=0) if loads else None
