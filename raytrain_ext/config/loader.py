"""Build a run configuration: defaults < YAML file < ``key=value`` overrides.

Every failure is raised as :class:`ConfigError` naming the full key and the fix,
before any Ray or torch work starts.  The returned config is resolved (no
interpolations left) and read-only, so it can be shipped to workers as is.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    ValidationError,
)

from raytrain_ext.config.schema import TrainConfig
from raytrain_ext.config.validate import validate
from raytrain_ext.errors import ConfigError
from raytrain_ext.typed_config.fields import choice_of


def default_config_path() -> Path:
    """The packaged default (a copy of ``configs/tiny_cpu.yaml``)."""
    return Path(str(resources.files("raytrain_ext.config").joinpath("default.yaml")))


def load_config(
    path: Optional[str | Path] = None,
    overrides: Sequence[str] = (),
    *,
    use_default: bool = True,
) -> DictConfig:
    """Load, merge, resolve and validate a config.

    ``path`` of ``None`` uses the packaged default YAML when ``use_default``;
    ``overrides`` are ``key=value`` strings (OmegaConf dotlist syntax).
    """
    cfg = OmegaConf.structured(TrainConfig)
    yaml_path = Path(path) if path is not None else (default_config_path() if use_default else None)
    if yaml_path is not None:
        cfg = _merge(cfg, _read_yaml(yaml_path), source=str(yaml_path))
    cfg = _merge(cfg, _parse_overrides(overrides), source="command line")
    try:
        OmegaConf.resolve(cfg)
    except InterpolationResolutionError as e:
        raise ConfigError(
            f"{_full_key(e)}: cannot resolve interpolation ({_first_line(e)}). "
            "Fix the ${...} reference or set the value directly."
        ) from None
    _resolve_model(cfg)
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _resolve_model(cfg: DictConfig) -> None:
    """The model source's own resolution, before Ray starts: a Hugging Face model's shape
    into ``model.*``, the user's factory imported and checked
    (:mod:`raytrain_ext.models.sources`)."""
    from raytrain_ext.models.sources import model_source

    model_source(cfg.model).resolve(cfg)


def load_saved_config(path: Path) -> DictConfig:
    """A run's own ``config.yaml``, typed and read-only again, as that run resolved and
    checked it: its model source is not resolved again (a Hugging Face model's would import
    transformers and torch, about 2 s, for a shape the file already holds)."""
    cfg = _merge(OmegaConf.structured(TrainConfig), _read_yaml(Path(path)), source=str(path))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def config_from_dict(data: dict) -> DictConfig:
    """Rebuild a typed, read-only config from ``to_dict`` output (used on workers)."""
    cfg = _merge(OmegaConf.structured(TrainConfig), OmegaConf.create(data), source="dict")
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(
            f"config file {path} does not exist. Pass an existing YAML file "
            "(for example configs/tiny_cpu.yaml) or omit it to use the default."
        )
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends
        raise ConfigError(f"config file {path} is not valid YAML: {_first_line(e)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (run:, model:, ...)."
        )
    return loaded


def _parse_overrides(overrides: Iterable[str]) -> DictConfig:
    items = list(overrides)
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"override {item!r} is not of the form key=value "
                "(for example data.global_batch_size=32)."
            )
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot parse overrides {items}: {_first_line(e)}") from None


def _merge(base: DictConfig, update: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)
    except ConfigKeyError as e:
        raise ConfigError(_unknown_key_message(e, source)) from None
    except ValidationError as e:
        raise ConfigError(_invalid_value_message(e, source)) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{_full_key(e)}: {_first_line(e)} (from {source}).") from None


def _invalid_value_message(e: ValidationError, source: str) -> str:
    """A value of the wrong type, or outside the key's choice enum (named with its values)."""
    key = _full_key(e)
    choices = choice_of(TrainConfig, key)
    if choices is not None:
        return (
            f"{key}: {getattr(e, 'value', None)!r} is not one of {', '.join(choices.values())} "
            f"(from {source}). Set {key} to one of them."
        )
    text = _first_line(e)
    if "Cannot convert 'ListConfig'" in text or "Cannot convert 'DictConfig'" in text:
        return (  # key=[EOS] is a list in OmegaConf's override grammar
            f"{key}: {text} (from {source}). A string that starts with [ or {{ needs quotes: "
            f"'{key}=\"[EOS]\"' in a shell."
        )
    return f"{key}: {text} (from {source}). Give {key} a value of the documented type."


def _unknown_key_message(e: ConfigKeyError, source: str) -> str:
    full_key = _full_key(e)
    parent, _, leaf = full_key.rpartition(".")
    valid = _keys_at(parent)
    hint = difflib.get_close_matches(leaf, valid, n=1)
    where = f"section '{parent}'" if parent else "the top level"
    msg = f"{full_key}: unknown key in {where} (from {source})."
    if hint:
        msg += f" Did you mean '{(parent + '.') if parent else ''}{hint[0]}'?"
    return msg + f" Valid keys: {', '.join(valid)}."


def _keys_at(dotted: str) -> list[str]:
    node: Any = OmegaConf.structured(TrainConfig)
    for part in [p for p in dotted.split(".") if p]:
        node = node.get(part) if isinstance(node, DictConfig) else None
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _full_key(e: OmegaConfBaseException) -> str:
    return str(getattr(e, "full_key", None) or getattr(e, "key", None) or "<config>")


def _first_line(e: BaseException) -> str:
    msg = getattr(e, "msg", None) or str(e)
    return str(msg).splitlines()[0]
