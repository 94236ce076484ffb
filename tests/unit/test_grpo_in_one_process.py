"""GRPO end to end in one process, from the parts of issue 31 built so far: an engine
generates prompt groups from the policy's current weights, a reward function scores them,
group advantages and the rollout batch (raytrain_ext.rollout.assemble) feed the loss
(raytrain_ext.objectives.grpo), and the policy learns what the reward asks for."""

import torch

from raytrain_ext.data.batch import Rollout
from raytrain_ext.objectives.grpo import (
    GRPO,
    KLRegularizedGRPO,
    ScaleRewards,
    combined_rewards,
    group_advantages,
)
from raytrain_ext.rollout.assemble import completion_rows, rollout_batch
from raytrain_ext.rollout.engine import (
    GroupCompletions,
    GroupRequest,
    HFGenerateEngine,
    RolloutSettings,
)
from raytrain_ext.rollout.reference import logp_rows
from raytrain_ext.rollout.rewards import ScoredGroup, score_groups
from raytrain_ext.rollout.sampling import SamplingParams
from tests.helpers.hf_models import TINY, tiny_policy

GENERATIONS, PROMPTS, STEPS = 8, 4, 12
LOW = TINY["vocab_size"] // 2


def low_tokens(prompts, completions, **columns):
    """The share of a completion's tokens in the vocabulary's lower half."""
    return [sum(t < LOW for t in c) / len(c) for c in completions]


def test_the_rows_weigh_exactly_the_completion_tokens():
    group = GroupCompletions(0, 0, ((7, 8, 9), (5,)), (True, False), 0)
    batch = completion_rows([group], {0: (1, 2)}, pad_token_id=0)
    assert batch.inputs.tolist() == [[1, 2, 7, 8], [1, 2, 5, 0]]
    assert batch.targets.tolist() == [[2, 7, 8, 9], [2, 5, 0, 0]]
    assert batch.weights is not None
    assert batch.weights.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0]]


