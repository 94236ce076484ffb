"""Group Relative Policy Optimisation (Shao et al. 2024, DeepSeekMath): the loss and the
group-relative advantages, in the forms of TRL's ``GRPOTrainer`` (1.16), whose names they
keep (``loss_type``, ``scale_rewards``, ``beta``, ``epsilon``, ``epsilon_high``,
``max_completion_length``), so a TRL user's settings carry over key by key.

A prompt group is ``num_generations`` completions of one prompt.  Each completion's reward
is compared with its group's: ``advantage = (r - mean(group))``, divided by the group's
(``scale_rewards=group``) or the whole batch's (``batch``) standard deviation + 1e-4, or
not at all (``none``).  A completion no reward function scored (every function returned
None, a NaN here) is left out of its group's mean and deviation and gets advantage 0,
as in TRL; it is never counted as a reward of 0.

The loss of a completion token with log-prob ``p`` now and ``p_old`` under the policy that
generated it (``Rollout.old_logps``; none given: the current policy's, detached, as TRL
does when the step is on-policy) is the clipped surrogate
``-min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)``, ``ratio =
exp(p - p_old)``, plus ``beta`` times the per-token KL estimate against the reference,
``exp(q - p) - (q - p) - 1`` (``Rollout.ref_logps``, when ``beta > 0``).  Every log-prob
is of ``logits / temperature``, the distribution the completions were sampled from, as
in TRL.

Invariants:
- A rollout batch's rows are prompt + completion sequences; ``Batch.weights`` is the
  completion mask (1 on a completion token, 0 on the prompt and padding), and the
  ``Rollout`` tensors are aligned with ``Batch.targets``.
- Like every objective this returns sums, and the loop divides by the global batch's
  summed :meth:`GRPO.units`, so the loss of a global batch does not depend on the world
  size.  Each ``loss_type`` normalises as TRL does over one optimizer step:
  ``dapo`` by the step's completion tokens; ``grpo`` by its completions, each the mean
  over its own tokens; ``dr_grpo`` by completions x ``max_completion_length``; ``bnpo``
  (a per-micro-batch token mean in TRL) by completions, each micro-batch's token mean
  weighted by its rows, which is TRL's mean of micro-batch means for equal micro-batches.
"""

from __future__ import annotations

from typing import ClassVar, Optional, Sequence, Tuple

import torch

from raytrain_ext.data.batch import Batch, Rollout
from raytrain_ext.errors import InputError
from raytrain_ext.objectives.base import LossTerms, Objective, token_logps
from raytrain_ext.objectives.config import GRPOLossType, ScaleRewards

SCALE_EPSILON = 1e-4  # TRL's: added to the deviation before dividing


