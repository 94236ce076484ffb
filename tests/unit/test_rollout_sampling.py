"""Seeded sampling (raytrain_ext.rollout.sampling) and the Hugging Face rollout engine
(raytrain_ext.rollout.engine): each completion follows from its own seed, so the same
weights give the same completions on any engine and in any order of requests, and the
draws follow the distribution ``generate(do_sample=True)`` samples from."""

from dataclasses import replace

import pytest
import torch

from raytrain_ext.errors import InputError
from raytrain_ext.rollout.engine import GroupRequest, HFGenerateEngine, RolloutSettings
from raytrain_ext.rollout.sampling import (
    PerRowGumbelNoise,
    SamplingParams,
    completion_seed,
    seeded_sampling,
)
from tests.helpers.hf_models import TINY, tiny_config


def test_a_completion_seed_names_one_completion_and_nothing_else():
    seeds = {
        completion_seed(run, prompt, generation, step)
        for run in (0, 1)
        for prompt in (0, 1, 2)
        for generation in (0, 1, 2)
        for step in (0, 1)
    }
    assert len(seeds) == 36 and all(0 <= s < 2**63 for s in seeds)
    assert completion_seed(7, 3, 1, 5) == completion_seed(7, 3, 1, 5)
    with pytest.raises(InputError, match="prompt_index must be >= 0"):
        completion_seed(0, -1, 0, 0)


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    """Token frequencies of ``n`` single draws from ``logits``, one seed each."""
    seeds = [completion_seed(0, i, 0, 0) for i in range(n)]
    processors = seeded_sampling(params, seeds, torch.device("cpu"))
    scores = processors(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, -1).clone())
    return torch.bincount(scores.argmax(-1), minlength=logits.numel()).float() / n


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=2)],
    ids=["plain", "temperature", "top-k"],
)
def test_the_draws_follow_the_distribution_hf_samples_from(params):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    expected = torch.softmax(logits / params.temperature, dim=0)
    if params.top_k:
        expected[params.top_k :] = 0
        expected /= expected.sum()
    frequencies = draws(params, logits, 6000)
    assert torch.allclose(frequencies, expected, atol=0.025), (frequencies, expected)


def test_a_rows_noise_does_not_depend_on_the_rows_beside_it():
    scores = torch.randn(3, 7)
    together = PerRowGumbelNoise([11, 22, 33], torch.device("cpu"))(None, scores.clone())
    alone = PerRowGumbelNoise([22], torch.device("cpu"))(None, scores[1:2].clone())
    assert torch.equal(together[1:2], alone)
    later = PerRowGumbelNoise([22], torch.device("cpu"))
    first, second = later(None, scores[1:2].clone()), later(None, scores[1:2].clone())
    assert not torch.equal(first, second)  # each generated position draws anew


def test_bad_sampling_settings_are_refused_by_name():
    for kwargs, text in (
        ({"temperature": 0}, "temperature must be > 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
    ):
        with pytest.raises(InputError, match=text):
            SamplingParams(**kwargs)


def engine(seed: int = 5, **sampling) -> HFGenerateEngine:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    settings = RolloutSettings(
        num_generations=4,
        max_completion_length=12,
        seed=7,
        eos_token_id=3,
        pad_token_id=0,
        sampling=SamplingParams(**sampling),
    )
    return HFGenerateEngine(model, settings)


def test_the_same_weights_give_the_same_completions_on_any_engine_in_any_order():
    first, other = engine(seed=5), engine(seed=6)
    other.load_weights(first.model.state_dict(), version=1)
    requests = [GroupRequest(i, tuple(range(1 + i, 6 + 2 * i)), step=2) for i in range(3)]
    one = first.generate(requests)
    two = other.generate(requests[::-1])[::-1]
    assert [g.completions for g in one] == [g.completions for g in two]
    assert [g.weights_version for g in two] == [1, 1, 1] and one[0].weights_version == 0
    for group in one:  # each completion its own draw: they differ within a group
        assert len(set(group.completions)) > 1 and len(group.completions) == 4
        for tokens, cut in zip(group.completions, group.truncated, strict=True):
            assert 0 < len(tokens) <= 12 and all(0 <= t < TINY["vocab_size"] for t in tokens)
            assert cut == (3 not in tokens) and (cut or tokens.index(3) == len(tokens) - 1)
    later = first.generate([GroupRequest(0, requests[0].prompt_ids, step=3)])
    assert later[0].completions != one[0].completions  # another step, other draws


def test_new_weights_change_what_is_generated():
    policy, other = engine(seed=5), engine(seed=6)
    request = [GroupRequest(0, (1, 2, 3, 4), step=0)]
    before = policy.generate(request)[0]
    policy.load_weights(other.model.state_dict(), version=4)
    after = policy.generate(request)[0]
    assert after.weights_version == 4 and after.completions != before.completions
    assert after.completions == other.generate(request)[0].completions


def test_groups_generated_in_one_padded_call_sample_as_they_do_alone():
    """Prompts of other lengths share a call left-padded, their padding masked out: each
    completion is drawn as it is when its group is generated alone (a bit of rounding
    may flip one token in a while: at most one completion in sixteen differs)."""
    alone = engine(seed=5)
    together = HFGenerateEngine(alone.model, replace(alone.settings, groups_per_call=4))
    requests = [GroupRequest(i, tuple(range(1 + i, 4 + 3 * i)), step=1) for i in range(4)]
    single = [c for g in alone.generate(requests) for c in g.completions]
    batched = [c for g in together.generate(requests) for c in g.completions]
    assert sum(a == b for a, b in zip(single, batched, strict=True)) >= len(single) - 1
