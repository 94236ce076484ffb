"""raytrain_ext: elastic distributed training on Ray.

The plain Python API (for notebooks and jobs)::

    from raytrain_ext import Trainer, load_config
    cfg = load_config("configs/tiny_cpu.yaml", overrides=["run.max_steps=20"])
    summary = Trainer(cfg).fit()

The names below are imported on first use: a process that needs one submodule (a
``data prepare`` worker imports ``raytrain_ext.prepare.pipeline``) does not pay for torch
and the trainer (3.3 s of imports per worker here).
"""

from typing import TYPE_CHECKING

from raytrain_ext.lazy_exports import exporter
from raytrain_ext.version import __version__

_EXPORTS = {
    "ConfigError": "raytrain_ext.config",
    "load_config": "raytrain_ext.config",
    "TrainingFailed": "raytrain_ext.elastic.controller",
    "Trainer": "raytrain_ext.trainer",
}

if TYPE_CHECKING:
    from raytrain_ext.config import ConfigError, load_config
    from raytrain_ext.elastic.controller import TrainingFailed
    from raytrain_ext.trainer import Trainer


__getattr__ = exporter(globals(), _EXPORTS)


__all__ = ["ConfigError", "Trainer", "TrainingFailed", "load_config", "__version__"]
