"""MoE expert load: tokens each expert kept this step, counted on every rank, shared.

Routing runs where the tokens are, so every rank counts all experts (all its MoE
layers); the counts ride in the step's all-gather (``train.exchange``), which sums
them, and rank 0's record gets each expert's share.  Dense models count nothing.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from raytrain_ext.models.moe import moe_expert_load


class ExpertLoad:
    def __init__(self, layers: List[Any], num_experts: int, rank: int):
        self.layers, self.num_experts, self.rank = layers, num_experts, rank
        self.tokens: Optional[torch.Tensor] = None  # this step's kept tokens per expert

    def count(self) -> None:
        """Add the layers' kept tokens of the micro-batch just routed."""
        load = moe_expert_load(self.layers)
        self.tokens = load if self.tokens is None else self.tokens + load

    def take(self) -> List[float]:
        """This rank's kept tokens per expert this step, then reset (empty when dense)."""
        if not self.num_experts:
            return []
        counts, self.tokens = self.tokens, None
        if counts is None:
            return [0.0] * self.num_experts
        return counts.to(torch.float64).tolist()

    def field(self, global_tokens: List[float]) -> Dict[str, Any]:
        """Each expert's share of the step's kept tokens (all ranks), on rank 0's record."""
        total = sum(global_tokens)
        if self.rank != 0 or total == 0:
            return {}
        return {"expert_load": [round(c / total, 6) for c in global_tokens]}
