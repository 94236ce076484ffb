"""The ``parallel`` section: the strategy (one per entry of
``parallel.catalog.STRATEGY_CATALOG``), the layout of the world, the process group and
ZeRO's options.  The layout's arithmetic with the world size and the batch is checked in
``config.validate`` (it spans ``scaling``, ``data`` and ``model``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional

from raytrain_ext.parallel.catalog import STRATEGY_CATALOG
from raytrain_ext.typed_config.choice import Choice, choice_from_values
from raytrain_ext.typed_config.fields import positive


class Backend(Choice):
    """``parallel.backend``: the process-group backend; auto is nccl on GPU, gloo on CPU."""

    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class Precision(Choice):
    """A concrete training precision (the planner's ``--precision``)."""

    bf16 = "bf16"
    fp32 = "fp32"


class MixedPrecision(Choice):
    """``parallel.mixed_precision``: auto is bf16 on GPU, fp32 on CPU."""

    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


class Offload(Choice):
    """``parallel.zero.offload_optimizer``/``offload_param``: where ZeRO offloads to (nvme and any
    parameter offload need stage 3)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


if TYPE_CHECKING:  # members known at run time only (typed_config.choice)

    class StrategyName(Choice): ...

    class PipelineSchedule(Choice): ...

else:
    StrategyName = choice_from_values(
        "StrategyName",
        __name__,
        "``parallel.strategy``: DDP, FSDP2, or DeepSpeed ZeRO (configured by ``parallel.zero``); "
        "one per entry of ``parallel.catalog.STRATEGY_CATALOG``.",
        *STRATEGY_CATALOG,
    )
    PipelineSchedule = choice_from_values(
        "PipelineSchedule",
        __name__,
        "``parallel.pp_schedule``: all forwards then all backwards (gpipe), or one forward "
        "one backward once the pipeline is full (1f1b, less activation memory).",
        "gpipe",
        "1f1b",
    )


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO (``parallel.strategy: zero``); the DeepSpeed JSON config is generated
    from these keys, ``optim.*`` and ``data.micro_batch_size``; ``extra`` is merged last."""

    stage: int = 2  # 1: optimizer state, 2: + gradients, 3: + parameters sharded
    offload_optimizer: Offload = Offload.none
    offload_param: Offload = Offload.none  # stage 3 only
    nvme_path: Optional[str] = None  # directory for nvme offload
    extra: Dict[str, Any] = field(default_factory=dict)  # raw DeepSpeed keys, merged last
    # also write DeepSpeed's own save_checkpoint files into every checkpoint (same manifest
    # and tiers), and restore through load_checkpoint at the same world size and stage
    native_checkpoint: bool = False


@dataclass
class ParallelConfig:
    """Distribution strategy, the layout of the world, and the process group it runs on.

    The world splits as ``dp_replicate x dp_shard x tp`` (x ``pp``); ``dp_shard``
    is whatever is left of the world size.  ``tp > 1``, ``dp_replicate > 1``
    (HSDP: replicate across groups, shard within) and the memory/speed options
    need ``strategy: fsdp``.  ``pp > 1`` splits the blocks into pipeline stages
    (``strategy: ddp`` or ``fsdp`` over each stage's data-parallel group).
    ``ep > 1`` shards the experts of an MoE model over groups of ``ep``
    consecutive data-parallel ranks (tokens exchanged all-to-all; ``strategy:
    ddp`` or ``fsdp``, any ``tp`` and ``pp``; no ``dp_replicate``).
    """

    strategy: StrategyName = StrategyName("ddp")
    backend: Backend = Backend.auto
    timeout_s: float = positive(120.0)
    mixed_precision: MixedPrecision = MixedPrecision.auto
    tp: int = 1  # tensor-parallel degree (consecutive ranks, keep it within a node)
    # with tp > 1: the residual stream, LayerNorms and embeddings split along the sequence
    sequence_parallel: bool = False
    dp_replicate: int = 1  # HSDP replica groups; dp_shard = world / (dp_replicate x tp x pp)
    pp: int = 1  # pipeline stages (blocks split by layer count; strategy ddp or fsdp)
    # each micro-batch of the schedule holds data.micro_batch_size samples
    pp_schedule: PipelineSchedule = PipelineSchedule("1f1b")
    ep: int = 1  # expert-parallel degree: MoE experts sharded over ep data-parallel ranks
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    cpu_offload: bool = False  # FSDP CPUOffloadPolicy: sharded params/grads/optimizer on host
    compile: bool = False  # torch.compile each transformer block
    zero: ZeroConfig = field(default_factory=ZeroConfig)  # strategy: zero
