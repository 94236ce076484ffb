"""``objective.name: sft``: supervised fine-tuning, the loss on response tokens only.

The math is :class:`CausalLM`'s; what differs is the contract with the data: a chat
batch (``data.format: chat``) carries ``Batch.weights`` that are 0 on prompt tokens and
padding, so a prompt token neither adds to the loss nor sends gradient to its logits,
and the units are the response tokens.  A batch without weights would silently train
on the prompts, so it is refused.
"""

from __future__ import annotations

from typing import Optional

import torch

from raytrain_ext.data.batch import Batch
from raytrain_ext.errors import InputError
from raytrain_ext.objectives.base import LossTerms
from raytrain_ext.objectives.causal_lm import CausalLM


def _require_weights(batch: Batch) -> None:
    if batch.weights is None:
        raise InputError(
            "objective.name=sft needs data.format=chat (its batches carry the weights that "
            "mask prompt tokens out of the loss); this batch has none. Set data.format=chat, "
            "or train every token with objective.name=causal_lm."
        )


class SFT(CausalLM):
    name = "sft"

    def units(self, batch: Batch) -> float:
        _require_weights(batch)
        return batch.target_weight()

    def loss(
        self,
        logits: torch.Tensor,
        batch: Batch,
        reference_logps: Optional[torch.Tensor] = None,
    ) -> LossTerms:
        _require_weights(batch)
        return super().loss(logits, batch)