def combined_rewards(per_function: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """Each completion's weighted reward sum over the reward functions (``per_function``:
    ``[completions, functions]``, NaN where a function returned None); NaN for a completion
    no function scored."""
    if per_function.shape[1] != len(weights):
        raise InputError(
            f"{len(weights)} reward weights for {per_function.shape[1]} reward functions: "
            "give one weight per function."
        )
    weight = torch.tensor(weights, dtype=per_function.dtype, device=per_function.device)
    rewards = (per_function * weight).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = torch.nan
    return rewards


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale: ScaleRewards
) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` (``[groups * num_generations]``, each
    group's completions adjacent; NaN: unscored), as TRL computes them (module doc)."""
    if rewards.numel() % num_generations:
        raise InputError(
            f"{rewards.numel()} rewards do not split into groups of num_generations="
            f"{num_generations}: every prompt group must be whole."
        )
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale == ScaleRewards.batch:
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else rewards * 0
    elif num_generations > 1:
        std = _nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != ScaleRewards.none:
        advantages = advantages / (std + SCALE_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


def _nanstd(values: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The sample standard deviation ignoring NaNs (Bessel-corrected, as TRL's)."""
    mean = torch.nanmean(values, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(values)).sum(dim=dim).to(values.dtype)
    squares = torch.nansum((values - mean) ** 2, dim=dim)
    return torch.sqrt(squares / (count - 1))


class GRPO(Objective):
    """The clipped surrogate without a KL term (``beta = 0``, TRL's default): no
    reference log-probs are needed."""

    name = "grpo"
    metric_names: ClassVar[Tuple[str, ...]] = (
        "clip_ratio",
    )  # the share of clipped completion tokens, averaged as the loss averages (module doc)

    def __init__(
        self,
        loss_type: GRPOLossType = GRPOLossType.dapo,
        epsilon: float = 0.2,
        epsilon_high: Optional[float] = None,
        max_completion_length: int = 512,
        temperature: float = 1.0,
    ):
        self.loss_type = GRPOLossType(loss_type)
        self.temperature = float(temperature)  # the sampling's: log-probs of logits / T
        self.epsilon_low = float(epsilon)
        self.epsilon_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.max_completion_length = int(max_completion_length)
        self.beta = 0.0

    def units(self, batch: Batch) -> float:
        completions = float(batch.inputs.shape[0])
        if self.loss_type == GRPOLossType.dapo:
            return _completion_mask(batch).sum().item()
        return completions

    def loss(
        self,
        logits: torch.Tensor,
        batch: Batch,
        reference_logps: Optional[torch.Tensor] = None,
    ) -> LossTerms:
        rollout, mask = _rollout(batch), _completion_mask(batch)
        logps = token_logps(logits, batch, self.temperature)
        old = _completions_only(rollout.old_logps, logps.detach(), mask)
        ratio = torch.exp(logps - old)
        advantages = rollout.advantages.to(logps).unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        token_loss = -torch.min(ratio * advantages, clipped * advantages)
        outside = ((ratio < 1 - self.epsilon_low) & (advantages < 0)) | (
            (ratio > 1 + self.epsilon_high) & (advantages > 0)
        )
        metrics = {"clip_ratio": self._sum(outside.to(logps.dtype).detach(), mask)}
        kl = self._token_kl(logps, rollout, mask)
        if kl is not None:
            token_loss = token_loss + self.beta * kl
            metrics["kl"] = self._sum(kl.detach(), mask)
        return LossTerms(self._sum(token_loss, mask), metrics)

    def _token_kl(
        self, logps: torch.Tensor, rollout: Rollout, mask: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """The per-token KL estimate against the reference; None: no KL term."""
        return None

    def _sum(self, token_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``token_values`` summed as ``loss_type`` weighs them (module doc): divided by
        :meth:`units`' global sum, this is TRL's average."""
        masked = token_values * mask
        if self.loss_type == GRPOLossType.dapo:
            return masked.sum()
        if self.loss_type == GRPOLossType.grpo:
            return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum()
        if self.loss_type == GRPOLossType.dr_grpo:
            return masked.sum() / self.max_completion_length
        return masked.sum() / mask.sum().clamp(min=1.0) * mask.shape[0]  # bnpo


class KLRegularizedGRPO(GRPO):
    """GRPO with ``beta > 0``: the per-token KL estimate ``exp(q - p) - (q - p) - 1``
    against the reference policy's log-probs ``q``, computed when the completions were
    generated (``Rollout.ref_logps``)."""

    metric_names: ClassVar[Tuple[str, ...]] = (
        "clip_ratio",
        "kl",
    )  # kl: the mean estimate, per unit

    def __init__(self, beta: float, **surrogate):
        super().__init__(**surrogate)
        self.beta = float(beta)

    def _token_kl(
        self, logps: torch.Tensor, rollout: Rollout, mask: torch.Tensor
    ) -> Optional[torch.Tensor]:
        if rollout.ref_logps is None:
            raise InputError(
                "a GRPO batch without reference log-probs while beta > 0: the rollout must "
                "score its completions under the reference policy (or set beta=0)."
            )
        delta = _completions_only(rollout.ref_logps, logps, mask) - logps
        return torch.exp(delta) - delta - 1


def _completions_only(
    given: Optional[torch.Tensor], fallback: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``given`` on completion tokens, ``fallback`` elsewhere (and everywhere when none is
    given): whatever a rollout holds at prompt or padding positions, a NaN or an -inf
    included, never reaches the loss (NaN times a weight of 0 is NaN)."""
    if given is None:
        return fallback
    return torch.where(mask > 0, given.to(fallback), fallback)


def _rollout(batch: Batch) -> Rollout:
    if batch.rollout is None:
        raise InputError(
            "objective.name=grpo trains on rollout batches (completions with their "
            "advantages and the generating policy's log-probs); this batch has none."
        )
    return batch.rollout


def _completion_mask(batch: Batch) -> torch.Tensor:
    if batch.weights is None:
        raise InputError(
            "a GRPO batch needs Batch.weights as its completion mask (1 on completion "
            "tokens, 0 on the prompt and padding); this batch has none."
        )
    return batch.weights.float()
