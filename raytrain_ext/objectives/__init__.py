"""Training objectives: how a batch and the model's logits become the loss.

:func:`build_objective` makes the :class:`Objective` that ``objective.*`` names (on each
worker); :func:`check_objective` refuses, on the driver before Ray starts, a choice that
cannot work with the data format or the parallel layout, naming the key and the fix.

A loss function given from Python (``Trainer(cfg, loss_fn=...)``) makes the objective
``user``, exactly as ``objective.name=user`` with ``objective.fn`` does.

The names below are imported on first use, so that the driver's check
(``objectives.choice``) imports no torch.
"""

from typing import TYPE_CHECKING

from raytrain_ext.lazy_exports import exporter

_EXPORTS = {
    "CausalLM": "raytrain_ext.objectives.causal_lm",
    "DPO": "raytrain_ext.objectives.dpo",
    "LossTerms": "raytrain_ext.objectives.base",
    "Objective": "raytrain_ext.objectives.base",
    "SFT": "raytrain_ext.objectives.sft",
    "UserObjective": "raytrain_ext.objectives.user",
    "build_objective": "raytrain_ext.objectives.build",
    "check_objective": "raytrain_ext.objectives.choice",
    "load_loss_fn": "raytrain_ext.objectives.user",
    "objective_name": "raytrain_ext.objectives.choice",
    "sequence_logps": "raytrain_ext.objectives.base",
}

if TYPE_CHECKING:
    from raytrain_ext.objectives.base import LossTerms, Objective, sequence_logps
    from raytrain_ext.objectives.build import build_objective
    from raytrain_ext.objectives.causal_lm import CausalLM
    from raytrain_ext.objectives.choice import check_objective, objective_name
    from raytrain_ext.objectives.dpo import DPO
    from raytrain_ext.objectives.sft import SFT
    from raytrain_ext.objectives.user import UserObjective, load_loss_fn

__getattr__ = exporter(globals(), _EXPORTS)

__all__ = [
    "CausalLM",
    "DPO",
    "LossTerms",
    "Objective",
    "SFT",
    "UserObjective",
    "build_objective",
    "check_objective",
    "load_loss_fn",
    "objective_name",
    "sequence_logps",
]
