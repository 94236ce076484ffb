"""The ``objective`` section: which loss a batch trains with (``objectives.choice``
decides it with the data format), and DPO's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import at_least, positive, within


class ObjectiveName(Choice):
    """``objective.name``: next-token loss, supervised fine-tuning (response tokens only), direct
    preference optimisation, group relative policy optimisation (online RL on generated
    completions), or the user's loss (``objective.fn``)."""

    causal_lm = "causal_lm"
    sft = "sft"
    dpo = "dpo"
    grpo = "grpo"
    user = "user"


class GRPOLossType(Choice):
    """``objective.grpo.loss_type``, TRL's: how token losses are averaged
    (``objectives.grpo``): dapo (token mean over the global batch, TRL's default), grpo
    (per-completion token mean), dr_grpo (token sum over ``max_completion_length``), bnpo
    (token mean per micro-batch)."""

    dapo = "dapo"
    grpo = "grpo"
    dr_grpo = "dr_grpo"
    bnpo = "bnpo"


class ScaleRewards(Choice):
    """``objective.grpo.scale_rewards``, TRL's: advantages divided by the standard deviation
    of their group's rewards, of the whole batch's, or not at all."""

    group = "group"
    batch = "batch"
    none = "none"


@dataclass
class DPOConfig:
    """``objective.name: dpo``: the sigmoid loss of Rafailov et al. (2023) against a frozen
    reference (the starting weights), whose log-probs are computed in a first pass."""

    beta: float = positive(0.1)
    label_smoothing: float = within(0, 0.5, 0.0, hi_open=True)


@dataclass
class GRPOConfig:
    """``objective.name: grpo``: TRL's ``GRPOConfig`` keys, names and defaults, so a TRL
    config carries over key by key.  ``data.global_batch_size`` and
    ``data.micro_batch_size`` count prompt groups (each of ``num_generations``
    completions)."""

    num_generations: int = at_least(2, 8)
    beta: float = at_least(0, 0.0)
    epsilon: float = positive(0.2)
    epsilon_high: Optional[float] = positive(None, null="epsilon's")
    loss_type: GRPOLossType = GRPOLossType.dapo
    scale_rewards: ScaleRewards = ScaleRewards.group
    num_iterations: int = positive(1)
    max_completion_length: int = positive(512)
    temperature: float = positive(1.0)
    top_p: float = within(0, 1, 1.0)
    top_k: int = at_least(0, 0)


@dataclass
class ObjectiveConfig:
    """How a batch and the model's output become the loss.

    ``causal_lm`` (next-token loss on every target), ``sft`` (loss on response tokens
    only; needs ``data.format: chat``), ``dpo`` (needs ``data.format: preference``),
    ``grpo`` (needs ``data.format: prompts`` and the ``rollout`` section) or
    ``user``: ``fn: "pkg.module:loss"`` taking ``(logits, batch)`` and returning the sum
    of its per-token losses (the loop averages over the global batch's target weight).
    ``name: null`` (the default) follows what is given: ``user`` with ``fn`` or a loss
    function from Python, else the format's objective (chat: sft, preference: dpo,
    prompts: grpo, tokens and text: causal_lm); see :func:`raytrain_ext.objectives.objective_name`.
    """

    name: Optional[ObjectiveName] = None
    fn: Optional[str] = None
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
