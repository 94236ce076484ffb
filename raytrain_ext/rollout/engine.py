"""A rollout engine: prompt groups in, ``num_generations`` completions each out, from the
policy weights it was last given.

The interface (:class:`RolloutEngine`) is what the GRPO loop talks to, whichever backend
generates: ``hf`` (:class:`HFGenerateEngine`, Hugging Face ``generate`` with its KV cache,
CPU or GPU) here; vLLM, an optional GPU extra, behind the same two calls.

Invariants:
- A group is generated whole, in one call, or not at all: a caller re-issues a lost
  engine's unfinished groups whole to another.
- ``generate`` cuts its requests into calls of ``groups_per_call`` consecutive groups
  (the last one shorter), and a call's completions depend on that call's groups alone.
- Completion ``g`` of prompt ``i`` at step ``s`` is drawn from
  ``completion_seed(run seed, i, g, s)`` alone (``rollout.sampling``): the same weights
  give the same tokens for the same call on any engine (with ``groups_per_call=1``, in
  any order of requests).
- ``generate`` reports the weights version it generated with, so the trainer can tell
  on-policy completions from ones a step behind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from raytrain_ext.errors import InputError
from raytrain_ext.rollout.reference import CompletionLogps, completion_logps
from raytrain_ext.rollout.sampling import SamplingParams, completion_seed, seeded_sampling


@dataclass(frozen=True)
class GroupRequest:
    """One prompt group to generate: the prompt's global index (the sampler's), its
    token ids, and the training step the completions are for."""

    prompt_index: int
    prompt_ids: Tuple[int, ...]
    step: int


@dataclass(frozen=True)
class GroupCompletions:
    """A prompt group's completions, in generation order: each completion's token ids (up
    to and including the end-of-sequence token, no padding) and whether it was cut at
    ``max_completion_length`` instead; with a reference policy (``beta > 0``), each
    completion token's log-prob under it (``rollout.reference``), and when the engines
    may run behind the trainers (``RolloutSettings.score_policy``), under the weights
    that generated it."""

    prompt_index: int
    step: int
    completions: Tuple[Tuple[int, ...], ...]
    truncated: Tuple[bool, ...]
    weights_version: int
    ref_logps: Optional[CompletionLogps] = None
    policy_logps: Optional[CompletionLogps] = None


@dataclass(frozen=True)
class RolloutSettings:
    """What every engine of a run generates with (TRL's ``GRPOConfig`` names)."""

    num_generations: int
    max_completion_length: int
    seed: int
    eos_token_id: int
    pad_token_id: int
    sampling: SamplingParams = SamplingParams()
    groups_per_call: int = 1  # prompt groups per generate call (module doc)
    # each completion scored under the generating weights too (the loss's importance
    # ratio when the engines run behind the trainers: rollout.schedule)
    score_policy: bool = False

    def __post_init__(self) -> None:
        if min(self.num_generations, self.max_completion_length, self.groups_per_call) < 1:
            raise InputError(
                "num_generations, max_completion_length and groups_per_call must be >= 1; "
                f"got {self.num_generations}, {self.max_completion_length} and "
                f"{self.groups_per_call}"
            )


class RolloutEngine(Protocol):
    """What the GRPO loop asks of an engine, whatever generates."""

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Take the policy's full weights (the trainers' step ``version``)."""
        ...

    def generate(self, requests: Sequence[GroupRequest]) -> List[GroupCompletions]:
        """Every request's group, whole, in request order."""
        ...


