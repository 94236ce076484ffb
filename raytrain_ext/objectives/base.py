"""What a training objective is: a batch and the model's logits in, a loss *sum* out.

Why sums: the loop adds every micro-batch's ``loss_sum`` on every rank and divides by
the summed :meth:`Objective.units` of the whole global batch, so each unit (a counted
target token, or a preference pair) has the same weight whatever the world size and
micro-batch split.  An objective therefore never averages.

Invariants:
- ``LossTerms.loss_sum`` is a differentiable scalar, the sum of this batch's per-unit
  losses; ``LossTerms.metrics`` holds detached scalar sums keyed by exactly
  ``Objective.metric_names`` (the loop sums them over ranks and divides by the units).
- ``units(batch)`` depends on the batch alone, never on the model, so the loop can
  count the global batch's units before any forward.
- Log-probabilities are computed from float32 logits whatever the autocast dtype.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from raytrain_ext.data.batch import Batch


@dataclass
class LossTerms:
    loss_sum: torch.Tensor
    metrics: Dict[str, torch.Tensor]


class Objective(abc.ABC):
    """One way of turning ``(logits, batch)`` into a loss sum; see the module docstring."""

    name: ClassVar[str]
    uses_reference: ClassVar[bool] = False  # needs the reference model's sequence log-probs
    metric_names: ClassVar[Tuple[str, ...]] = ()

    @abc.abstractmethod
    def units(self, batch: Batch) -> float:
        """The loss units in ``batch``: its target weight (tokens) or its pairs."""

    @abc.abstractmethod
    def loss(
        self,
        logits: torch.Tensor,
        batch: Batch,
        reference_logps: Optional[torch.Tensor] = None,
    ) -> LossTerms:
        """The summed loss of ``batch`` given the model's ``logits`` ``[rows, seq, vocab]``."""


def token_nll(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``-log p(target)`` of every target, float32 ``[rows, seq_len]`` (unweighted)."""
    nll = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction="none")
    return nll.view(batch.targets.shape)


def token_logps(logits: torch.Tensor, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """``log p(target)`` of every target under ``softmax(logits / temperature)``, float32
    ``[rows, seq_len]`` (the distribution completions sampled at ``temperature`` came from)."""
    return -token_nll(logits.float() / temperature, batch)


def weighted_token_nll(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """:func:`token_nll` times each target's weight (a weight-0 target adds exactly 0 and
    passes exactly 0 gradient to its logits)."""
    nll = token_nll(logits, batch)
    return nll if batch.weights is None else nll * batch.weights.to(nll.dtype)


def sequence_logps(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Each row's weighted sum of target log-probs, float32 ``[rows]``: the log-probability
    of a sequence's counted (response) tokens under the model that made ``logits``."""
    return -weighted_token_nll(logits, batch).sum(dim=1)
