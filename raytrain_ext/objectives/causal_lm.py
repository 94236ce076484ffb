"""``objective.name: causal_lm``: next-token cross-entropy on every counted target.

The unit is one unit of target weight: a token of packed ``tokens``/``text`` data
(``Batch.weights`` None, every target counts 1), or the weight a masked batch gives
each target (0 at a document boundary under ``data.document_mask``).  The sum is
accumulated in float64 so that splitting a batch into micro-batches changes the summed
loss only by the float32 rounding of each token's own loss.
"""

from __future__ import annotations

from typing import Optional

import torch

from raytrain_ext.data.batch import Batch
from raytrain_ext.objectives.base import LossTerms, Objective, weighted_token_nll


class CausalLM(Objective):
    name = "causal_lm"

    def units(self, batch: Batch) -> float:
        return batch.target_weight()

    def loss(
        self,
        logits: torch.Tensor,
        batch: Batch,
        reference_logps: Optional[torch.Tensor] = None,
    ) -> LossTerms:
        loss_sum = weighted_token_nll(logits, batch).sum(dtype=torch.float64)
        return LossTerms(loss_sum=loss_sum, metrics={})
