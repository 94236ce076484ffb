"""The hardware and the per-step workload a plan is made for."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytrain_ext.ops.plan.shape import PlanError
from raytrain_ext.parallel.config import Precision

GIB = 2**30
INTRA_NODE = ("nvlink", "pcie")
INTER_NODE = ("ib", "ethernet")


@dataclass(frozen=True)
class Cluster:
    """Identical nodes; ``intra`` links GPUs of a node, ``inter`` links nodes."""

    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float
    host_mem_gib: float = 1024.0
    intra: str = "nvlink"
    inter: str = "ib"

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def max_tp(self) -> int:
        """TP all-reduces every layer: keep it inside one NVLink domain (2 GPUs over PCIe)."""
        return self.gpus_per_node if self.intra == "nvlink" else min(2, self.gpus_per_node)


@dataclass(frozen=True)
class Settings:
    """Per-GPU workload and safety margins.

    ``headroom`` is the fraction of GPU (and host) memory kept free for the
    CUDA context, NCCL buffers, allocator fragmentation and temporaries the
    model does not count; ``host_buffer_factor`` is DeepSpeed's
    ``additional_buffer_factor`` for pinned host buffers.
    """

    micro_batch: int
    seq_len: int
    precision: str = "bf16"
    headroom: float = 0.15
    host_buffer_factor: float = 1.5
    meta_init: bool = False
    flash_attention: bool = True


def validate_cluster(cluster: Cluster) -> None:
    for flag, value in (("--nodes", cluster.nodes), ("--gpus-per-node", cluster.gpus_per_node)):
        if not isinstance(value, int) or value <= 0:
            raise PlanError(f"{flag} must be a positive integer, got {value!r}")
    if not (math.isfinite(cluster.gpu_mem_gib) and cluster.gpu_mem_gib > 0):
        raise PlanError(
            f"--gpu-mem-gb must be a positive number of GiB such as 80, got {cluster.gpu_mem_gib!r}"
        )
    if not (math.isfinite(cluster.host_mem_gib) and cluster.host_mem_gib >= 0):
        raise PlanError(f"--host-mem-gb must be >= 0 GiB per node, got {cluster.host_mem_gib!r}")
    if cluster.intra not in INTRA_NODE:
        raise PlanError(f"--intra must be one of {INTRA_NODE}, got {cluster.intra!r}")
    if cluster.inter not in INTER_NODE:
        raise PlanError(f"--inter must be one of {INTER_NODE}, got {cluster.inter!r}")


def validate_settings(settings: Settings, model_seq_len: int, seq_from_config: bool) -> None:
    for flag, value in (("--micro-batch", settings.micro_batch), ("--seq", settings.seq_len)):
        if not isinstance(value, int) or value <= 0:
            raise PlanError(f"{flag} must be a positive integer, got {value!r}")
    if seq_from_config and settings.seq_len > model_seq_len:
        raise PlanError(
            f"--seq {settings.seq_len} exceeds model.seq_len {model_seq_len} of the config "
            "(learned positions cap the sequence length); lower --seq or raise model.seq_len"
        )
    if settings.precision not in Precision.values():
        raise PlanError(
            f"--precision must be one of {Precision.values()}, got {settings.precision!r}"
        )
    if not 0 <= settings.headroom < 0.9:
        raise PlanError(
            f"--headroom is a fraction of memory kept free, in [0, 0.9), got {settings.headroom}"
        )
    if not settings.host_buffer_factor >= 1:
        raise PlanError(f"--host-buffer-factor must be >= 1, got {settings.host_buffer_factor}")
