"""Model sources: what each ``model.source`` does on the driver, and which spec it trains.

A model family is one module (its spec, its config resolution) plus one line in
``MODEL_SOURCES``.  The config loader, the trainer, the planner, the data's default
tokenizer, the record checks and the Hugging Face export call these hooks instead of
comparing ``model.source`` (``tests/unit/test_seams.py`` forbids the comparison
elsewhere).

Invariant: every member of ``models.config.ModelSource`` has an entry.  This module
imports neither torch nor transformers: each hook imports what it needs when called,
so the driver checks a GPT config without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from raytrain_ext.models.spec import ModelSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ModelSourceHooks:
    """One ``model.source``: the defaults are those of a source that needs no hook."""

    name: str = ""
    label: str = ""  # how messages name the model ("the reference GPT")
    per_document_attention: bool = True  # data.document_mask: attention kept within documents
    takes_python_model: bool = False  # Trainer(cfg, model=...) gives its model or factory

    def resolve(self, cfg: Any) -> None:
        """Complete and check ``cfg.model`` while the config loads (before Ray)."""

    def check_model(self, cfg: Any, model: Any) -> None:
        """Check ``Trainer(cfg, model=...)``'s model, or refuse one given (before Ray)."""
        if model is not None:
            from raytrain_ext.errors import ConfigError

            raise ConfigError(
                f"model.source: Trainer(cfg, model=...) trains your model, but model.source is "
                f"{self.name}. Set model.source=python."
            )

    def default_tokenizer(self, model_cfg: Any) -> Optional[str]:
        """The tokenizer when ``data.tokenizer`` is empty (None: the data must name one)."""
        return None

    def hf_config(self, model_cfg: Any) -> Any:
        """The model's ``transformers`` config (planner, ``export --to-hf``); None without one."""
        return None

    def spec(self, model_cfg: Any, model_factory: Any = None) -> "ModelSpec":
        """The spec the strategies and the loop train (on the worker: imports torch)."""
        raise NotImplementedError(f"model.source={self.name} declares no spec")


class GPTSource(ModelSourceHooks):
    """The reference GPT: its shape is ``model.*`` itself."""

    name = "gpt"
    label = "the reference GPT"
    per_document_attention = False

    def spec(self, model_cfg: Any, model_factory: Any = None) -> "ModelSpec":
        from raytrain_ext.models.gpt_spec import GPT_SPEC

        return GPT_SPEC


class HFSource(ModelSourceHooks):
    """A Hugging Face causal LM: its shape is read from its config into ``model.*``."""

    name = "hf"
    label = "the Hugging Face model"

    def resolve(self, cfg: Any) -> None:
        from raytrain_ext.models.hf_shape_cache import resolve_hf_shape

        resolve_hf_shape(cfg)

    def default_tokenizer(self, model_cfg: Any) -> Optional[str]:
        """The tokenizer saved beside the model's weights, when it is a local directory."""
        if not model_cfg.hf.path:
            return None
        from raytrain_ext.models.hf_config import local_dir

        directory: Optional[Path] = local_dir(model_cfg.hf.path)
        if directory is not None and any((directory / n).is_file() for n in TOKENIZER_FILES):
            return str(directory)
        return None

    def hf_config(self, model_cfg: Any) -> Any:
        from raytrain_ext.models.hf_config import hf_config

        return hf_config(model_cfg)

    def spec(self, model_cfg: Any, model_factory: Any = None) -> "ModelSpec":
        from raytrain_ext.models.hf_spec import hf_spec

        return hf_spec(model_cfg)


class PythonSource(ModelSourceHooks):
    """The user's module: ``model.factory`` or ``Trainer(cfg, model=...)``."""

    name = "python"
    label = "your model"
    takes_python_model = True

    def resolve(self, cfg: Any) -> None:
        if cfg.model.factory is not None:  # without one, the Trainer checks the model given
            from raytrain_ext.models.user_model import check_python_model

            check_python_model(cfg)

    def check_model(self, cfg: Any, model: Any) -> None:
        from raytrain_ext.models.user_model import check_python_model

        check_python_model(cfg, model)

    def spec(self, model_cfg: Any, model_factory: Any = None) -> "ModelSpec":
        from raytrain_ext.models.user_model import python_spec

        return python_spec(model_cfg, model_factory)


MODEL_SOURCES: Dict[str, ModelSourceHooks] = {
    "gpt": GPTSource(),
    "hf": HFSource(),
    "python": PythonSource(),
}


def model_source(model_cfg: Any) -> ModelSourceHooks:
    """The hooks of ``model.source`` (the config's enum admits only registered names)."""
    return MODEL_SOURCES[model_cfg.source]
