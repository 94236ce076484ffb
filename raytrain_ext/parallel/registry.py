"""Which strategy a run uses: the class its catalog entry names, wrapped for pipeline stages.

Imported by the training loop only; the strategies import their base (``strategy.py``)
and the helpers they share, never this module, so the package has no import cycle.
"""

from __future__ import annotations

from typing import Any

from raytrain_ext.models.spec import ModelSpec
from raytrain_ext.parallel.catalog import capabilities, load_class
from raytrain_ext.parallel.strategy import Strategy

# torch.distributed.pipelining costs a rank 0.35 s to import: loaded when a run has stages
PIPELINE_IMPLEMENTATION = "raytrain_ext.parallel.pp:PipelineStrategy"


def build_strategy(parallel_cfg: Any, spec: ModelSpec) -> Strategy:
    """The strategy named by ``parallel.strategy`` (its class from
    :data:`raytrain_ext.parallel.catalog.STRATEGY_CATALOG`); it reads its options from the
    section and learns about the model from its spec only."""
    caps = capabilities(parallel_cfg.strategy)
    strategy_class = load_class(caps.implementation)
    if parallel_cfg.pp > 1:  # pipeline stages, each data-parallel under the named strategy
        pipeline_class = load_class(PIPELINE_IMPLEMENTATION)
        return pipeline_class(parallel_cfg, spec, strategy_class(parallel_cfg, spec))
    if parallel_cfg.ep > 1:  # the experts sharded over groups of ep ranks
        if caps.expert_parallel is None:  # the driver's layout check refuses this first
            raise ValueError(f"parallel.ep > 1: {parallel_cfg.strategy} has no expert parallelism")
        return load_class(caps.expert_parallel)(parallel_cfg, spec)
    return strategy_class(parallel_cfg, spec)
