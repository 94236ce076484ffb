"""The run's configuration: every section, each declared by the package that reads it.

OmegaConf enforces the types, rejects unknown keys and refuses a value outside a
key's choice enum when YAML files and ``key=value`` overrides are merged onto these
defaults.  Numeric ranges are declared beside each field
(:mod:`raytrain_ext.typed_config.fields`); each section's own checks live beside it, and
:mod:`raytrain_ext.config.validate` runs them and the checks across sections.
Interpolations such as ``${run.seed}`` are resolved on the driver, so workers
always receive plain values.  Only the run's own section (``run``) is declared here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_ext.checkpoint.config import CheckpointConfig
from raytrain_ext.data.config import DataConfig
from raytrain_ext.elastic.config import ElasticConfig, ScalingConfig
from raytrain_ext.faults import ChaosConfig
from raytrain_ext.models.config import ModelConfig
from raytrain_ext.objectives.config import ObjectiveConfig
from raytrain_ext.parallel.config import ParallelConfig
from raytrain_ext.rollout.config import RolloutConfig
from raytrain_ext.train.config import EvalConfig, GuardsConfig, OptimConfig, ProfileConfig
from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import at_least, positive


class Device(Choice):
    """``run.device``: auto is cuda when the worker has a GPU, else cpu."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class RunConfig:
    """Identity and length of a run; ``output_dir/name`` is the run directory."""

    name: str = "tiny"
    output_dir: str = "runs"
    seed: int = at_least(0, 1234)
    max_steps: int = positive(40)
    log_every: int = positive(5)
    device: Device = Device.auto
    tensorboard: bool = True


@dataclass
class TrainConfig:
    """The whole run configuration: every section a run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
