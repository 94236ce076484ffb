"""The planner's shape of a Hugging Face Llama-layout causal LM (``model.source: hf``).

These models differ from the reference GPT in what their parameters are: a gated (SwiGLU) MLP of
three ``intermediate_size`` matrices, grouped-query attention (k/v projections of
``num_key_value_heads x head_dim``), RMSNorms (a weight, no bias), rotary positions (no position
table), an ``lm_head`` that may be the embedding itself, and per-family biases and q/k norms.
:func:`llama_layout` reads them from the ``transformers`` config and :func:`count_llama_params`
counts term by term, so the total equals ``sum(p.numel() for p in model.parameters())`` of the
real model (the unit tests build it for each family to hold us to that).

Family knowledge is the one table :data:`FAMILY_BIASES`, next to the families that have a spec
(:data:`raytrain_ext.models.hf_config.SPEC_FAMILIES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple


@dataclass(frozen=True)
class LlamaLayout:
    """What a Llama-layout decoder has beyond ``ModelShape``'s layers, hidden size, heads and
    vocabulary."""

    intermediate_size: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over head_dim on queries and on keys (Qwen3)


# model_type -> config -> (qkv_bias, o_bias, mlp_bias, qk_norm), as each modeling file builds them
FAMILY_BIASES: Dict[str, Callable[[Any], Tuple[bool, bool, bool, bool]]] = {
    "llama": lambda c: (c.attention_bias, c.attention_bias, c.mlp_bias, False),
    "mistral": lambda c: (False, False, False, False),
    "qwen2": lambda c: (True, False, False, False),
    "qwen3": lambda c: (c.attention_bias, c.attention_bias, False, True),
}


def llama_layout(config) -> LlamaLayout:
    """The layout of a ``transformers`` config of a family with a spec."""
    qkv_bias, o_bias, mlp_bias, qk_norm = FAMILY_BIASES[config.model_type](config)
    heads = config.num_attention_heads
    return LlamaLayout(
        intermediate_size=config.intermediate_size,
        kv_heads=config.num_key_value_heads or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        tied_embeddings=bool(config.tie_word_embeddings),
        qkv_bias=bool(qkv_bias),
        o_bias=bool(o_bias),
        mlp_bias=bool(mlp_bias),
        qk_norm=qk_norm,
    )


@dataclass(frozen=True)
class LlamaCounts:
    """Parameters of one decoder layer and of the rest (embedding, final norm, lm_head), and the
    largest single module (DeepSpeed's "largest layer")."""

    block: int
    root: int
    largest_module: int


def count_llama_params(layout: LlamaLayout, d_model: int, n_heads: int, vocab: int) -> LlamaCounts:
    """Term by term, as the family's modeling file builds the model (module doc)."""
    d, q_width, kv_width = d_model, n_heads * layout.head_dim, layout.kv_heads * layout.head_dim
    q_proj = d * q_width + (q_width if layout.qkv_bias else 0)
    kv_proj = d * kv_width + (kv_width if layout.qkv_bias else 0)
    o_proj = q_width * d + (d if layout.o_bias else 0)
    inter = layout.intermediate_size
    up_proj = d * inter + (inter if layout.mlp_bias else 0)  # gate_proj alike
    down_proj = inter * d + (d if layout.mlp_bias else 0)
    norms = 2 * d + (2 * layout.head_dim if layout.qk_norm else 0)
    block = q_proj + 2 * kv_proj + o_proj + 2 * up_proj + down_proj + norms
    embedding = vocab * d
    root = embedding + d + (0 if layout.tied_embeddings else embedding)
    largest = max(embedding, q_proj, kv_proj, o_proj, up_proj, down_proj)
    return LlamaCounts(block=block, root=root, largest_module=largest)
