"""``objective.name: dpo``: direct preference optimisation (Rafailov et al. 2023, eq. 7).

For a record with chosen response ``c`` and rejected ``r``, with policy sequence
log-probs ``pc, pr`` and the frozen reference's ``rc, rr``, ``h = (pc - rc) - (pr - rr)``
and the loss is ``-(1 - ls) * logsigmoid(beta * h) - ls * logsigmoid(-beta * h)``: the
paper's sigmoid loss, with conservative label smoothing ``ls`` (cDPO, the form TRL's
``sigmoid`` loss used with ``label_smoothing``); ``ls = 0`` is the paper's loss.

Invariants:
- The unit is one pair; a preference batch holds ``pairs`` chosen rows, then the
  ``pairs`` rejected rows in the same order (``Batch``), and ``reference_logps`` has
  that same ``[2 * pairs]`` layout.
- Metrics are sums over pairs: ``reward_margin`` (``beta * h``), ``accuracy`` (pairs
  whose chosen reward beats the rejected one, reward = ``beta * (policy - reference)``),
  ``chosen_reward`` and ``rejected_reward``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from raytrain_ext.data.batch import Batch
from raytrain_ext.objectives.base import LossTerms, Objective, sequence_logps


class DPO(Objective):
    name = "dpo"
    uses_reference = True
    metric_names = ("reward_margin", "accuracy", "chosen_reward", "rejected_reward")

    def __init__(self, beta: float, label_smoothing: float = 0.0):
        self.beta = float(beta)
        self.label_smoothing = float(label_smoothing)

    def units(self, batch: Batch) -> float:
        return float(batch.pairs)

    def loss(
        self,
        logits: torch.Tensor,
        batch: Batch,
        reference_logps: Optional[torch.Tensor] = None,
    ) -> LossTerms:
        reference_logps = _check_layout(logits, batch, reference_logps)
        policy = sequence_logps(logits, batch)
        reference = reference_logps.to(device=policy.device, dtype=policy.dtype)
        ratios = policy - reference  # log pi/pi_ref per row: chosen rows, then rejected
        chosen_ratio, rejected_ratio = ratios[: batch.pairs], ratios[batch.pairs :]
        scaled = self.beta * (chosen_ratio - rejected_ratio)  # beta * h per pair
        smoothing = self.label_smoothing
        losses = -(1 - smoothing) * F.logsigmoid(scaled) - smoothing * F.logsigmoid(-scaled)
        chosen_reward = self.beta * chosen_ratio.detach()
        rejected_reward = self.beta * rejected_ratio.detach()
        metrics = {
            "reward_margin": scaled.detach().sum(),
            "accuracy": (chosen_reward > rejected_reward).to(policy.dtype).sum(),
            "chosen_reward": chosen_reward.sum(),
            "rejected_reward": rejected_reward.sum(),
        }
        return LossTerms(loss_sum=losses.sum(), metrics=metrics)


def _check_layout(
    logits: torch.Tensor, batch: Batch, reference_logps: Optional[torch.Tensor]
) -> torch.Tensor:
    """The reference log-probs, checked.  A caller's mistake, not the user's: the loop must
    pass a preference batch and the reference log-probs of the same rows."""
    rows = 2 * batch.pairs
    if batch.pairs <= 0 or logits.shape[0] != rows:
        raise ValueError(
            f"DPO needs a preference batch (2 * pairs rows); got pairs={batch.pairs} and "
            f"logits for {logits.shape[0]} rows"
        )
    if reference_logps is None or tuple(reference_logps.shape) != (rows,):
        shape = None if reference_logps is None else tuple(reference_logps.shape)
        raise ValueError(f"DPO needs reference_logps of shape ({rows},); got {shape}")
    return reference_logps
