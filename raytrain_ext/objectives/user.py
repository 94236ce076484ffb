"""``objective.name: user``: the user's loss, named by ``objective.fn`` or given from Python.

The function is called as ``fn(logits, batch)`` (``logits`` ``[rows, seq_len, vocab]`` in
the model's dtype, ``batch`` a :class:`~raytrain_ext.data.batch.Batch`) and returns a
scalar tensor: the SUM of its per-token losses, never their mean.  The loop divides the
summed losses of the global batch by its summed target weight (the unit), so the
function must not normalise by its own micro-batch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from raytrain_ext.data.batch import Batch
from raytrain_ext.errors import InputError
from raytrain_ext.objectives.base import LossTerms, Objective
from raytrain_ext.user_code import import_function

LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]


def load_loss_fn(path: Optional[str]) -> LossFn:
    """The function ``objective.fn`` names; an InputError naming the key when it is not there."""
    return import_function(
        path,
        "objective.fn",
        "your loss function (logits, batch) -> the sum of its per-token losses "
        "(with objective.name=user)",
        "a function (logits, batch) -> the sum of its per-token losses",
        InputError,
    )


class UserObjective(Objective):
    name = "user"

    def __init__(self, fn: LossFn, label: Optional[str] = None):
        self.fn = fn
        self.label = label or getattr(fn, "__qualname__", repr(fn))

    def units(self, batch: Batch) -> float:
        return batch.target_weight()

    def loss(
        self,
        logits: torch.Tensor,
        batch: Batch,
        reference_logps: Optional[torch.Tensor] = None,
    ) -> LossTerms:
        loss_sum = self.fn(logits, batch)
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.ndim != 0:
            got = tuple(loss_sum.shape) if isinstance(loss_sum, torch.Tensor) else type(loss_sum)
            raise InputError(
                f"objective.fn: {self.label} returned {got}; it must return a scalar tensor, "
                "the sum of its per-token losses (the loop divides by the global batch's "
                "target weight)."
            )
        return LossTerms(loss_sum=loss_sum, metrics={})
