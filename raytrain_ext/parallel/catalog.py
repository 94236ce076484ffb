"""What each distribution strategy supports, readable on the driver without torch.

A strategy is one module holding its class plus one line in ``STRATEGY_CATALOG``: where
its class lives and what it supports.  The driver's layout checks (``parallel/dims.py``,
``config/validate.py``), the loop's choice of live state and the worker's strategy
builder (``parallel/registry.py``) read these declarations; nothing else compares a
strategy's name (``tests/unit/test_seams.py`` forbids it).

Invariant: every member of ``parallel.config.StrategyName`` has an entry, and every entry's
class paths import (``tests/unit/test_strategy_interface.py``).  This module imports no
torch: the driver validates a config before any worker exists.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Dict, Optional


class LiveState(StrEnum):
    """What a group re-formed in place takes from its live ranks instead of a checkpoint."""

    replicated = "replicated"  # every rank holds the whole state: one live peer hands it over
    replica_shards = "replica_shards"  # HSDP: each shard is held by a rank of another replica
    own_shards = "own_shards"  # each rank keeps its own shards; a restore reads only the others
    none = "none"  # nothing: the state comes from the newest checkpoint (DeepSpeed saves its own)


@dataclass(frozen=True)
class StrategyCapabilities:
    """What a strategy supports.  ``live_state`` is for a purely data-parallel layout with
    one replica group; :func:`live_state` derives it for any layout."""

    label: str  # how messages name the strategy ("FSDP")
    implementation: str  # "module:Class" of the strategy
    tensor_parallel: bool = False  # DTensor TP parameters: parallel.tp > 1
    pipeline_stages: bool = False  # the data-parallel strategy of each stage: parallel.pp > 1
    expert_parallel: Optional[str] = None  # "module:Class" of its parallel.ep > 1 variant
    replica_groups: bool = False  # HSDP: parallel.dp_replicate > 1
    layer_options: bool = False  # activation_checkpointing, cpu_offload, compile
    lockstep_microbatches: bool = False  # every rank must run the same number of forwards
    native_checkpoint: bool = False  # parallel.zero.native_checkpoint: its own file format
    # "module:function" checking its own options on the driver:
    # fn(parallel_cfg, global_batch, micro_batch, world_sizes), raising ValueError
    config_check: Optional[str] = None
    live_state: LiveState = LiveState.none


_EP = "raytrain_ext.parallel.ep"

STRATEGY_CATALOG: Dict[str, StrategyCapabilities] = {
    "ddp": StrategyCapabilities(
        label="DDP",
        implementation="raytrain_ext.parallel.ddp:DDPStrategy",
        pipeline_stages=True,
        expert_parallel=f"{_EP}:ExpertParallelStrategy",
        live_state=LiveState.replicated,
    ),
    "fsdp": StrategyCapabilities(
        label="FSDP",
        implementation="raytrain_ext.parallel.fsdp:FSDPStrategy",
        tensor_parallel=True,
        pipeline_stages=True,
        expert_parallel=f"{_EP}:FSDPExpertParallelStrategy",
        replica_groups=True,
        layer_options=True,
        lockstep_microbatches=True,
        live_state=LiveState.own_shards,
    ),
    "zero": StrategyCapabilities(
        label="DeepSpeed ZeRO",
        implementation="raytrain_ext.parallel.zero:ZeroStrategy",
        native_checkpoint=True,
        config_check="raytrain_ext.parallel.zero:check_zero_config",
        live_state=LiveState.none,
    ),
}


def capabilities(name: str) -> StrategyCapabilities:
    """The entry of ``parallel.strategy``; an unknown name is refused naming the choices."""
    if name not in STRATEGY_CATALOG:
        raise ValueError(
            f"parallel.strategy: unknown strategy {name!r}; choose one of "
            f"{', '.join(STRATEGY_CATALOG)}"
        )
    return STRATEGY_CATALOG[name]


def offered(capability: Callable[[StrategyCapabilities], Any]) -> str:
    """The strategies with ``capability``, as a message offers them for the fix: ``fsdp``,
    ``ddp or fsdp``, ``a, b or c``."""
    names = [name for name, caps in STRATEGY_CATALOG.items() if capability(caps)]
    return " or ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " or " + names[-1]


def load_class(path: str) -> Any:
    """The class (or function) at ``module:name``; a strategy's module imports torch, so
    the driver loads only a config check this way."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def data_parallel_only(parallel_cfg) -> bool:
    """No tensor, pipeline or expert sharding."""
    p = parallel_cfg
    return p.tp == 1 and p.pp == 1 and p.ep <= 1


def live_state(parallel_cfg) -> LiveState:
    """What this layout's ranks hold that a re-formed group can take from them: the
    strategy's declaration for plain data parallelism; its own shards once tensor,
    pipeline or expert sharding split the state; replica shards under HSDP."""
    declared = capabilities(parallel_cfg.strategy).live_state
    if declared is LiveState.none:
        return LiveState.none
    if not data_parallel_only(parallel_cfg):
        return LiveState.own_shards
    if declared is LiveState.own_shards and parallel_cfg.dp_replicate > 1:
        return LiveState.replica_shards
    return declared