class HFGenerateEngine:
    """Hugging Face ``generate`` over a causal LM this engine owns.

    Each call is one ``generate`` of ``num_generations`` copies of each of its prompts,
    left-padded to the longest.  Why calls of fixed groups, not whatever an engine holds:
    CPU and GPU kernels may round a row differently in another batch shape, and a flipped
    last bit can flip a sampled token, so a group re-issued to another engine is
    generated in the same call it was in (the pool re-issues whole calls).  One group per
    call never pads and is exact in any order; more groups per call run the engine's
    hardware fuller (TRL generates a whole batch at once)."""

    def __init__(
        self,
        model: torch.nn.Module,
        settings: RolloutSettings,
        reference: Optional[torch.nn.Module] = None,
    ):
        from transformers import GenerationConfig

        self.model = model.eval()
        self.reference = reference  # scores each call's completions (rollout.reference)
        # generate() fills every setting a call leaves unset from the model's own
        # generation config (a repetition penalty, banned words, beams...), which would
        # change what is sampled: the engine's model has none but the library's defaults.
        self.model.generation_config = GenerationConfig()
        self.settings = settings
        self.weights_version = 0

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Every parameter by name (a tied weight, named once, fills both of its uses)."""
        params = dict(self.model.named_parameters())
        if set(params) != set(state):
            missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise InputError(
                f"the policy's weights do not fit the engine's model: missing {missing[:5]}, "
                f"unexpected {extra[:5]} (the trainers and the engines build model.hf alike)"
            )
        for name, param in params.items():
            param.copy_(state[name])
        self.weights_version = version

    @torch.no_grad()
    def generate(self, requests: Sequence[GroupRequest]) -> List[GroupCompletions]:
        per_call = self.settings.groups_per_call
        return [
            group
            for first in range(0, len(requests), per_call)
            for group in self._call(requests[first : first + per_call])
        ]

    def _call(self, requests: Sequence[GroupRequest]) -> List[GroupCompletions]:
        """One ``generate`` over every completion of ``requests``, prompts left-padded to
        the longest (an attention mask keeps the padding out)."""
        from transformers import GenerationConfig

        s = self.settings
        for request in requests:
            if not request.prompt_ids:
                raise InputError(
                    f"prompt {request.prompt_index} has no tokens: nothing to continue"
                )
        device = next(self.model.parameters()).device
        width = max(len(r.prompt_ids) for r in requests)
        rows = [
            [s.pad_token_id] * (width - len(r.prompt_ids)) + list(r.prompt_ids)
            for r in requests
            for _ in range(s.num_generations)
        ]
        prompt = torch.tensor(rows, device=device)
        mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in requests],
            device=device,
        ).repeat_interleave(s.num_generations, dim=0)
        seeds = [
            completion_seed(s.seed, r.prompt_index, g, r.step)
            for r in requests
            for g in range(s.num_generations)
        ]
        config = GenerationConfig(
            do_sample=False,  # the sampling is the processors' (rollout.sampling)
            max_new_tokens=s.max_completion_length,
            eos_token_id=s.eos_token_id,
            pad_token_id=s.pad_token_id,
        )
        out = self.model.generate(
            prompt,
            attention_mask=mask,
            generation_config=config,
            logits_processor=seeded_sampling(s.sampling, seeds, device),
        )
        cut = [cut_at_eos(row, s.eos_token_id) for row in out[:, width:].tolist()]
        n = s.num_generations
        groups = [
            GroupCompletions(
                r.prompt_index,
                r.step,
                tuple(tokens for tokens, _ in cut[k * n : (k + 1) * n]),
                tuple(truncated for _, truncated in cut[k * n : (k + 1) * n]),
                self.weights_version,
            )
            for k, r in enumerate(requests)
        ]
        return self._with_scores(requests, groups)

    def _with_scores(
        self, requests: Sequence[GroupRequest], groups: List[GroupCompletions]
    ) -> List[GroupCompletions]:
        """``groups`` with their log-probs under the reference policy (when this engine has
        one) and under the generating weights (``score_policy``), the call's rows together."""
        if self.reference is not None:
            logps = score_completions(self.reference, requests, groups, self.settings)
            groups = [replace(g, ref_logps=lp) for g, lp in zip(groups, logps, strict=True)]
        if self.settings.score_policy:
            logps = score_completions(self.model, requests, groups, self.settings)
            groups = [replace(g, policy_logps=lp) for g, lp in zip(groups, logps, strict=True)]
        return groups


def cut_at_eos(row: Sequence[int], eos_token_id: int) -> Tuple[Tuple[int, ...], bool]:
    """A generated row up to and including its first end-of-sequence token; whether it had
    none (cut at ``max_completion_length``)."""
    if eos_token_id in row:
        return tuple(row[: list(row).index(eos_token_id) + 1]), False
    return tuple(row), True


def score_completions(
    model: torch.nn.Module,
    requests: Sequence[GroupRequest],
    groups: Sequence[GroupCompletions],
    settings: RolloutSettings,
    rows_per_forward: Optional[int] = None,
) -> List[CompletionLogps]:
    """Each completion token's log-prob under ``model`` at the sampling temperature, the
    rows of ``requests``' groups together (or ``rows_per_forward`` at a time)."""
    return completion_logps(
        model,
        [r.prompt_ids for r in requests],
        [g.completions for g in groups],
        settings.pad_token_id,
        settings.sampling.temperature,
        rows_per_forward,
    )
