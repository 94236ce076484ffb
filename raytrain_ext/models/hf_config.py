"""``model.source: hf``: the Hugging Face config of the model, read and checked on the driver.

Why on the driver: a missing directory, a family without a spec or a config that is not a
causal LM must fail before Ray starts, naming the key; and the shape the rest of the
project reasons about (``model.n_layers``, ``d_model``, ``n_heads``, ``vocab_size``: the
planner, the tensor-parallel checks, the data's id range, MFU) is the HF model's, so
``models.hf_shape_cache.resolve_hf_shape`` writes it into the config that every worker receives
(from a cache of accepted configs, which spares the driver importing ``transformers``).

Invariant: :func:`hf_config` gives the same architecture on the driver and on every
worker (a local directory or the local HF cache, never a download).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from raytrain_ext.errors import ConfigError

SPEC_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # model_type values with a shipped spec
ADD_A_SPEC = (
    "To train another family, give it a ModelSpec (raytrain_ext/models/hf_spec.py, "
    "FAMILY_SPECS) or use model.source=python with your own factory."
)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.source: hf needs the transformers library. Install it with "
            "`pip install transformers`, or use model.source=gpt."
        ) from None
    return transformers


def local_dir(path: str) -> Path:
    """``path`` as a local directory: itself, or a model id's snapshot in the local HF cache."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except Exception:
        raise ConfigError(
            f"model.hf.path: {path} is neither a directory nor a model id in the local "
            "Hugging Face cache (nothing is downloaded during training). Download it first "
            "(`huggingface-cli download <id>`) or give the directory holding config.json."
        ) from None


def _path_config(path: str) -> Dict[str, Any]:
    config_json = local_dir(path) / "config.json"
    if not config_json.is_file():
        raise ConfigError(
            f"model.hf.path: {path} has no config.json. Give the directory of a Hugging Face "
            "model (config.json + *.safetensors), or an inline model.hf.config."
        )
    try:
        return json.loads(config_json.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.hf.path: {config_json} is not valid JSON ({e}).") from None


def hf_config(model_cfg) -> Any:
    """The ``transformers`` config of ``model.hf``: ``path``'s config.json, then the inline
    ``config`` over it."""
    return build_config(*checked_values(model_cfg))


def checked_values(model_cfg) -> Tuple[str, Dict[str, Any]]:
    """``model.hf``'s family and its config values (``path``'s config.json, the inline
    ``config`` over it), checked as far as they can be without ``transformers``."""
    hf = model_cfg.hf
    if not hf.path and not hf.config:
        raise ConfigError(
            "model.hf: model.source=hf needs model.hf.path (a local model directory or a "
            "cached model id) or an inline model.hf.config (e.g. {model_type: llama, "
            "hidden_size: 64, num_hidden_layers: 2, ...})."
        )
    values = _path_config(hf.path) if hf.path else {}
    values.update(dict(hf.config))
    family = values.get("model_type")
    if family not in SPEC_FAMILIES:
        raise ConfigError(
            f"model.hf: model_type {family!r} has no model spec here; families with one: "
            f"{', '.join(SPEC_FAMILIES)}. {ADD_A_SPEC}"
        )
    architectures = values.get("architectures") or []
    if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
        raise ConfigError(
            f"model.hf.path: {hf.path} holds {', '.join(architectures)}, not a causal LM "
            "(*ForCausalLM). Give the checkpoint of a decoder-only language model."
        )
    return family, {k: v for k, v in values.items() if k != "model_type"}


def build_config(family: str, values: Dict[str, Any]) -> Any:
    """``transformers``' config of ``family`` from ``values``, its own checks applied."""
    transformers = _transformers()
    from huggingface_hub.errors import StrictDataclassError  # how transformers 5 refuses a value

    try:
        return transformers.AutoConfig.for_model(family, **values)
    except (TypeError, ValueError, StrictDataclassError) as e:
        detail = " ".join(str(e).split()).rstrip(".")
        raise ConfigError(
            f"model.hf.config: {detail}. Fix the value in model.hf.config or in "
            "model.hf.path's config.json."
        ) from None


def pretrained_dir(model_cfg) -> Optional[Path]:
    """The directory whose safetensors hold the starting weights, or None (random init)."""
    hf = model_cfg.hf
    if not (hf.path and hf.pretrained):
        return None
    directory = local_dir(hf.path)
    if not any(directory.glob("*.safetensors")):
        raise ConfigError(
            f"model.hf.path: {hf.path} has no *.safetensors weights. Add them, or set "
            "model.hf.pretrained=false to start from a random initialisation."
        )
    return directory
