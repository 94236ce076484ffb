"""raytrain_ext: elastic distributed training on Ray.

The plain Python API (for notebooks and jobs)::

    from raytrain_ext import Trainer, load_config
    cfg = load_config("configs/tiny_cpu.yaml", overrides=["run.max_steps=20"])
    summary = Trainer(cfg).fit()
"""

from raytrain_ext.config import ConfigError, load_config
from raytrain_ext.elastic.controller import TrainingFailed
from raytrain_ext.trainer import Trainer
from raytrain_ext.version import __version__

__all__ = ["ConfigError", "Trainer", "TrainingFailed", "load_config", "__version__"]
