"""The run's typed configuration: the sections composed (``schema.py``), loaded (defaults <
YAML < ``key=value``), checked across sections (``validate.py``) and shown.

Each section is declared by the package that reads it (``checkpoint/config.py``,
``elastic/config.py``, ...), with the building blocks of :mod:`raytrain_ext.typed_config`;
the names below are imported on first use.
"""

from typing import TYPE_CHECKING

from raytrain_ext.lazy_exports import exporter

_EXPORTS = {
    "ConfigError": "raytrain_ext.errors",
    "TrainConfig": "raytrain_ext.config.schema",
    **{
        name: "raytrain_ext.config.loader"
        for name in ("config_from_dict", "default_config_path", "load_config", "load_saved_config")
    },
    **{
        name: "raytrain_ext.typed_config.serialize"
        for name in ("config_digest", "to_dict", "to_yaml")
    },
}

if TYPE_CHECKING:
    from raytrain_ext.config.loader import (
        config_from_dict,
        default_config_path,
        load_config,
        load_saved_config,
    )
    from raytrain_ext.config.schema import TrainConfig
    from raytrain_ext.errors import ConfigError
    from raytrain_ext.typed_config.serialize import config_digest, to_dict, to_yaml


__getattr__ = exporter(globals(), _EXPORTS)


__all__ = [
    "ConfigError",
    "TrainConfig",
    "config_digest",
    "config_from_dict",
    "default_config_path",
    "load_config",
    "load_saved_config",
    "to_dict",
    "to_yaml",
]
