"""Sampling whose draws belong to the completion, not to the engine or the batch.

Why: a prompt group whose engine died is generated again, whole, by another engine, in
another batch; a run resumed on another number of engines generates each step's groups
on other engines.  For the run to be the same run, each completion's tokens must follow
from its own seed alone: ``completion_seed(run seed, prompt index, generation index,
step)``.  A shared random generator (what ``generate(do_sample=True)`` draws from) gives
each row whatever the rows before it left over.

How: the Gumbel-max trick.  ``argmax(logits / T + G)``, with ``G`` standard Gumbel noise,
is a draw from ``softmax(logits / T)``; with top-k / top-p applied to the scaled logits
first (their filtered tokens at -inf), it is a draw from the same distribution as
Hugging Face's sampling with those settings.  Each row draws its noise from a generator
of its own, seeded by its completion's seed and advanced once per generated position,
so greedy decoding over ``processed logits + noise`` samples each row independently of
the batch it runs in.

Invariant: a row's noise at its ``n``-th generated token depends only on its seed and
``n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from raytrain_ext.errors import InputError


def completion_seed(run_seed: int, prompt_index: int, generation: int, step: int) -> int:
    """The seed of one completion: a 63-bit hash of the four numbers that name it
    (``numpy.random.SeedSequence``: distinct inputs give unrelated streams)."""
    for name, value in (("prompt_index", prompt_index), ("generation", generation)):
        if value < 0:
            raise InputError(f"{name} must be >= 0 to seed a completion; got {value}")
    entropy = [run_seed & 0xFFFFFFFF, prompt_index, generation, step]
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


@dataclass(frozen=True)
class SamplingParams:
    """TRL's generation settings (``GRPOConfig``): ``top_k`` 0 and ``top_p`` 1 keep every
    token."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise InputError(f"temperature must be > 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 keeps every token); got {self.top_k}")


class PerRowGumbelNoise(LogitsProcessor):
    """Adds each row's own standard Gumbel noise to its (already filtered) scores."""

    def __init__(self, seeds: Sequence[int], device: torch.device):
        self.generators: List[torch.Generator] = []
        for seed in seeds:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            self.generators.append(generator)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(f"{scores.shape[0]} rows to sample for {len(self.generators)} seeds")
        # float64 uniforms in [0, 1): -log(-log(u)) is finite and its largest value (37)
        # truncates the Gumbel tail at a probability of 1e-16 per token; float32 would cut
        # it at 1.2e-7, and Exp(1) draws can be exactly 0 (an infinite score)
        tiny = torch.finfo(torch.float64).tiny
        uniform = torch.stack(
            [
                torch.rand(scores.shape[1], generator=g, device=scores.device, dtype=torch.float64)
                for g in self.generators
            ]
        )
        gumbel = -torch.log(-torch.log(uniform.clamp(min=tiny)))
        return scores.float() + gumbel.float()


def seeded_sampling(
    params: SamplingParams, seeds: Sequence[int], device: torch.device
) -> LogitsProcessorList:
    """The processors that make greedy decoding draw each row from its own seed (module
    doc): temperature, top-k, top-p, then the row's Gumbel noise."""
    processors: List[LogitsProcessor] = []
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    processors.append(PerRowGumbelNoise(seeds, device))
    return LogitsProcessorList(processors)
