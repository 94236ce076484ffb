"""The recommended layout: the usual rule of thumb, checked and overruled by the arithmetic.

Rule of thumb by total parameters: DDP under ~1B; FSDP/ZeRO-3 for 1B-10B;
tensor parallelism inside a node's NVLink domain x data parallelism up to
~70B (we draw the line at 80B); TP=8 x pipeline stages across nodes x DP
beyond; expert parallelism on top for MoE models.

The planner walks an escalation ladder (DDP, ZeRO-1, ZeRO-2, HSDP/FSDP,
TP x DP, TP x PP x DP) upward from the rule's rung, then the simpler rungs
below it, then CPU offload, and takes the first layout that fits (:mod:`raytrain_ext.ops.plan.evaluation`),
trying each candidate first without, then with full activation
checkpointing.  Every rejected
candidate gets a sentence saying by how much it misses, and the plan says
where the rule and the numbers disagree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

from raytrain_ext.ops.plan.candidates import (
    data_parallel_layouts,
    model_parallel_splits,
    user_split,
    with_ep,
)
from raytrain_ext.ops.plan.cluster import Cluster, Settings, validate_cluster, validate_settings
from raytrain_ext.ops.plan.evaluation import Evaluation, evaluate
from raytrain_ext.ops.plan.memory import Layout
from raytrain_ext.ops.plan.notes import plan_notes
from raytrain_ext.ops.plan.shape import ModelShape, ParamCounts, count_params, validate_shape

RUNGS = (
    "DDP",
    "ZeRO-1",
    "ZeRO-2",
    "FSDP / ZeRO-3",
    "TP within a node x DP",
    "TP x PP across nodes x DP",
    "CPU offload",
)
RULE_BANDS = ((1e9, 0), (1e10, 3), (8e10, 4), (float("inf"), 5))


def rule_rung(total_params: int) -> int:
    return next(rung for limit, rung in RULE_BANDS if total_params < limit)


@dataclass
class Plan:
    shape: ModelShape
    counts: ParamCounts
    cluster: Cluster
    settings: Settings
    rows: List[Evaluation]
    rule: str
    recommended: Optional[Evaluation]
    rejected: List[Evaluation] = field(default_factory=list)
    rule_held: bool = True
    notes: List[str] = field(default_factory=list)

    def explanation(self) -> List[str]:
        lines = [f"Rule of thumb for {self.counts.total / 1e9:.2f}B parameters: {self.rule}."]
        lines += [f"Rejected: {ev.rejection()}" for ev in self.rejected]
        rec = self.recommended
        if rec is None:
            lines.append(
                "No layout fits this cluster; add GPUs, use GPUs with more memory, "
                "shorten --seq or lower --micro-batch."
            )
            return lines
        ckpt = " with full activation checkpointing" if rec.recompute else ""
        lines.append(
            f"Chosen: {rec.layout.name} [{rec.layout.split()}]{ckpt}: "
            f"{rec.needed / 2**30:.1f} GiB of {rec.gpu_usable / 2**30:.1f} GiB usable per GPU "
            f"({rec.states.total / 2**30:.1f} GiB model states + "
            f"{(rec.needed - rec.states.total) / 2**30:.1f} GiB activations)."
        )
        return lines

    def to_dict(self) -> dict:
        shape = {k: v for k, v in asdict(self.shape).items() if k != "total_params_override"}
        return {
            "model": {
                **shape,
                "params_total": self.counts.total,
                "params_expert": self.counts.expert,
                "largest_module_params": self.counts.largest_module,
                "largest_fsdp_unit_params": self.counts.largest_fsdp_unit,
            },
            "cluster": {**vars(self.cluster), "gpus": self.cluster.gpus},
            "settings": vars(self.settings),
            "strategies": [ev.to_dict() for ev in self.rows],
            "rule_of_thumb": self.rule,
            "rule_of_thumb_held": self.rule_held,
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "rejected": [ev.rejection() for ev in self.rejected],
            "explanation": self.explanation(),
            "notes": self.notes,
        }


def ladder(shape: ModelShape, cluster: Cluster) -> List[List[Layout]]:
    """Candidate layouts per rung of :data:`RUNGS`, each list in preference order."""
    dp = {lay.name: lay for lay in data_parallel_layouts(cluster)}
    sharded = [dp["FSDP (full shard)"]]
    if cluster.nodes > 1:
        hsdp = dp["HSDP (shard in node, replicate across nodes)"]
        sharded = [hsdp] + sharded if cluster.inter == "ethernet" else sharded + [hsdp]
    rungs = [
        [dp["DDP"]],
        [dp["ZeRO-1"]],
        [dp["ZeRO-2"]],
        sharded,
        model_parallel_splits(shape, cluster, pipeline=False),
        model_parallel_splits(shape, cluster, pipeline=True),
        [
            dp["ZeRO-2 + CPU offload"],
            dp["ZeRO-3 + CPU offload (optimizer)"],
            dp["ZeRO-3 + CPU offload (optimizer+params)"],
        ],
    ]
    return [[with_ep(lay, shape, cluster) for lay in rung] for rung in rungs]


def climb(
    shape, counts, cluster, settings, start: int
) -> Tuple[Optional[Evaluation], List[Evaluation], int]:
    """First fitting layout, those rejected on the way, and its rung.

    From the rule's rung up through the model-parallel rungs, then down through
    the simpler rungs the rule skipped, and CPU offload (slowest) last.
    """
    rejected: List[Evaluation] = []
    rungs = ladder(shape, cluster)
    offload = len(rungs) - 1
    for index in list(range(start, offload)) + list(range(start - 1, -1, -1)) + [offload]:
        for layout in rungs[index]:
            ev = evaluate(layout, shape, counts, cluster, settings)
            if ev.fits:
                return ev, rejected, index
            rejected.append(ev)
    return None, rejected, len(rungs)


def cheaper_fit(shape, counts, cluster, settings, start: int) -> Optional[Evaluation]:
    """A layout below the rule's rung (less communication) that also fits, if any."""
    for rung in ladder(shape, cluster)[:start]:
        for layout in rung:
            ev = evaluate(layout, shape, counts, cluster, settings)
            if ev.fits:
                return ev
    return None


