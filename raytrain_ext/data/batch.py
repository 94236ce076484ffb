"""What one micro-batch is, for every data format and objective.

Invariants:
- ``inputs`` and ``targets`` are int64 ``[rows, seq_len]``; ``targets[r, t]`` is the
  token that follows ``inputs[r, t]``.
- ``weights`` (float32, same shape) is the weight of each target in the loss: 1 for
  a counted token, 0 for a prompt token, padding or a masked document boundary.
  ``None`` means every target counts 1 (packed pre-tokenized text).
- A preference batch holds ``pairs`` (prompt, chosen, rejected) records as
  ``2 * pairs`` rows: the chosen sequences first, then the rejected ones in the same
  order, so row ``i`` and row ``pairs + i`` belong to the same record.
- ``indices`` are the global sample indices the rows came from (one per sample, so
  a preference batch has ``pairs`` of them).
- ``rollout`` (GRPO only): the generated completions' advantages and log-probs.
- ``positions`` (``data.document_mask`` only): each input token's position within its
  document, restarting at 0 after every EOS; the model keeps attention within a
  document, and the target after an EOS (the next document's first token) weighs 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # the driver's data checks import this module, and need no torch
    import torch


@dataclass
class Rollout:
    """What a batch of generated completions carries for the GRPO loss
    (``objectives.grpo``): each row's advantage ``[rows]``, and per target token the
    log-prob under the policy that generated it (None: the policy being trained, an
    on-policy step's first update, where every ratio is 1) and, when the loss has a KL
    term, under the reference policy (``[rows, seq_len]``, aligned with
    ``Batch.targets``; only completion tokens, weight 1, are read)."""

    advantages: torch.Tensor
    old_logps: Optional[torch.Tensor] = None
    ref_logps: Optional[torch.Tensor] = None


@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor
    weights: Optional[torch.Tensor] = None
    pairs: int = 0
    indices: Optional[np.ndarray] = None
    positions: Optional[torch.Tensor] = None
    rollout: Optional[Rollout] = None

    def to(self, device: torch.device) -> "Batch":
        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device, non_blocking=True)

        rollout = self.rollout
        if rollout is not None:
            rollout = Rollout(
                move(rollout.advantages), move(rollout.old_logps), move(rollout.ref_logps)
            )
        return replace(
            self,
            inputs=move(self.inputs),
            targets=move(self.targets),
            weights=move(self.weights),
            positions=move(self.positions),
            rollout=rollout,
        )

    @property
    def samples(self) -> int:
        """How many samples of the global order this batch holds."""
        return self.pairs if self.pairs else self.inputs.shape[0]

    def target_weight(self) -> float:
        """The summed weight of the targets (the token count when ``weights`` is None)."""
        if self.weights is None:
            return float(self.targets.numel())
        return float(self.weights.sum())
