"""What the strategies know about a model: one ``ModelSpec`` per model family.

Strategies never name a model's attributes.  The loop gets logits from ``logits`` and,
for a model that starts from saved weights, calls ``load_pretrained`` once the strategy
has placed (and sharded) the model.  DDP needs nothing else from the spec; FSDP
wraps each of ``blocks`` (also the activation-checkpoint and compile units); tensor
parallelism applies the spec's plans; pipeline parallelism asks the spec for a stage.
A spec that leaves a member out does not support that layout, and ``require`` says
which member to add (torchtitan's ``ModelSpec`` plays the same part).

Invariants a spec promises:
- ``build(model_cfg, seed)`` depends only on its arguments (every rank builds the same
  weights), and parameter names do not change under any strategy, so checkpoints and
  full parameters are comparable across layouts;
- ``blocks(module)`` works on the built model and on each of its pipeline stages;
- ``pipeline_stage(model, s, n)`` holds the model's own modules (shared, not copied)
  under their original names, with blocks split as ``stage_layers`` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

TPPlan = Dict[str, Any]  # module path (relative) -> a torch ParallelStyle


class PipelineStageModule(nn.Module):
    """The module of one pipeline stage: token ids or activations in, activations or
    logits out.  The pipeline strategy sets ``training_forward`` around the forwards that
    train a micro-batch (not shape inference) and ``aux_weight`` per step, and collects
    MoE kept-token counts with ``take_kept_tokens``."""

    def __init__(self) -> None:
        super().__init__()
        self.training_forward = False
        self.aux_weight = 0.0

    def take_kept_tokens(self) -> Optional[torch.Tensor]:
        """Tokens each expert kept in this stage's training forwards since the last call."""
        return None


class StageBlocks(nn.Module):
    """This stage's blocks, registered under their global layer index.

    Iterates over the blocks in order, like the ``ModuleList`` it replaces, so
    code that loops over a model's blocks (FSDP, TP, activation checkpointing)
    works on a stage unchanged, while names stay ``blocks.<global index>``.
    """

    def __init__(self, blocks: Dict[int, nn.Module]):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


def call_model(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Token ids -> logits, for a module whose forward takes the ids and returns the logits."""
    return module(inputs)


def batch_logits(spec: "ModelSpec", module: nn.Module, batch: Any) -> torch.Tensor:
    """A batch's logits: per-document attention when the batch carries document positions
    (``data.document_mask``; see :class:`raytrain_ext.data.batch.Batch`)."""
    if batch.positions is None:
        return spec.logits(module, batch.inputs)
    document_logits = spec.require("document_logits", "data.document_mask")
    return document_logits(module, batch.inputs, batch.positions)


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model family and how each parallel layout cuts it (module doc)."""

    name: str
    build: Callable[[Any, int], nn.Module]
    blocks: Callable[[nn.Module], Sequence[nn.Module]]
    tp_block_plan: Optional[Callable[[nn.Module, bool], TPPlan]] = None
    tp_model_plan: Optional[Callable[[], TPPlan]] = None
    pipeline_stage: Optional[Callable[[nn.Module, int, int], PipelineStageModule]] = None
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] = call_model
    load_pretrained: Optional[Callable[[nn.Module, Any], None]] = None  # (placed model, model cfg)
    # (model cfg) -> whether load_pretrained fills every parameter and buffer, so a strategy
    # that shards on the meta device may build the module there (no rank holds a full copy)
    loads_every_value: Optional[Callable[[Any], bool]] = None
    # (module, inputs, positions) -> logits with attention kept within each document, whose
    # tokens' positions restart at 0 where it begins (``data.document_mask``)
    document_logits: Optional[Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = (
        None
    )

    def require(self, member: str, layout: str) -> Callable[..., Any]:
        """The optional member ``member`` that ``layout`` needs; refuses the layout, naming
        the member to add, when this spec leaves it out."""
        found = getattr(self, member)
        if found is None:
            raise ValueError(
                f"{layout} needs ModelSpec.{member}, which the {self.name!r} model spec "
                f"does not define; add it to the spec, or run without {layout}"
            )
        return found


def stage_layers(n_layers: int, pp: int) -> List[range]:
    """The global block indices of each stage: contiguous, sizes differ by at most one
    (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, pp)
    bounds = [0]
    for stage in range(pp):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]