def test_a_grpo_loop_in_one_process_raises_its_reward():
    settings = RolloutSettings(
        num_generations=GENERATIONS, max_completion_length=6, seed=3, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    policy, engine = tiny_policy(seed=5), HFGenerateEngine(tiny_policy(seed=9), settings)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    objective = GRPO()
    prompts = {i: (1, 10 + i, 20 + i) for i in range(PROMPTS)}
    mean_rewards = []
    for step in range(STEPS):
        engine.load_weights(policy.state_dict(), version=step)  # on-policy
        groups = engine.generate([GroupRequest(i, prompts[i], step) for i in range(PROMPTS)])
        assert {g.weights_version for g in groups} == {step}
        scored = [
            ScoredGroup(g.prompt_index, prompts[g.prompt_index], g.completions) for g in groups
        ]
        per_function = torch.tensor(score_groups([low_tokens], scored)).view(-1, 1)
        rewards = combined_rewards(per_function, [1.0])
        advantages = group_advantages(rewards, GENERATIONS, ScaleRewards.group)
        batch = rollout_batch(groups, prompts, advantages, 0, lambda x: policy(x).logits)
        terms = objective.loss(policy(batch.inputs).logits, batch)
        assert terms.metrics["clip_ratio"] == 0  # on-policy: every ratio is 1
        (terms.loss_sum / objective.units(batch)).backward()
        optimizer.step()
        optimizer.zero_grad()
        mean_rewards.append(rewards.mean().item())
    first, last = sum(mean_rewards[:3]) / 3, sum(mean_rewards[-3:]) / 3
    assert last > first + 0.15, mean_rewards


def test_the_engines_log_probs_are_the_trainers_and_feed_the_loss():
    """An engine scores each call's completions under the reference policy (``beta > 0``,
    ``rollout.reference``) and under the weights that generated them (engines behind the
    trainers, ``rollout.sync_every > 1``); laid out as the batch's rows, they are what the
    trainer would compute from the same models, and the loss (its KL term and its
    importance ratio) reads them."""
    settings = RolloutSettings(
        num_generations=3, max_completion_length=5, seed=3, eos_token_id=2, pad_token_id=0,
        sampling=SamplingParams(temperature=0.7), groups_per_call=2, score_policy=True,
    )  # fmt: skip
    reference, policy = tiny_policy(seed=7), tiny_policy(seed=5)
    engine = HFGenerateEngine(tiny_policy(seed=9), settings, reference=reference)
    prompts = {i: tuple(range(1 + i, 4 + 2 * i)) for i in range(3)}  # lengths differ
    groups = engine.generate([GroupRequest(i, prompts[i], step=1) for i in range(3)])
    for g in groups:
        assert g.ref_logps is not None and g.policy_logps is not None
        assert [len(lp) for lp in g.ref_logps] == [len(c) for c in g.completions]
    advantages = torch.linspace(-1, 1, 9)
    trainers = rollout_batch(
        groups,
        prompts,
        advantages,
        0,
        lambda x: engine.model(x).logits,
        lambda x: reference(x).logits,
        0.7,
    )
    assert trainers.rollout is not None and trainers.weights is not None
    assert trainers.rollout.ref_logps is not None and trainers.rollout.old_logps is not None
    lengths = [len(prompts[g.prompt_index]) for g in groups]
    shape = (trainers.targets.shape[0], trainers.targets.shape[1])
    engines_ref = logp_rows([g.ref_logps for g in groups if g.ref_logps], lengths, shape)
    engines_old = logp_rows([g.policy_logps for g in groups if g.policy_logps], lengths, shape)
    mask = trainers.weights > 0
    assert torch.allclose(engines_ref[mask], trainers.rollout.ref_logps[mask], atol=1e-5)
    assert torch.allclose(engines_old[mask], trainers.rollout.old_logps[mask], atol=1e-5)
    assert (engines_ref[~mask] == 0).all() and (engines_old[~mask] == 0).all()
    objective = KLRegularizedGRPO(0.04, temperature=0.7)
    logits = policy(trainers.inputs).logits
    expected = objective.loss(logits, trainers)
    trainers.rollout = Rollout(advantages, old_logps=engines_old, ref_logps=engines_ref)
    got = objective.loss(logits, trainers)
    assert got.metrics["kl"] > 0 and got.metrics["clip_ratio"] > 0  # another policy made them
    assert torch.allclose(got.loss_sum, expected.loss_sum, rtol=1e-5)
    assert torch.allclose(got.metrics["kl"], expected.metrics["kl"], rtol=1e-5)


def test_a_carried_rollout_result_survives_json_bit_for_bit():
    """What a checkpoint carries of a generation (raytrain_ext.rollout.carry): every field,
    the tensors bit for bit, a reward function's None (NaN) included."""
    import json
    import math

    from raytrain_ext.rollout.carry import result_from_plain, result_to_plain
    from raytrain_ext.rollout.service import RolloutResult

    logps = ((-0.1234567, -2.5), (-1e-7,))
    group = GroupCompletions(3, 5, ((7, 8), (5,)), (True, False), 4, logps, logps)
    rewards = torch.tensor([[0.1, float("nan")], [1 / 3, 2.0]])
    result = RolloutResult(
        5, [group], rewards, rewards.nansum(1), torch.randn(2), ("a", "b"), {"generate": 0.5}, 4
    )
    back = result_from_plain(json.loads(json.dumps(result_to_plain(result))))
    assert back.groups == [group] and back.step == 5 and back.weights_version == 4
    assert back.function_names == ("a", "b") and back.phases_s == {"generate": 0.5}
    assert torch.equal(back.advantages, result.advantages)
    assert torch.equal(back.rewards, result.rewards)
    assert math.isnan(back.rewards_per_function[0, 1])
    assert torch.equal(back.rewards_per_function.nan_to_num(), rewards.nan_to_num())
