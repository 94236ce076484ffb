"""The ``objective`` section: which loss a batch trains with (``objectives.choice``
decides it with the data format), and DPO's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import positive, within


class ObjectiveName(Choice):
    """``objective.name``: next-token loss, supervised fine-tuning (response tokens only), direct
    preference optimisation, or the user's loss (``objective.fn``)."""

    causal_lm = "causal_lm"
    sft = "sft"
    dpo = "dpo"
    user = "user"


@dataclass
class DPOConfig:
    """``objective.name: dpo``: the sigmoid loss of Rafailov et al. (2023) against a frozen
    reference (the starting weights), whose log-probs are computed in a first pass."""

    beta: float = positive(0.1)
    label_smoothing: float = within(0, 0.5, 0.0, hi_open=True)


@dataclass
class ObjectiveConfig:
    """How a batch and the model's output become the loss.

    ``causal_lm`` (next-token loss on every target), ``sft`` (loss on response tokens
    only; needs ``data.format: chat``), ``dpo`` (needs ``data.format: preference``) or
    ``user``: ``fn: "pkg.module:loss"`` taking ``(logits, batch)`` and returning the sum
    of its per-token losses (the loop averages over the global batch's target weight).
    ``name: null`` (the default) follows what is given: ``user`` with ``fn`` or a loss
    function from Python, else the format's objective (chat: sft, preference: dpo,
    tokens and text: causal_lm); see :func:`raytrain_ext.objectives.objective_name`.
    """

    name: Optional[ObjectiveName] = None
    fn: Optional[str] = None
    dpo: DPOConfig = field(default_factory=DPOConfig)
