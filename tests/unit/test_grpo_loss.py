"""The GRPO loss and advantages (raytrain_ext.objectives.grpo) against TRL's GRPOTrainer
(1.16, the test-only reference): the same loss and the same gradients for every
``loss_type``, with and without the KL term, over one micro-batch and over an optimizer
step of two (TRL's gradient accumulation against this loop's sums over units)."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from raytrain_ext.data.batch import Batch, Rollout
from raytrain_ext.errors import InputError
from raytrain_ext.objectives.base import token_nll
from raytrain_ext.objectives.grpo import (
    GRPO,
    GRPOLossType,
    KLRegularizedGRPO,
    ScaleRewards,
    combined_rewards,
    group_advantages,
)

ROWS, PROMPT, COMPLETION, VOCAB = 8, 3, 5, 11


def rollout_batch(seed: int = 0):
    """Rows of PROMPT prompt tokens then COMPLETION completion tokens (some padded), with
    old and reference log-probs near the current ones, so some ratios clip."""
    g = torch.Generator().manual_seed(seed)
    seq = PROMPT + COMPLETION
    logits = torch.randn(ROWS, seq, VOCAB, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (ROWS, seq), generator=g)
    completion_mask = torch.ones(ROWS, COMPLETION)
    for row in range(ROWS):  # row r ends after COMPLETION - r % 3 tokens (padding after)
        completion_mask[row, COMPLETION - row % 3 :] = 0
    weights = torch.cat([torch.zeros(ROWS, PROMPT), completion_mask], dim=1)
    batch = Batch(logits.detach().argmax(-1), targets, weights)
    logps = -token_nll(logits.detach(), batch)
    old = logps + 0.3 * torch.randn(ROWS, seq, generator=g)
    ref = logps + 0.5 * torch.randn(ROWS, seq, generator=g)
    advantages = torch.randn(ROWS, generator=g)
    batch.rollout = Rollout(advantages, old, ref)
    return logits, batch


def rows(batch: Batch, part: slice) -> Batch:
    r = batch.rollout
    assert r is not None and batch.weights is not None and r.ref_logps is not None
    old = None if r.old_logps is None else r.old_logps[part]
    sliced = Rollout(r.advantages[part], old, r.ref_logps[part])
    return Batch(batch.inputs[part], batch.targets[part], batch.weights[part], rollout=sliced)


def trl_loss(logits, batch: Batch, loss_type: str, beta: float, parts: int) -> torch.Tensor:
    """TRL's ``GRPOTrainer._compute_loss`` over ``parts`` equal micro-batches of one
    optimizer step, summed as its gradient accumulation sums them; the trainer's state
    is the little its loss reads, and the policy's per-token log-probs are ours, from the
    same logits."""
    from trl import GRPOTrainer

    assert batch.weights is not None and batch.rollout is not None
    total_tokens = batch.weights.sum()
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=parts,
        max_completion_length=COMPLETION,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=parts),
        accelerator=SimpleNamespace(
            num_processes=1,
            sync_gradients=True,
            gather=lambda x: x,
            reduce=lambda x, reduction: x,
        ),
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    size = ROWS // parts
    total = torch.zeros(())
    for k in range(parts):
        part = slice(k * size, (k + 1) * size)
        micro = rows(batch, part)
        assert micro.weights is not None and micro.rollout is not None
        assert micro.rollout.ref_logps is not None
        logps = -token_nll(logits[part], micro)
        trainer._get_per_token_logps_and_entropies = lambda *a, _l=logps, **kw: (
            _l[:, PROMPT:],
            torch.zeros_like(_l[:, PROMPT:]),
            None,
        )
        inputs = {
            "prompt_ids": micro.inputs[:, :PROMPT],
            "prompt_mask": torch.ones(size, PROMPT),
            "completion_ids": micro.inputs[:, PROMPT:],
            "completion_mask": micro.weights[:, PROMPT:],
            "advantages": micro.rollout.advantages,
            "ref_per_token_logps": micro.rollout.ref_logps[:, PROMPT:],
            "num_items_in_batch": total_tokens,
        }
        if micro.rollout.old_logps is not None:  # none: TRL takes the current ones, detached
            inputs["old_per_token_logps"] = micro.rollout.old_logps[:, PROMPT:]
        total = total + GRPOTrainer._compute_loss(trainer, None, inputs)
    return total


def ours(logits, batch: Batch, objective: GRPO, parts: int) -> torch.Tensor:
    """This loop's step: the micro-batches' loss sums over their summed units."""
    size = ROWS // parts
    sums, units = torch.zeros(()), 0.0
    for k in range(parts):
        part = slice(k * size, (k + 1) * size)
        micro = rows(batch, part)
        sums = sums + objective.loss(logits[part], micro).loss_sum
        units += objective.units(micro)
    return sums / units


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", GRPOLossType.values())
def test_the_loss_and_its_gradients_are_trls(loss_type, beta, parts):
    surrogate = dict(
        loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, max_completion_length=COMPLETION
    )
    objective = KLRegularizedGRPO(beta, **surrogate) if beta else GRPO(**surrogate)
    logits, batch = rollout_batch()
    expected = trl_loss(logits, batch, loss_type, beta, parts)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    got = ours(logits, batch, objective, parts)
    (got_grad,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert got_grad.abs().sum() > 0
    assert got_grad[:, :PROMPT].abs().sum() == 0  # the prompt is not trained on


@pytest.mark.parametrize("loss_type", GRPOLossType.values())
def test_an_on_policy_step_without_old_logps_is_trls_too(loss_type):
    objective = KLRegularizedGRPO(
        0.04, loss_type=loss_type, epsilon_high=0.28, max_completion_length=COMPLETION
    )
    logits, batch = rollout_batch()
    assert batch.rollout is not None
    batch.rollout = Rollout(batch.rollout.advantages, None, batch.rollout.ref_logps)
    expected = trl_loss(logits, batch, loss_type, 0.04, parts=2)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    got = ours(logits, batch, objective, parts=2)
    (got_grad,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert objective.loss(logits, batch).metrics["clip_ratio"] == 0  # every ratio is 1


def test_the_sampling_temperature_scales_the_logits_and_padding_never_reaches_the_loss():
    logits, batch = rollout_batch()
    assert batch.rollout is not None and batch.weights is not None
    hot = KLRegularizedGRPO(0.04, temperature=0.7).loss(logits, batch)
    plain = KLRegularizedGRPO(0.04).loss(logits / 0.7, batch)
    torch.testing.assert_close(hot.loss_sum, plain.loss_sum)
    poisoned = batch.rollout.old_logps.clone(), batch.rollout.ref_logps.clone()
    for tensor in poisoned:
        tensor[batch.weights == 0] = float("nan")  # prompt and padding positions
    batch.rollout = Rollout(batch.rollout.advantages, *poisoned)
    again = KLRegularizedGRPO(0.04, temperature=0.7).loss(logits, batch)
    torch.testing.assert_close(again.loss_sum, hot.loss_sum)
    assert torch.isfinite(torch.autograd.grad(again.loss_sum, logits)[0]).all()


def test_some_tokens_clip_and_the_kl_is_reported_only_with_its_term():
    logits, batch = rollout_batch()
    plain = GRPO(epsilon=0.2).loss(logits, batch).metrics
    assert list(plain) == ["clip_ratio"] and 0 < plain["clip_ratio"] < batch.target_weight()
    with_kl = KLRegularizedGRPO(0.1).loss(logits, batch).metrics
    assert list(with_kl) == ["clip_ratio", "kl"] and with_kl["kl"] > 0


def trl_advantages(rewards: torch.Tensor, generations: int, scale: str) -> torch.Tensor:
    """TRL's sum-then-normalize advantages (GRPOTrainer._generate_and_score_completions),
    with its own ``nanstd``."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, generations), dim=1).repeat_interleave(generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, generations), dim=1).repeat_interleave(generations)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ScaleRewards.values())
