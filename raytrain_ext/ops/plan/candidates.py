"""The layouts worth comparing for one model on one cluster, and checks of a user's split.

Data-parallel strategies use every GPU as a data-parallel rank.  Model-parallel
splits put tensor parallelism inside a node's NVLink domain (it all-reduces
activations twice per layer), pipeline stages across nodes (one point-to-point
send per micro-batch) and the remaining ranks in data parallelism with a
sharded optimizer (ZeRO-1, Megatron's distributed optimizer).  Expert
parallelism for MoE is carved out of the data-parallel ranks of one node, so
its all-to-all stays on NVLink.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

from raytrain_ext.ops.plan.cluster import Cluster
from raytrain_ext.ops.plan.memory import Layout
from raytrain_ext.ops.plan.shape import ModelShape, PlanError


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def data_parallel_layouts(cluster: Cluster) -> List[Layout]:
    """DDP, ZeRO 1/2/3 with and without CPU offload, FSDP and (multi-node) HSDP."""
    n, ds = cluster.gpus, "deepspeed"
    layouts = [
        Layout("DDP", dp=n),
        Layout("ZeRO-1", dp=n, zero_stage=1, engine=ds),
        Layout("ZeRO-1 + CPU offload", dp=n, zero_stage=1, offload_optimizer=True, engine=ds),
        Layout("ZeRO-2", dp=n, zero_stage=2, engine=ds),
        Layout("ZeRO-2 + CPU offload", dp=n, zero_stage=2, offload_optimizer=True, engine=ds),
        Layout("ZeRO-3", dp=n, zero_stage=3, engine=ds),
        Layout(
            "ZeRO-3 + CPU offload (optimizer)",
            dp=n,
            zero_stage=3,
            offload_optimizer=True,
            engine=ds,
        ),
        Layout(
            "ZeRO-3 + CPU offload (optimizer+params)",
            dp=n,
            zero_stage=3,
            offload_optimizer=True,
            offload_params=True,
            engine=ds,
        ),
        Layout("FSDP (full shard)", dp=n, zero_stage=3, gather_unit="block"),
    ]
    if cluster.nodes > 1:
        layouts.append(
            Layout(
                "HSDP (shard in node, replicate across nodes)",
                dp=n,
                zero_stage=3,
                shard_group=cluster.gpus_per_node,
                gather_unit="block",
            )
        )
    return layouts


def choose_ep(shape: ModelShape, dp: int, tp: int, cluster: Cluster) -> int:
    """Largest expert-parallel degree that divides the experts and ``dp`` and fits in a node."""
    if not shape.is_moe:
        return 1
    in_node = max(1, cluster.gpus_per_node // tp)
    return max(e for e in divisors(shape.num_experts) if dp % e == 0 and e <= in_node)


def with_ep(layout: Layout, shape: ModelShape, cluster: Cluster) -> Layout:
    """``layout`` with expert parallelism added for a MoE model (unchanged when dense)."""
    ep = choose_ep(shape, layout.dp, layout.tp, cluster)
    if ep == 1:
        return layout
    if layout.shard_group and layout.shard_group % ep:
        return layout
    return replace(layout, ep=ep, name=f"{layout.name} + EP={ep}")


def model_parallel_layout(
    shape: ModelShape, cluster: Cluster, tp: int, pp: int, ep: int = 1
) -> Layout:
    dp = cluster.gpus // (tp * pp)
    name = "TP x DP (ZeRO-1)" if pp == 1 else "TP x PP x DP (ZeRO-1)"
    if ep > 1:
        name = name.replace(" x DP", " x EP x DP")
    return Layout(name, dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=1)


def model_parallel_splits(shape: ModelShape, cluster: Cluster, pipeline: bool) -> List[Layout]:
    """Valid (tp, pp) splits with ``tp >= 2`` inside a node; ``pipeline`` selects ``pp > 1``.

    Order is preference.  Without pipelining: the smallest TP first (least
    activation traffic).  With pipelining: the largest in-node TP (a smaller
    one at the same stage count only needs more memory) and the fewest stages
    first (smallest bubble).
    """
    tps = [t for t in divisors(cluster.max_tp()) if t >= 2 and shape.n_heads % t == 0]
    if pipeline:
        tps = tps[-1:]
    pps = [p for p in divisors(shape.n_layers) if p > 1] if pipeline else [1]
    return [
        with_ep(model_parallel_layout(shape, cluster, tp, pp), shape, cluster)
        for pp in pps
        for tp in tps
        if cluster.gpus % (tp * pp) == 0
    ]


def user_split(shape: ModelShape, cluster: Cluster, tp: int, pp: int, ep: Optional[int]) -> Layout:
    """Validate ``--tp/--pp/--ep`` and build that layout; errors say which degree to change."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--ep", ep if ep is not None else 1)):
        if not isinstance(value, int) or value <= 0:
            raise PlanError(f"{flag} must be a positive integer, got {value!r}")
    if cluster.gpus % (tp * pp):
        raise PlanError(
            f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the {cluster.gpus} GPUs "
            f"({cluster.nodes} nodes x {cluster.gpus_per_node}); choose degrees whose "
            f"product divides {cluster.gpus}"
        )
    if shape.n_heads % tp:
        raise PlanError(
            f"--tp {tp} does not divide the {shape.n_heads} attention heads; "
            f"use one of {[d for d in divisors(shape.n_heads) if d <= cluster.gpus]}"
        )
    if shape.n_layers % pp:
        raise PlanError(
            f"--pp {pp} does not divide the {shape.n_layers} layers; "
            f"use one of {divisors(shape.n_layers)}"
        )
    dp = cluster.gpus // (tp * pp)
    ep = choose_ep(shape, dp, tp, cluster) if ep is None else ep
    if ep > 1 and not shape.is_moe:
        raise PlanError(f"--ep {ep} needs a mixture-of-experts model (--experts > 0); use --ep 1")
    if dp % ep or (shape.is_moe and shape.num_experts % ep):
        raise PlanError(
            f"--ep {ep} must divide both the data-parallel degree {dp} "
            f"(GPUs / (tp x pp)) and the {shape.num_experts} experts"
        )
    return model_parallel_layout(shape, cluster, tp, pp, ep)
