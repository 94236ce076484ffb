"""A rollout engine: prompt groups in, ``num_generations`` completions each out, from the
policy weights it was last given.

The interface (:class:`RolloutEngine`) is what the GRPO loop talks to, whichever backend
generates: ``hf`` (:class:`HFGenerateEngine`, Hugging Face ``generate`` with its KV cache,
CPU or GPU) here; vLLM, an optional GPU extra, behind the same two calls.

Invariants:
- A group is generated whole, in one call, or not at all: a caller re-issues a lost
  engine's unfinished groups whole to another.
- Completion ``g`` of prompt ``i`` at step ``s`` is drawn from
  ``completion_seed(run seed, i, g, s)`` alone (``rollout.sampling``): the same weights
  give the same tokens on any engine, in any order of requests.
- ``generate`` reports the weights version it generated with, so the trainer can tell
  on-policy completions from ones a step behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Protocol, Sequence, Tuple

import torch

from raytrain_ext.errors import InputError
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
    ``max_completion_length`` instead."""

    prompt_index: int
    step: int
    completions: Tuple[Tuple[int, ...], ...]
    truncated: Tuple[bool, ...]
    weights_version: int


@dataclass(frozen=True)
class RolloutSettings:
    """What every engine of a run generates with (TRL's ``GRPOConfig`` names)."""

    num_generations: int
    max_completion_length: int
    seed: int
    eos_token_id: int
    pad_token_id: int
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        if self.num_generations < 1 or self.max_completion_length < 1:
            raise InputError(
                "num_generations and max_completion_length must be >= 1; got "
                f"{self.num_generations} and {self.max_completion_length}"
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

    Each group is one ``generate`` call of ``num_generations`` copies of its prompt: the
    rows share a length, so none is padded, and a group's batch is the same whichever
    other groups were asked for with it (CPU kernels may round differently for another
    batch shape, and a flipped last bit can flip a sampled token)."""

    def __init__(self, model: torch.nn.Module, settings: RolloutSettings):
        from transformers import GenerationConfig

        self.model = model.eval()
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
        return [self._group(request) for request in requests]

    def _group(self, request: GroupRequest) -> GroupCompletions:
        from transformers import GenerationConfig

        s = self.settings
        if not request.prompt_ids:
            raise InputError(f"prompt {request.prompt_index} has no tokens: nothing to continue")
        device = next(self.model.parameters()).device
        prompt = torch.tensor([request.prompt_ids] * s.num_generations, device=device)
        seeds = [
            completion_seed(s.seed, request.prompt_index, g, request.step)
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
            attention_mask=torch.ones_like(prompt),
            generation_config=config,
            logits_processor=seeded_sampling(s.sampling, seeds, device),
        )
        rows = [self._cut(row) for row in out[:, prompt.shape[1] :].tolist()]
        return GroupCompletions(
            request.prompt_index,
            request.step,
            tuple(tokens for tokens, _ in rows),
            tuple(cut for _, cut in rows),
            self.weights_version,
        )

    def _cut(self, row: List[int]) -> Tuple[Tuple[int, ...], bool]:
        """A generated row up to and including its first end-of-sequence token; whether
        it had none (cut at ``max_completion_length``)."""
        eos = self.settings.eos_token_id
        if eos in row:
            return tuple(row[: row.index(eos) + 1]), False
        return tuple(row), True