def make_plan(
    shape: ModelShape,
    cluster: Cluster,
    settings: Settings,
    split: Optional[Tuple[int, int, Optional[int]]] = None,
    seq_from_config: bool = False,
) -> Plan:
    """Validate the inputs, evaluate every strategy and pick the layout (see module docstring)."""
    validate_shape(shape)
    validate_cluster(cluster)
    validate_settings(settings, shape.seq_len, seq_from_config)
    requested = user_split(shape, cluster, *split) if split else None
    counts = count_params(shape)
    start = rule_rung(counts.total)
    recommended, rejected, chosen_rung = climb(shape, counts, cluster, settings, start)
    rows = [
        evaluate(lay, shape, counts, cluster, settings) for lay in data_parallel_layouts(cluster)
    ]
    extra = [requested] if requested else []
    if recommended is not None and recommended.layout not in [r.layout for r in rows] + extra:
        extra.append(recommended.layout)
    if not any(lay.tp > 1 or lay.pp > 1 for lay in extra):
        extra += best_model_parallel(shape, counts, cluster, settings)
    rows += [evaluate(lay, shape, counts, cluster, settings) for lay in extra]
    plan = Plan(
        shape=shape,
        counts=counts,
        cluster=cluster,
        settings=settings,
        rows=rows,
        rule=RUNGS[start],
        recommended=recommended,
        rejected=rejected,
        rule_held=chosen_rung == start,
    )
    plan.notes = plan_notes(
        plan,
        start,
        cheaper_fit(shape, counts, cluster, settings, start),
        next((r for r in rows if r.layout == requested), None),
    )
    return plan


def best_model_parallel(shape, counts, cluster, settings) -> List[Layout]:
    """The first fitting TP(xPP) split for the table, else the most sharded one tried."""
    splits = model_parallel_splits(shape, cluster, pipeline=False) + model_parallel_splits(
        shape, cluster, pipeline=True
    )
    for layout in splits:
        if evaluate(layout, shape, counts, cluster, settings).fits:
            return [layout]
    return [max(splits, key=lambda lay: lay.tp * lay.pp)] if splits else []
