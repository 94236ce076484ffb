"""The reference policy of GRPO's KL term (``objective.grpo.beta > 0``), scored where the
completions are generated.

The reference is the policy before its first update: the run's ``model.hf`` built with
``run.seed`` and filled from its pretrained weights, exactly as every trainer rank builds
it (``models.hf_spec.build_hf``, ``models.hf_weights.load_pretrained``).  Each engine
builds its own copy once, so the trainers hold no second model and no checkpoint carries
one, and a replacement engine or a resumed run has the very same reference.

Why on the engines: a completion's reference log-probs are fixed the moment it is
generated, so they travel with it (``GroupCompletions.ref_logps``) through the service's
kept results: a trainer group re-formed mid-step, on any world size, trains on the same
numbers, and nothing is recomputed.  An engine scores its rows in a fixed cut (the ``hf``
engine: one generate call's rows together), and the pool re-issues whole calls, so the
numbers do not depend on which engine scored them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from raytrain_ext.data.batch import Batch
from raytrain_ext.objectives.base import token_logps

CompletionLogps = Tuple[Tuple[float, ...], ...]  # a group's: per completion, per token


@dataclass(frozen=True)
class HFReferenceBuilder:
    """Builds the reference policy (module doc) on the engine's device: float32 on CPU,
    bf16 on a GPU Ray gave the engine (as the engine's policy)."""

    model_cfg: Any
    seed: int

    def __call__(self) -> torch.nn.Module:
        import ray

        from raytrain_ext.models.hf_spec import build_hf
        from raytrain_ext.models.hf_weights import load_pretrained

        model = build_hf(self.model_cfg, self.seed)
        load_pretrained(model, self.model_cfg)
        if ray.get_gpu_ids():
            model = model.to(device="cuda", dtype=torch.bfloat16)
        return model.eval()


def padded_rows(
    prompts: Sequence[Tuple[int, ...]],
    completions: Sequence[Sequence[Tuple[int, ...]]],
    pad_token_id: int,
) -> Tuple[torch.Tensor, List[int]]:
    """Every completion's row, its prompt's tokens then its own, right-padded to the
    longest (``[rows, width]``, groups in order, each group's completions in order), and
    where each row's completion starts.  The one layout of GRPO's rows: the batch's
    (``assemble.completion_rows``) and the engines' scoring."""
    rows = [prompt + c for prompt, group in zip(prompts, completions, strict=True) for c in group]
    starts = [
        len(prompt) for prompt, group in zip(prompts, completions, strict=True) for _ in group
    ]
    tokens = torch.full((len(rows), max(len(r) for r in rows)), pad_token_id, dtype=torch.int64)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    return tokens, starts


@torch.no_grad()
def completion_logps(
    model: torch.nn.Module,
    prompts: Sequence[Tuple[int, ...]],
    completions: Sequence[Sequence[Tuple[int, ...]]],
    pad_token_id: int,
    temperature: float,
    rows_per_forward: Optional[int] = None,
) -> List[CompletionLogps]:
    """Each completion token's log-prob under ``model`` at the sampling ``temperature``,
    per group (``prompts[k]`` with its ``completions[k]``): a forward over every row (or
    over ``rows_per_forward`` rows at a time: a large vocabulary's logits of every row at
    once would not fit beside a GPU engine), prompt then completion, right-padded (no
    mask needed: padding follows every real token)."""
    tokens, _ = padded_rows(prompts, completions, pad_token_id)
    device = next(model.parameters()).device
    chunk = rows_per_forward or len(tokens)
    parts = []
    for first_row in range(0, len(tokens), chunk):
        part = tokens[first_row : first_row + chunk]
        inputs, targets = part[:, :-1].to(device), part[:, 1:].to(device)
        logits = model(input_ids=inputs, use_cache=False).logits
        parts.append(token_logps(logits, Batch(inputs, targets), temperature).cpu())
    logps = torch.cat(parts)
    out: List[CompletionLogps] = []
    first = 0  # the group's first row
    for prompt, group in zip(prompts, completions, strict=True):
        start = len(prompt) - 1  # the target position of a completion's first token
        out.append(
            tuple(
                tuple(logps[first + g, start : start + len(c)].tolist())
                for g, c in enumerate(group)
            )
        )
        first += len(group)
    return out


def logp_rows(
    groups_logps: Sequence[CompletionLogps],
    prompt_lengths: Sequence[int],
    shape: Tuple[int, int],
) -> torch.Tensor:
    """The groups' reference log-probs laid out as ``assemble.completion_rows`` lays out
    their rows (``[rows, seq]``, aligned with the targets; 0 off the completions, where the
    loss never reads them)."""
    out = torch.zeros(shape)
    row = 0
    for logps, prompt_length in zip(groups_logps, prompt_lengths, strict=True):
        for completion in logps:
            start = prompt_length - 1
            out[row, start : start + len(completion)] = torch.tensor(completion)
            row += 1
    return out
