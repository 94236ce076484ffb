"""Typed run configuration (OmegaConf structured dataclasses).

The names below are imported on first use: ``raytrain_ext.config.choices`` (the enums,
which ``parallel.dims`` uses) must be importable without the loader, whose validation
imports ``parallel.dims`` in turn.
"""

from typing import TYPE_CHECKING

from raytrain_ext.lazy_exports import exporter

_EXPORTS = {
    "ConfigError": "raytrain_ext.errors",
    "TrainConfig": "raytrain_ext.config.schema",
    **{
        name: "raytrain_ext.config.loader"
        for name in (
            "config_digest",
            "config_from_dict",
            "default_config_path",
            "load_config",
            "to_dict",
            "to_yaml",
        )
    },
}

if TYPE_CHECKING:
    from raytrain_ext.config.loader import (
        config_digest,
        config_from_dict,
        default_config_path,
        load_config,
        to_dict,
        to_yaml,
    )
    from raytrain_ext.config.schema import TrainConfig
    from raytrain_ext.errors import ConfigError


__getattr__ = exporter(globals(), _EXPORTS)


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
