"""The model being planned: its shape and its exact parameter counts.

Counts follow ``raytrain_ext.models.gpt.GPT`` term by term (untied input and
output embeddings, learned positions, bias-free linears, two LayerNorms per
block plus a final one, dense GELU MLP or a stacked-expert MoE), so the total
equals ``sum(p.numel() for p in GPT(cfg).parameters())`` exactly; the tests
build the real model to hold us to that.

A Hugging Face model (``model.source: hf``) is counted by its own layout
(:mod:`.hf_shape`: gated MLP, grouped-query attention, tied or untied ``lm_head``),
read from its ``transformers`` config, exactly as well.

A bare parameter count (``--params 7e9``) has no shape, but activations and
the ZeRO-3 working set need one, so :func:`infer_shape` picks a conventional
GPT shape for that size (see its docstring) and marks it ``inferred``; the
model-state arithmetic keeps using the given total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from raytrain_ext.models.sources import model_source
from raytrain_ext.ops.plan.hf_shape import LlamaLayout, count_llama_params, llama_layout


class PlanError(ValueError):
    """Invalid planner input; the message names the argument and the fix."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture of a GPT as ``ModelConfig`` describes it (``num_experts: 0`` is dense), or
    of a Llama-layout HF model (``llama`` set; ``mlp_ratio`` then only sizes activations)."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    mlp_ratio: int = 4
    num_experts: int = 0
    top_k: int = 2
    inferred: bool = False
    total_params_override: Optional[int] = None
    llama: Optional[LlamaLayout] = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts the memory model needs.

    ``expert`` is the part expert parallelism shards (the stacked expert
    weights); ``largest_module`` is DeepSpeed's "largest layer" (the module
    with the most parameters of its own, what ZeRO-3 gathers at once);
    ``largest_fsdp_unit`` is the biggest unit FSDP gathers when each ``Block``
    is wrapped and the root holds embeddings, final norm and ``lm_head``.
    """

    total: int
    expert: int
    largest_module: int
    largest_fsdp_unit: int

    @property
    def dense(self) -> int:
        return self.total - self.expert


def validate_shape(shape: ModelShape) -> None:
    """Reject shapes the model could not be built with, naming the flag to fix."""
    for flag, value in (
        ("--layers", shape.n_layers),
        ("--hidden", shape.d_model),
        ("--heads", shape.n_heads),
        ("--vocab", shape.vocab_size),
        ("--seq", shape.seq_len),
        ("--mlp-ratio", shape.mlp_ratio),
    ):
        if not isinstance(value, int) or value <= 0:
            raise PlanError(f"{flag} must be a positive integer, got {value!r}")
    if shape.llama is None and shape.d_model % shape.n_heads:
        raise PlanError(
            f"--hidden {shape.d_model} is not divisible by --heads {shape.n_heads}; "
            "choose heads that divide the hidden size"
        )
    if shape.num_experts < 0:
        raise PlanError(f"--experts must be >= 0 (0 = dense), got {shape.num_experts}")
    if shape.is_moe and not 1 <= shape.top_k <= shape.num_experts:
        raise PlanError(
            f"--top-k {shape.top_k} must be between 1 and --experts {shape.num_experts}"
        )
    if shape.total_params_override is not None and shape.total_params_override <= 0:
        raise PlanError(f"--params must be positive, got {shape.total_params_override}")


def count_params(shape: ModelShape) -> ParamCounts:
    """Exact counts for ``GPT(shape)`` (or the HF model); a ``--params`` total replaces the
    computed total."""
    if shape.llama is not None:
        llama = count_llama_params(shape.llama, shape.d_model, shape.n_heads, shape.vocab_size)
        return ParamCounts(
            total=llama.root + shape.n_layers * llama.block,
            expert=0,
            largest_module=llama.largest_module,
            largest_fsdp_unit=max(llama.block, llama.root),
        )
    d, hidden, experts = shape.d_model, shape.mlp_ratio * shape.d_model, shape.num_experts
    attention = 4 * d * d
    norms = 2 * 2 * d
    if shape.is_moe:
        ffn_expert = 2 * experts * d * hidden
        ffn_other = d * experts  # router
    else:
        ffn_expert, ffn_other = 0, 2 * d * hidden
    block = attention + norms + ffn_expert + ffn_other
    embeddings = shape.vocab_size * d + shape.seq_len * d
    root = embeddings + 2 * d + shape.vocab_size * d  # + ln_f + lm_head
    total = root + shape.n_layers * block
    expert = shape.n_layers * ffn_expert
    if shape.total_params_override is not None:
        scale = shape.total_params_override / total
        total, expert = shape.total_params_override, round(expert * scale)
    one_expert = 2 * d * hidden if shape.is_moe else 0  # each expert is its own module
    largest_module = max(shape.vocab_size * d, shape.seq_len * d, d * hidden, one_expert)
    return ParamCounts(
        total=total,
        expert=expert,
        largest_module=largest_module,
        largest_fsdp_unit=max(block, root),
    )


def shape_from_config(model_cfg) -> ModelShape:
    """The shape of ``cfg.model`` from :func:`raytrain_ext.config.load_config` (for
    ``model.source: hf`` the loader already wrote the HF model's layers, hidden size, heads and
    vocabulary there; the rest of its layout comes from its config)."""
    config = model_source(model_cfg).hf_config(model_cfg)
    llama = None if config is None else llama_layout(config)
    return ModelShape(
        n_layers=int(model_cfg.n_layers),
        d_model=int(model_cfg.d_model),
        n_heads=int(model_cfg.n_heads),
        vocab_size=int(model_cfg.vocab_size),
        seq_len=int(model_cfg.seq_len),
        mlp_ratio=int(model_cfg.mlp_ratio),
        num_experts=int(model_cfg.moe.num_experts),
        top_k=int(model_cfg.moe.top_k),
        llama=llama,
    )


def infer_shape(
    total_params: float, vocab_size: int, seq_len: int, mlp_ratio: int = 4
) -> ModelShape:
    """A conventional dense GPT shape with about ``total_params`` parameters.

    Published GPT/Llama shapes keep ``d_model / n_layers`` near 128 (7B:
    4096/32, 175B: 12288/96, 405B: 16384/126) and 128-wide heads, and a layer
    holds about ``12 d^2`` parameters, so ``P = 12 d^3 / 128`` gives ``d``
    (rounded to a multiple of 256); the layer count then absorbs the rest.
    """
    if not total_params or total_params <= 0 or not math.isfinite(total_params):
        raise PlanError(f"--params must be a positive number such as 7e9, got {total_params!r}")
    per_layer_factor = 4 + 2 * mlp_ratio  # attention 4d^2 + MLP 2*r*d^2
    d_model = max(256, round((total_params * 128 / per_layer_factor) ** (1 / 3) / 256) * 256)
    layer_budget = total_params - 2 * vocab_size * d_model - seq_len * d_model
    n_layers = max(1, round(layer_budget / (per_layer_factor * d_model * d_model)))
    return ModelShape(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=d_model // 128,
        vocab_size=vocab_size,
        seq_len=seq_len,
        mlp_ratio=mlp_ratio,
        inferred=True,
        total_params_override=int(total_params),
    )