def test_advantages_are_trls_and_an_unscored_completion_is_not_a_zero_reward(scale):
    per_function = torch.tensor(
        [[1.0, 0.5], [0.0, float("nan")], [0.5, 0.5], [float("nan")] * 2]
        + [[2.0, 0.0], [1.0, 1.0], [0.0, 0.0], [3.0, float("nan")]]
    )
    rewards = combined_rewards(per_function, [1.0, 2.0])
    assert rewards[:3].tolist() == [2.0, 0.0, 1.5] and torch.isnan(rewards[3])
    advantages = group_advantages(rewards, 4, ScaleRewards(scale))
    torch.testing.assert_close(advantages, trl_advantages(rewards, 4, scale))
    assert advantages[3] == 0  # unscored: no signal, and not in its group's mean
    first = torch.tensor([2.0, 0.0, 1.5])
    assert advantages[0] > 0 and (scale != "none" or advantages[0] == 2.0 - first.mean())


def test_a_partial_group_and_mismatched_weights_are_refused_by_name():
    with pytest.raises(InputError, match="num_generations=4: every prompt group must be whole"):
        group_advantages(torch.ones(6), 4, ScaleRewards.group)
    with pytest.raises(InputError, match="2 reward weights for 3 reward functions"):
        combined_rewards(torch.ones(4, 3), [1.0, 1.0])
    logits, batch = rollout_batch()
    batch.rollout = Rollout(torch.zeros(ROWS), torch.zeros(ROWS, PROMPT + COMPLETION))
    with pytest.raises(InputError, match="without reference log-probs while beta > 0"):
        KLRegularizedGRPO(0.1).loss(logits, batch)
    batch.rollout = None
    with pytest.raises(InputError, match="objective.name=grpo trains on rollout batches"):
        GRPO().loss(logits, batch)
