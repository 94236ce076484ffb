"""How tensor and sequence parallelism cut a Llama-layout Hugging Face causal LM.

Everything is derived from the model's own names, not written per family:

- the per-layer splits are the family's ``config.base_model_tp_plan`` (what ``transformers``
  ships: q/k/v and gate/up ``colwise``, o/down ``rowwise``), turned into torch styles; a
  style without a torch equivalent here is refused by name;
- the sublayers that hold those splits (``self_attn``, ``mlp``) are the parents of the plan's
  entries; the other children of a decoder layer that hold parameters are its residual norms
  (``input_layernorm``, ``post_attention_layernorm``);
- the ends of the model are ``get_input_embeddings()`` / ``get_output_embeddings()`` and the
  base model's other parameter-holding child (the final ``norm``).

Without sequence parallelism the residual stream between layers, the norms, the embeddings and
``lm_head`` stay replicated (two all-reduces per layer forward, as Megatron does).

With ``parallel.sequence_parallel`` (torchtitan's Llama plan) the residual stream and the norms
hold ``seq / tp`` positions per rank: the embedding is split by rows (vocabulary) and its output
reduce-scattered along the sequence (``Shard(1)``); each sublayer all-gathers its input
(``PrepareModuleInput``: the attention gets ``hidden_states=`` by keyword, the MLP positionally,
as every Llama-layout decoder layer of ``transformers`` 5 calls them) and its ``rowwise`` output
projection reduce-scatters back to ``Shard(1)``; the final norm works on sequence shards and
``lm_head`` gathers the sequence for whole logits.  Rotary position embeddings are computed once
from the full ``position_ids``, which :func:`~raytrain_ext.models.hf_spec.hf_logits` passes
explicitly (the model would otherwise count positions from its ``seq / tp``-long embeddings).

Invariants: parameter names never change (checkpoints and ``params_sha256`` compare with DDP);
an ``lm_head`` tied to the embedding stays the same parameter after both are split (both are
``Shard(0)`` over the vocabulary).
"""

from __future__ import annotations

import inspect
from typing import Dict, List

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

TP_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
BLOCK_PREFIX = "layers.*."


def family_block_plan(config) -> Dict[str, str]:
    """The family's per-layer plan: sublayer path (relative to a decoder layer) -> style name."""
    plan = {}
    for pattern, style in (config.base_model_tp_plan or {}).items():
        if not pattern.startswith(BLOCK_PREFIX):
            continue
        path = pattern[len(BLOCK_PREFIX) :]
        if style not in TP_STYLES:
            raise ValueError(
                f"parallel.tp > 1: the {config.model_type} plan splits {path} as {style!r}, "
                f"which has no torch style here (supported: {', '.join(TP_STYLES)}). Train "
                f"{config.model_type} with parallel.tp=1, or add the style to "
                "raytrain_ext/models/hf_parallel.py."
            )
        plan[path] = style
    return plan


def hf_block_plan(block: nn.Module, sequence_parallel: bool) -> Dict[str, object]:
    """One decoder layer's plan as torch styles (module doc), with or without sequence parallel."""
    names = family_block_plan(block.self_attn.config)
    if not sequence_parallel:
        return {path: TP_STYLES[style]() for path, style in names.items()}
    sublayers = _sublayers(names)
    plan: Dict[str, object] = {
        name: _gather_sequence(block.get_submodule(name)) for name in sublayers
    }
    for path, style in names.items():
        plan[path] = (
            RowwiseParallel(output_layouts=Shard(1)) if style == "rowwise" else ColwiseParallel()
        )
    for name in residual_norms(block, sublayers):
        plan[name] = SequenceParallel()
    return plan


def _sublayers(names: Dict[str, str]) -> List[str]:
    """The decoder layer's children that hold the plan's splits (``self_attn``, ``mlp``)."""
    flat = [path for path in names if "." not in path]
    if flat:
        raise ValueError(
            f"parallel.sequence_parallel: the plan splits {', '.join(flat)} directly in the "
            "decoder layer, with no sublayer to gather its input along the sequence. Train "
            "this model with parallel.sequence_parallel=false."
        )
    return sorted({path.split(".")[0] for path in names})


def residual_norms(block: nn.Module, sublayers: List[str]) -> List[str]:
    """The decoder layer's other parameter-holding children: the norms on the residual stream."""
    return [
        name
        for name, child in block.named_children()
        if name not in sublayers and any(True for _ in child.parameters())
    ]


def _gather_sequence(sublayer: nn.Module) -> PrepareModuleInput:
    """All-gather the sublayer's hidden states along the sequence (``Shard(1) -> Replicate``).

    The attention (its forward takes ``position_embeddings``) is called with keywords
    (``hidden_states=...``); the MLP with its input as the only positional argument.
    """
    parameters = list(inspect.signature(sublayer.forward).parameters)
    if "position_embeddings" in parameters:
        key = parameters[0]
        return PrepareModuleInput(
            input_kwarg_layouts={key: Shard(1)}, desired_input_kwarg_layouts={key: Replicate()}
        )
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


class SequenceParallelEnds(ParallelStyle):
    """The ends of a causal LM under sequence parallelism, applied to the whole model (plan
    key ``""``): embedding rows split with a sequence-sharded output, the final norm on sequence
    shards, ``lm_head`` split by vocabulary with whole logits out; a tied ``lm_head`` is tied
    again to the split embedding."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        embedding, head = module.get_input_embeddings(), module.get_output_embeddings()
        tied = head.weight is embedding.weight
        paths = {id(m): name for name, m in module.named_modules()}
        plan = {
            paths[id(embedding)]: RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1)
            ),
            **{  # a plain local shard out: the causal LM slices it before lm_head
                paths[id(norm)]: SequenceParallel(use_local_output=True)
                for norm in _final_norms(module)
            },
            paths[id(head)]: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        parallelize_module(module, device_mesh, plan)
        if tied:
            head.weight = embedding.weight
        return module


def _final_norms(model: nn.Module) -> List[nn.Module]:
    """The base model's parameter-holding children besides the embedding and the layers."""
    base, embedding = model.base_model, model.get_input_embeddings()
    return [
        child
        for child in base.children()
        if child is not embedding
        and not isinstance(child, nn.ModuleList)
        and any(True for _ in child.parameters())
    ]


def hf_model_plan() -> Dict[str, object]:
    """Sequence parallelism's plan for the whole model (``ModelSpec.tp_model_plan``)."""
    return {"": SequenceParallelEnds()}
