"""Plain-sentence notes where a common belief and the arithmetic of a plan disagree."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from raytrain_ext.ops.plan.evaluation import Evaluation

if TYPE_CHECKING:
    from raytrain_ext.ops.plan.layout import Plan


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def plan_notes(
    plan: "Plan", start: int, cheaper: Optional[Evaluation], requested: Optional[Evaluation]
) -> List[str]:
    notes = [
        _rule_overruled(plan),
        _cheaper_fits(plan, cheaper),
        _zero3_without_offload(plan),
        _pipeline_activations(plan),
        _model_init_host(plan),
        _inferred_shape(plan),
        _pcie(plan),
        _moe(plan),
        _requested(requested),
    ]
    return [n for n in notes if n]


def _rule_overruled(plan: "Plan") -> Optional[str]:
    if plan.rule_held:
        return None
    outcome = (
        f"the numbers escalate to {plan.recommended.layout.name}"
        if plan.recommended
        else "nothing on the ladder fits"
    )
    return f"The rule of thumb ({plan.rule}) does not fit here; {outcome}. {plan.rejected[0].rejection()}"


def _cheaper_fits(plan: "Plan", cheaper: Optional[Evaluation]) -> Optional[str]:
    """A layout simpler than the rule's also fits: the rule is conservative for this cluster."""
    if cheaper is None or plan.recommended is None:
        return None
    ckpt = ", with activation checkpointing" if cheaper.recompute else ""
    head = (
        f"The rule of thumb suggests {plan.rule}, but {cheaper.layout.name} also fits "
        f"({_gib(cheaper.needed)} per GPU{ckpt})"
    )
    if cheaper.layout.zero_stage < 3:
        return (
            head + " and moves less data per step (DDP and ZeRO-1/2 communicate 2x the model "
            "size, ZeRO-3/FSDP 3x: parameters are all-gathered again for the backward); prefer it "
            "unless the memory left over is needed for larger micro-batches."
        )
    return (
        head + f" without tensor or pipeline parallelism, at the cost of all-gathering every "
        f"parameter across all {plan.cluster.gpus} GPUs twice per step; measure both before choosing."
    )


def _zero3_without_offload(plan: "Plan") -> Optional[str]:
    """The belief that ZeRO-3 alone makes a large model fit on one (or a few) GPUs."""
    rows = {ev.layout.name: ev for ev in plan.rows}
    zero3 = rows.get("ZeRO-3")
    offload = rows.get("ZeRO-3 + CPU offload (optimizer+params)")
    if zero3 is None or offload is None or zero3.fits:
        return None
    n = plan.cluster.gpus
    gpus = "a single GPU it shards nothing" if n == 1 else f"{n} GPUs it divides them by {n}"
    text = (
        f"'ZeRO-3 trains a {plan.counts.total / 1e9:.0f}B model on {'one GPU' if n == 1 else 'few GPUs'}' "
        f"holds only with offload: ZeRO-3 partitions the 18 B/param of model states across the "
        f"data-parallel GPUs, and on {gpus}: {_gib(zero3.states.total)} of model states per GPU "
        f"against {_gib(zero3.gpu_usable)} usable. With optimizer and parameters offloaded to CPU the "
        f"GPU keeps {_gib(offload.needed)} (largest layer gathered + activations), but each node then "
        f"needs {_gib(offload.host['offload'])} of host RAM (18 B/param of its share x "
        f"{plan.settings.host_buffer_factor} buffer)"
    )
    if offload.host_ok:
        return (
            text
            + f", within the {_gib(offload.host_usable)} usable; every step then waits on PCIe transfers and CPU Adam."
        )
    return (
        text + f", more than the {_gib(offload.host_usable)} usable: it would take NVMe offload "
        "(ZeRO-Infinity), more host RAM or more GPUs."
    )


def _pipeline_activations(plan: "Plan") -> Optional[str]:
    rec = plan.recommended
    if rec is None or rec.layout.pp == 1:
        return None
    pp, layers = rec.layout.pp, plan.shape.n_layers
    acts = rec.checkpointed if rec.recompute else rec.plain
    return (
        f"With {pp} pipeline stages under 1F1B the first stage holds {pp} micro-batches of "
        f"{layers // pp} layers, as much activation memory as the whole model for one micro-batch "
        f"({_gib(acts.total)} here): pipelining shrinks model states, not activations."
    )


def _model_init_host(plan: "Plan") -> Optional[str]:
    rec = plan.recommended
    if rec is None or plan.settings.meta_init or rec.host["model_init"] <= rec.host_usable:
        return None
    return (
        f"Start-up: building the full fp32 model on the CPU in each of the {plan.cluster.gpus_per_node} "
        f"ranks of a node (as raytrain_ext.models.build_model does) needs {_gib(rec.host['model_init'])} "
        f"of host RAM per node, more than the {_gib(rec.host_usable)} usable; initialise on the meta "
        "device and materialise only the local shard (--meta-init plans for that)."
    )


def _inferred_shape(plan: "Plan") -> Optional[str]:
    s = plan.shape
    if not s.inferred:
        return None
    return (
        f"Only a parameter count was given: activations and the gathered ZeRO-3/FSDP unit assume a "
        f"typical shape of {s.n_layers} layers, hidden {s.d_model}, {s.n_heads} heads, vocab "
        f"{s.vocab_size}; pass --layers/--hidden/--heads (or --config) for exact figures."
    )


def _pcie(plan: "Plan") -> Optional[str]:
    c = plan.cluster
    if c.intra != "pcie" or c.gpus_per_node <= 2:
        return None
    return (
        "GPUs within a node talk over PCIe: tensor parallelism is limited to 2 (it all-reduces "
        "activations in every layer), so a model needing more sharding gets pipeline stages instead."
    )


def _moe(plan: "Plan") -> Optional[str]:
    s, c = plan.shape, plan.counts
    if not s.is_moe:
        return None
    active = c.dense + c.expert * s.top_k / s.num_experts
    ep = plan.recommended.layout.ep if plan.recommended else 1
    where = (
        f"EP={ep} shards them across GPUs of a node (all-to-all over the NVLink domain)"
        if ep > 1
        else "no expert-parallel degree divides both the experts and the data-parallel GPUs of a node"
    )
    return (
        f"MoE: {c.expert / 1e9:.2f}B of the {c.total / 1e9:.2f}B parameters are in {s.num_experts} "
        f"experts; {where}. Memory follows the total parameters, compute per token the "
        f"{active / 1e9:.2f}B active ones (top-{s.top_k})."
    )


def _requested(requested: Optional[Evaluation]) -> Optional[str]:
    if requested is None:
        return None
    verdict = "fits" if requested.fits else f"does not fit: {requested.rejection()}"
    ckpt = " (with activation checkpointing)" if requested.fits and requested.recompute else ""
    return f"Requested split {requested.layout.split()} {verdict}{ckpt}".rstrip(".") + "."
