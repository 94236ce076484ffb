"""The ``model`` section: which model family (``model.source``, one per entry of
``models.sources.MODEL_SOURCES``) and the reference GPT's shape, a Hugging Face model's
location, the MoE feed-forward; its own check (``check_model_section``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional

from raytrain_ext.errors import ConfigError
from raytrain_ext.models.sources import MODEL_SOURCES
from raytrain_ext.typed_config.choice import Choice, choice_from_values
from raytrain_ext.typed_config.fields import at_least, positive, within

if TYPE_CHECKING:  # members known at run time only (typed_config.choice)

    class ModelSource(Choice): ...

else:
    ModelSource = choice_from_values(
        "ModelSource",
        __name__,
        "``model.source``: the built-in reference GPT, a Hugging Face causal LM "
        "(``model.hf``), or the user's own ``nn.Module`` (``model.factory``); one per entry of "
        "``models.sources.MODEL_SOURCES``.",
        *MODEL_SOURCES,
    )


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward; ``num_experts: 0`` means a dense MLP."""

    num_experts: int = at_least(0, 0)
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = at_least(0, 0.01)


@dataclass
class HFModelConfig:
    """``model.source: hf``: a Hugging Face causal LM of a family with a shipped spec.

    ``path`` is a local directory holding ``config.json`` (and, for pretrained
    weights, safetensors), or a model id already in the local HF cache; ``config`` is
    an inline architecture (``{model_type: llama, hidden_size: 64, ...}``) for a
    randomly initialised model, merged over ``path``'s when both are given.
    """

    path: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)
    pretrained: bool = True  # load path's safetensors; false: random init of the architecture


@dataclass
class ModelConfig:
    """The model: by default the reference GPT, whose shape the fields below set
    (``vocab_size: 256`` matches the byte-level corpus).  For ``source: hf`` the shape
    fields are read from the Hugging Face config (``model.hf``) when the config loads,
    so every check and the planner see the real model; ``source: python`` builds the
    user's module from ``factory`` (``"pkg.module:build"``, called with this section and
    the seed; it returns an ``nn.Module``, or ``(module, ModelSpec)`` for layouts beyond
    DDP/FSDP), and FSDP wraps each module of class ``block_class``.
    """

    source: ModelSource = ModelSource("gpt")
    hf: HFModelConfig = field(default_factory=HFModelConfig)
    factory: Optional[str] = None
    block_class: Optional[str] = None
    n_layers: int = positive(2)
    d_model: int = positive(128)
    n_heads: int = positive(4)
    vocab_size: int = positive(256)
    seq_len: int = positive(128)
    mlp_ratio: int = positive(4)
    dropout: float = within(0, 1, 0.0, hi_open=True)
    moe: MoEConfig = field(default_factory=MoEConfig)


def check_model_section(m: ModelConfig) -> None:
    """The reference shape's arithmetic and the MoE settings."""
    if m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model: {m.d_model} is not divisible by model.n_heads={m.n_heads} "
            f"({m.d_model} / {m.n_heads} = {m.d_model / m.n_heads:g}). "
            "Choose d_model as a multiple of n_heads."
        )
    moe = m.moe
    if moe.num_experts and not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k: {moe.top_k} must be between 1 and "
            f"model.moe.num_experts={moe.num_experts}."
        )
    if moe.num_experts and moe.capacity_factor <= 0:
        raise ConfigError(f"model.moe.capacity_factor: must be > 0, got {moe.capacity_factor}.")
