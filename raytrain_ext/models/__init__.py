"""Models and their specs: the reference GPT (dense or mixture-of-experts).

``model_spec`` is the one place that maps a ``model`` config section to the spec the
strategies and the loop use; further model families register theirs there.
"""

from raytrain_ext.models.gpt import GPT, Block, build_model
from raytrain_ext.models.gpt_spec import GPT_SPEC
from raytrain_ext.models.moe import MoEFeedForward
from raytrain_ext.models.spec import ModelSpec


def model_spec(model_cfg) -> ModelSpec:
    """The spec of the configured model (today: the reference GPT)."""
    return GPT_SPEC


__all__ = ["GPT", "GPT_SPEC", "Block", "ModelSpec", "MoEFeedForward", "build_model", "model_spec"]
