"""Generated prompt groups -> the batch the GRPO loss trains on (``Batch`` with its
``Rollout``).

Each completion becomes one row: its prompt's tokens, then its own, right-padded to the
longest row.  ``inputs`` are a row's tokens but the last and ``targets`` the same shifted
by one, as every batch here; a target weighs 1 exactly where it is a completion token
(the model's prediction of it is what the policy gradient moves), 0 on the prompt and
the padding.  Right padding leaves every real token's causal context as it was, so no
attention mask is needed.

Invariants:
- Rows are in group order, each group's completions in generation order: the row of
  completion ``g`` of the ``k``-th group is ``k * num_generations + g``, the layout
  ``objectives.grpo.group_advantages`` reads.
- ``Rollout.old_logps`` are the log-probs of the policy that generated the completions
  (the weights the engines had): here recomputed by the trainer; in a run, on-policy
  (every ratio 1, as TRL's ``num_iterations=1``) they are left out, and off-policy the
  engines' own are used (``rollout.step_input``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Tuple

import torch

from raytrain_ext.data.batch import Batch, Rollout
from raytrain_ext.objectives.base import token_logps
from raytrain_ext.rollout.engine import GroupCompletions
from raytrain_ext.rollout.reference import padded_rows

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # inputs [rows, seq] -> logits [rows, seq, V]


def completion_rows(
    groups: Sequence[GroupCompletions],
    prompts: Mapping[int, Tuple[int, ...]],
    pad_token_id: int,
) -> Batch:
    """The rows of ``groups`` (module doc), without their rollout terms yet."""
    completions = [c for group in groups for c in group.completions]
    tokens, starts = padded_rows(
        [prompts[g.prompt_index] for g in groups], [g.completions for g in groups], pad_token_id
    )
    weights = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    for i, (completion, start) in enumerate(zip(completions, starts, strict=True)):
        weights[i, start - 1 : start - 1 + len(completion)] = 1.0  # the completion's targets
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), weights)


@torch.no_grad()
def model_logps(logits_of: LogitsFn, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Each target's log-prob under the model ``logits_of`` runs, sampled at
    ``temperature`` (the loss's), float32 ``[rows, seq]``."""
    return token_logps(logits_of(batch.inputs), batch, temperature)


def rollout_batch(
    groups: Sequence[GroupCompletions],
    prompts: Mapping[int, Tuple[int, ...]],
    advantages: torch.Tensor,
    pad_token_id: int,
    policy: LogitsFn,
    reference: Optional[LogitsFn] = None,
    temperature: float = 1.0,
) -> Batch:
    """The GRPO batch of ``groups``: rows, advantages per row, and the generating
    ``policy``'s (and, for the KL term, the ``reference``'s) per-token log-probs at the
    sampling ``temperature``."""
    batch = completion_rows(groups, prompts, pad_token_id)
    if advantages.shape != (batch.inputs.shape[0],):
        raise ValueError(
            f"{tuple(advantages.shape)} advantages for {batch.inputs.shape[0]} completions"
        )
    old = model_logps(policy, batch, temperature)
    ref = None if reference is None else model_logps(reference, batch, temperature)
    batch.rollout = Rollout(advantages.float(), old, ref)
    return batch
