"""Models and their specs: the reference GPT, Hugging Face causal LMs, the user's module.

``model_spec`` maps a ``model`` config section to the spec the strategies and the loop
use, through the source's hooks (:mod:`raytrain_ext.models.sources`).  The exports are
imported on first use (:mod:`raytrain_ext.lazy_exports`): the driver imports
``models.sources`` and ``models.hf_config`` without torch.
"""

from typing import Any

from raytrain_ext.lazy_exports import exporter

_EXPORTS = {
    "GPT": "raytrain_ext.models.gpt",
    "Block": "raytrain_ext.models.gpt",
    "build_model": "raytrain_ext.models.gpt",
    "GPT_SPEC": "raytrain_ext.models.gpt_spec",
    "MoEFeedForward": "raytrain_ext.models.moe",
    "ModelSpec": "raytrain_ext.models.spec",
}


def model_spec(model_cfg: Any, model_factory: Any = None) -> Any:
    """The spec of the configured model; ``model_factory``: a callable or ``ModelSpec`` given
    from Python for ``model.source=python`` (``Trainer(cfg, model=...)``)."""
    from raytrain_ext.models.sources import model_source

    return model_source(model_cfg).spec(model_cfg, model_factory)


__getattr__ = exporter(globals(), _EXPORTS)
__all__ = [*_EXPORTS, "model_spec"]
