"""Which strategy a run uses: the one place that knows every strategy class.

Imported by the training loop only; the strategies import their base (``strategy.py``)
and the helpers they share, never this module, so the package has no import cycle.
"""

from __future__ import annotations

from typing import Any, Dict, Type

from raytrain_ext.parallel.ddp import DDPStrategy
from raytrain_ext.parallel.ep import ExpertParallelStrategy, FSDPExpertParallelStrategy
from raytrain_ext.parallel.fsdp import FSDPStrategy
from raytrain_ext.parallel.pp import PipelineStrategy
from raytrain_ext.parallel.strategy import Strategy
from raytrain_ext.parallel.zero import ZeroStrategy

STRATEGIES: Dict[str, Type[Strategy]] = {
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "zero": ZeroStrategy,
}


def build_strategy(parallel_cfg: Any) -> Strategy:
    """The strategy named by ``parallel.strategy``; it reads its options from the section."""
    name = parallel_cfg.strategy
    if name not in STRATEGIES:
        raise ValueError(
            f"parallel.strategy: unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}"
        )
    if parallel_cfg.pp > 1:  # pipeline stages, each data-parallel under the named strategy
        return PipelineStrategy(parallel_cfg, STRATEGIES[name](parallel_cfg))
    if parallel_cfg.ep > 1:  # DDP or FSDP with the MoE experts sharded over groups of ep ranks
        if name == "fsdp":
            return FSDPExpertParallelStrategy(parallel_cfg)
        return ExpertParallelStrategy(parallel_cfg)
    return STRATEGIES[name](parallel_cfg)
