"""Does one layout fit? Memory per GPU and per node against what the cluster has.

A layout fits when its model states plus activations stay within
``gpu_mem x (1 - headroom)`` per GPU, either as is or with full activation
checkpointing (``recompute``), and the states it offloads fit in
``host_mem x (1 - headroom)`` per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_ext.ops.plan.cluster import GIB, Cluster, Settings
from raytrain_ext.ops.plan.memory import (
    Activations,
    Layout,
    ModelStates,
    activations,
    bytes_per_param,
    host_bytes_per_node,
    model_states,
)
from raytrain_ext.ops.plan.shape import ModelShape, ParamCounts


def gib(n: float) -> float:
    return round(n / GIB, 2)


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    states: ModelStates
    plain: Activations
    checkpointed: Activations
    host: dict
    gpu_usable: float
    host_usable: float

    @property
    def total_plain(self) -> float:
        return self.states.total + self.plain.total

    @property
    def total_checkpointed(self) -> float:
        return self.states.total + self.checkpointed.total

    @property
    def recompute(self) -> Optional[bool]:
        """False: fits as is; True: fits only with full activation checkpointing; None: no fit."""
        if self.total_plain <= self.gpu_usable:
            return False
        return True if self.total_checkpointed <= self.gpu_usable else None

    @property
    def host_ok(self) -> bool:
        return self.host["offload"] <= self.host_usable

    @property
    def fits(self) -> bool:
        return self.recompute is not None and self.host_ok

    @property
    def needed(self) -> float:
        """The GPU bytes of the cheapest variant that fits, else of the smallest variant."""
        return self.total_plain if self.recompute is False else self.total_checkpointed

    def verdict(self) -> str:
        if not self.host_ok:
            return (
                f"no: host RAM {gib(self.host['offload']):.0f} GiB/node > "
                f"{gib(self.host_usable):.0f} usable"
            )
        if self.recompute is None:
            over = self.total_checkpointed - self.gpu_usable
            return (
                f"no: +{gib(over):.1f} GiB ({over / self.gpu_usable:+.0%}) even with checkpointing"
            )
        return "yes, with activation checkpointing" if self.recompute else "yes"

    def rejection(self) -> str:
        """One plain sentence on why this layout was not chosen."""
        name = f"{self.layout.name} [{self.layout.split()}]"
        if not self.host_ok:
            return (
                f"{name} would need {gib(self.host['offload']):.0f} GiB of host RAM per node for its "
                f"offloaded states, more than the {gib(self.host_usable):.0f} GiB usable."
            )
        over = self.total_checkpointed - self.gpu_usable
        return (
            f"{name} needs {gib(self.total_checkpointed):.1f} GiB per GPU even with activation "
            f"checkpointing ({gib(self.states.total):.1f} GiB of model states), "
            f"{gib(over):.1f} GiB ({over / self.gpu_usable:.0%}) over the "
            f"{gib(self.gpu_usable):.1f} GiB usable."
        )

    def to_dict(self) -> dict:
        s, lay = self.states, self.layout
        return {
            "strategy": lay.name,
            "tp": lay.tp,
            "pp": lay.pp,
            "ep": lay.ep,
            "dp": lay.dp,
            "zero_stage": lay.zero_stage,
            "shard_group": lay.sharding,
            "engine": lay.engine,
            "offload_optimizer": lay.offload_optimizer,
            "offload_params": lay.offload_params,
            "per_gpu_gib": {
                "params": gib(s.params),
                "grads": gib(s.grads),
                "optimizer": gib(s.optimizer),
                "gathered": gib(s.gathered),
                "model_states": gib(s.total),
                "activations": gib(self.plain.total),
                "activations_checkpointed": gib(self.checkpointed.total),
                "total": gib(self.total_plain),
                "total_checkpointed": gib(self.total_checkpointed),
                "usable": gib(self.gpu_usable),
            },
            "host_per_node_gib": {k: gib(v) for k, v in self.host.items()},
            "fits": self.fits,
            "activation_checkpointing": self.recompute,
            "verdict": self.verdict(),
        }


def evaluate(
    layout: Layout, shape: ModelShape, counts: ParamCounts, cluster: Cluster, settings: Settings
) -> Evaluation:
    bpp = bytes_per_param(settings.precision, layout.engine)
    states = model_states(counts, layout, bpp)

    def acts(recompute: bool) -> Activations:
        return activations(
            shape,
            settings.micro_batch,
            settings.seq_len,
            layout.tp,
            layout.pp,
            recompute,
            settings.precision,
            settings.flash_attention,
        )

    host = host_bytes_per_node(
        states, counts, cluster.gpus_per_node, settings.meta_init, settings.host_buffer_factor
    )
    keep = 1 - settings.headroom
    return Evaluation(
        layout=layout,
        states=states,
        plain=acts(False),
        checkpointed=acts(True),
        host=host,
        gpu_usable=cluster.gpu_mem_gib * GIB * keep,
        host_usable=cluster.host_mem_gib * GIB * keep,
    )
