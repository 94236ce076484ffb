"""The :class:`Objective` that ``objective.*`` names, built on each worker."""

from __future__ import annotations

from typing import Callable, Optional

from raytrain_ext.objectives.base import Objective
from raytrain_ext.objectives.causal_lm import CausalLM
from raytrain_ext.objectives.choice import objective_name
from raytrain_ext.objectives.config import ObjectiveName
from raytrain_ext.objectives.dpo import DPO
from raytrain_ext.objectives.grpo import GRPO, KLRegularizedGRPO
from raytrain_ext.objectives.sft import SFT
from raytrain_ext.objectives.user import UserObjective, load_loss_fn


def build_objective(
    objective_cfg, data_format: str, loss_fn: Optional[Callable] = None
) -> Objective:
    """The objective ``objective.*`` (or ``loss_fn``, which makes it ``user``) names, or
    that ``data_format`` trains with when it names none."""
    name = objective_name(objective_cfg, data_format, loss_fn)
    if name == ObjectiveName.user:
        if loss_fn is not None:
            return UserObjective(loss_fn)
        return UserObjective(load_loss_fn(objective_cfg.fn), label=objective_cfg.fn)
    if name == ObjectiveName.sft:
        return SFT()
    if name == ObjectiveName.dpo:
        return DPO(objective_cfg.dpo.beta, objective_cfg.dpo.label_smoothing)
    if name == ObjectiveName.grpo:
        return grpo_objective(objective_cfg.grpo)
    return CausalLM()


def grpo_objective(grpo_cfg) -> GRPO:
    """``objective.grpo.*`` as the loss: with a KL term when ``beta > 0``."""
    surrogate = dict(
        loss_type=grpo_cfg.loss_type,
        epsilon=grpo_cfg.epsilon,
        epsilon_high=grpo_cfg.epsilon_high,
        max_completion_length=grpo_cfg.max_completion_length,
        temperature=grpo_cfg.temperature,
    )
    if grpo_cfg.beta > 0:
        return KLRegularizedGRPO(grpo_cfg.beta, **surrogate)
    return GRPO(**surrogate)
