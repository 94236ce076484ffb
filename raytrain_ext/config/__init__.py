"""Typed run configuration (OmegaConf structured dataclasses)."""

from raytrain_ext.config.errors import ConfigError
from raytrain_ext.config.loader import (
    config_digest,
    config_from_dict,
    default_config_path,
    load_config,
    to_dict,
    to_yaml,
)
from raytrain_ext.config.schema import TrainConfig

__all__ = [
    "ConfigError",
    "TrainConfig",
    "config_digest",
    "config_from_dict",
    "default_config_path",
    "load_config",
    "to_dict",
    "to_yaml",
]
