"""The ``vllm`` rollout backend (``rollout.backend=vllm``): vLLM's offline ``LLM`` in the
engine's actor, on the GPU Ray gave it, behind the same two calls as the ``hf`` engine.

vLLM is an optional extra (``pip install 'raytrain-ext[vllm]'``), never in the CI install:
this module imports it only inside the engine's process, and ``rollout.config.check_vllm``
refuses the backend before Ray starts when the driver cannot import it or the engines get
no GPU.

What is kept from the ``hf`` engine's contract: a group is generated whole, in request
order; completion ``g`` of prompt ``i`` at step ``s`` is sampled with the seed
``completion_seed(run seed, i, g, s)`` (vLLM's per-request seed), so a re-issued group
draws from the same seeds; completions are cut after the first end-of-sequence token;
``generate`` reports the weights version it used.  What is not: vLLM's kernels batch
requests as its scheduler decides, so a re-issued group may round differently and flip a
sampled token (bit-identical replays are the ``hf`` backend's, on the CPU).

The weights: vLLM starts from random (``load_format="dummy"``) weights of the run's
architecture (its config.json written to a temporary directory), and the trainers'
weights arrive through ``load_weights`` before the first generation (no weight file is
read or written), loaded into the model vLLM runs (``model.load_weights``, as TRL's
colocated mode does: vLLM's engine core runs in the actor's process for that,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  With ``score_policy`` each completion token's
log-prob under the generating weights is vLLM's own (``logprobs=0``,
``processed_logprobs``: after temperature, and after top-k/top-p when they are set, where
the trainer's are temperature's only, as in TRL's vLLM path).  With a reference policy
(``beta > 0``) an HF copy of it scores the completions on the same GPU, a few rows per
forward (``REFERENCE_ROWS``: a large vocabulary's logits).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from raytrain_ext.errors import InputError
from raytrain_ext.rollout.engine import (
    GroupCompletions,
    GroupRequest,
    RolloutSettings,
    cut_at_eos,
    score_completions,
)
from raytrain_ext.rollout.sampling import completion_seed

REFERENCE_ROWS = 2  # completions per reference forward (2 x 1536 tokens x 152k vocab: ~2 GB)


@dataclass(frozen=True)
class VLLMOptions:
    """What each engine's ``LLM`` is built with, besides the run's architecture."""

    gpu_memory_utilization: float = 0.7  # the rest: the reference policy, its logits
    max_model_len: int = 4096
    dtype: str = "bfloat16"
    enforce_eager: bool = False


class VLLMEngine:
    """vLLM's ``LLM`` over the run's architecture (module doc)."""

    def __init__(
        self,
        hf_config: Any,
        settings: RolloutSettings,
        options: VLLMOptions = VLLMOptions(),
        reference: Optional[torch.nn.Module] = None,
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # its model in this process
        from vllm import LLM

        self.settings, self.reference = settings, reference
        self._dir = tempfile.TemporaryDirectory(prefix="raytrain-ext-vllm-")
        hf_config.save_pretrained(self._dir.name)  # config.json only: the weights come later
        self.llm = LLM(
            model=self._dir.name,
            skip_tokenizer_init=True,  # token ids in, token ids out
            load_format="dummy",
            dtype=options.dtype,
            seed=settings.seed,
            gpu_memory_utilization=options.gpu_memory_utilization,
            max_model_len=options.max_model_len,
            enforce_eager=options.enforce_eager,
            logprobs_mode="processed_logprobs",  # after temperature, as the loss's
        )
        self.weights_version = 0

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Every parameter by name into the model vLLM runs; its prefix cache then holds
        keys and values of the old weights, so it is emptied."""
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(weights=((name, tensor.to("cuda")) for name, tensor in state.items()))
        self.llm.reset_prefix_cache()
        self.weights_version = version

    def generate(self, requests: Sequence[GroupRequest]) -> List[GroupCompletions]:
        """Every completion one vLLM request of its own seed; cut after end-of-sequence."""
        from vllm import SamplingParams, TokensPrompt

        s = self.settings
        prompts, params = [], []
        for r in requests:
            if not r.prompt_ids:
                raise InputError(f"prompt {r.prompt_index} has no tokens: nothing to continue")
            for g in range(s.num_generations):
                prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_ids)))
                seed = completion_seed(s.seed, r.prompt_index, g, r.step)
                params.append(self._sampling(SamplingParams, seed))
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        cut = [self._cut(out.outputs[0]) for out in outputs]
        n = s.num_generations
        groups = [
            GroupCompletions(
                r.prompt_index,
                r.step,
                tuple(tokens for tokens, _, _ in cut[k * n : (k + 1) * n]),
                tuple(truncated for _, truncated, _ in cut[k * n : (k + 1) * n]),
                self.weights_version,
                policy_logps=(
                    tuple(lp for _, _, lp in cut[k * n : (k + 1) * n]) if s.score_policy else None
                ),
            )
            for k, r in enumerate(requests)
        ]
        if self.reference is None:
            return groups
        logps = score_completions(self.reference, requests, groups, s, REFERENCE_ROWS)
        return [replace(g, ref_logps=lp) for g, lp in zip(groups, logps, strict=True)]

    def _sampling(self, sampling_params: Any, seed: int) -> Any:
        p = self.settings.sampling
        return sampling_params(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,  # vLLM's "every token"
            max_tokens=self.settings.max_completion_length,
            seed=seed,
            stop_token_ids=[self.settings.eos_token_id],
            detokenize=False,
            logprobs=0 if self.settings.score_policy else None,
        )

    def _cut(self, output: Any) -> Tuple[Tuple[int, ...], bool, Tuple[float, ...]]:
        """A completion up to and including its first end-of-sequence token, whether it had
        none, and its tokens' log-probs (empty unless ``score_policy``)."""
        tokens, truncated = cut_at_eos(list(output.token_ids), self.settings.eos_token_id)
        logps: Tuple[float, ...] = ()
        if self.settings.score_policy:
            steps: List[Dict[int, Any]] = list(output.logprobs or [])[: len(tokens)]
            logps = tuple(float(step[t].logprob) for step, t in zip(steps, tokens, strict=True))
        return tokens, truncated, logps


@dataclass(frozen=True)
class VLLMEngineBuilder:
    """Builds an engine's :class:`VLLMEngine` in its actor (``rollout.backend=vllm``)."""

    model_cfg: Any
    options: VLLMOptions = VLLMOptions()

    def __call__(
        self, settings: RolloutSettings, reference: Optional[torch.nn.Module]
    ) -> VLLMEngine:
        from raytrain_ext.models.sources import model_source

        config = model_source(self.model_cfg).hf_config(self.model_cfg)
        return VLLMEngine(config, settings, self.options, reference)
