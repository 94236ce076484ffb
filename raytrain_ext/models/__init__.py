"""Models and their specs: the reference GPT, Hugging Face causal LMs, the user's module.

``model_spec`` is the one place that maps a ``model`` config section to the spec the
strategies and the loop use (``model.source``).
"""

from raytrain_ext.config.choices import ModelSource
from raytrain_ext.models.gpt import GPT, Block, build_model
from raytrain_ext.models.gpt_spec import GPT_SPEC
from raytrain_ext.models.moe import MoEFeedForward
from raytrain_ext.models.spec import ModelSpec


def model_spec(model_cfg, model_factory=None) -> ModelSpec:
    """The spec of the configured model; ``model_factory``: a callable or ``ModelSpec`` given
    from Python for ``model.source=python`` (``Trainer(cfg, model=...)``)."""
    if model_cfg.source == ModelSource.hf:
        from raytrain_ext.models.hf_spec import hf_spec

        return hf_spec(model_cfg)
    if model_cfg.source == ModelSource.python:
        from raytrain_ext.models.user_model import python_spec

        return python_spec(model_cfg, model_factory)
    return GPT_SPEC


__all__ = ["GPT", "GPT_SPEC", "Block", "ModelSpec", "MoEFeedForward", "build_model", "model_spec"]
