"""Which strategy a run uses: the one place that knows every strategy class.

Imported by the training loop only; the strategies import their base (``strategy.py``)
and the helpers they share, never this module, so the package has no import cycle.
"""

from __future__ import annotations

from typing import Any, Dict, Type

from raytrain_ext.config.choices import StrategyName
from raytrain_ext.models.spec import ModelSpec
from raytrain_ext.parallel.ddp import DDPStrategy
from raytrain_ext.parallel.ep import ExpertParallelStrategy, FSDPExpertParallelStrategy
from raytrain_ext.parallel.fsdp import FSDPStrategy
from raytrain_ext.parallel.pp import PipelineStrategy
from raytrain_ext.parallel.strategy import Strategy
from raytrain_ext.parallel.zero import ZeroStrategy

STRATEGIES: Dict[str, Type[Strategy]] = {
    StrategyName.ddp: DDPStrategy,
    StrategyName.fsdp: FSDPStrategy,
    StrategyName.zero: ZeroStrategy,
}


def build_strategy(parallel_cfg: Any, spec: ModelSpec) -> Strategy:
    """The strategy named by ``parallel.strategy``; it reads its options from the section
    and learns about the model from its spec only."""
    name = parallel_cfg.strategy
    if name not in STRATEGIES:
        raise ValueError(
            f"parallel.strategy: unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}"
        )
    if parallel_cfg.pp > 1:  # pipeline stages, each data-parallel under the named strategy
        return PipelineStrategy(parallel_cfg, spec, STRATEGIES[name](parallel_cfg, spec))
    if parallel_cfg.ep > 1:  # DDP or FSDP with the MoE experts sharded over groups of ep ranks
        if name == "fsdp":
            return FSDPExpertParallelStrategy(parallel_cfg, spec)
        return ExpertParallelStrategy(parallel_cfg, spec)
    return STRATEGIES[name](parallel_cfg, spec)
