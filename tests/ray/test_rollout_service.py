"""The run's rollout service (raytrain_ext.rollout.service), a Ray actor owning the
engines: every rank asking for a step gets the one generation of that step, scored by
reward functions that run in Ray tasks (not in the service, not in a trainer), with
TRL's group advantages; a step waits for the previous step's weights; a SIGKILLed engine
costs no group (they are issued again, whole, to the other engine, and generate the same
tokens), a warm spare takes its place and the current weights, and a new spare starts; a re-formed trainer asking again
gets the kept result."""

import os
import signal
from dataclasses import replace

import pytest
import torch

from raytrain_ext.objectives.grpo import ScaleRewards, combined_rewards, group_advantages
from raytrain_ext.rollout.engine import GroupRequest, HFGenerateEngine, RolloutSettings
from raytrain_ext.rollout.prompts import PromptGroup
from raytrain_ext.rollout.service import RewardSpec, RolloutSpec, start_rollout_service
from raytrain_ext.rollout.weights_wire import to_wire
from tests.helpers.hf_models import tiny_policy
from tests.helpers.leaks import assert_nothing_left
from tests.helpers.runs import wait_until

SETTINGS = RolloutSettings(
    num_generations=4, max_completion_length=6, seed=13, eos_token_id=3, pad_token_id=0
)
PROMPTS = [PromptGroup(i, (1 + i, 2 + i, 4 + i), f"prompt {i}", {"answer": i}) for i in range(4)]


def scorer_pid(prompts, completions, **columns):
    return [float(os.getpid())] * len(completions)


def even_tokens(prompts, completions, answer, **columns):
    return [
        sum(t % 2 == 0 for t in c) / len(c) + 0 * a
        for c, a in zip(completions, answer, strict=True)
    ]


def test_one_generation_per_step_scored_in_tasks_through_a_killed_engine(ray_local, tmp_path):
    import ray

    rewards = RewardSpec(
        ["tests.ray.test_rollout_service:scorer_pid", even_tokens], weights=[0.0, 1.0]
    )
    options = {"num_cpus": 0.5}  # 2 engines and 2 spares leave room for the reward tasks
    spec = RolloutSpec(tiny_policy, SETTINGS, rewards, 2, options, spare_engines=2)
    service = start_rollout_service(spec)
    reference = HFGenerateEngine(tiny_policy(), SETTINGS)
    try:
        weights = {1: tiny_policy(seed=6).state_dict(), 2: tiny_policy(seed=7).state_dict()}
        ray.get(service.load_weights.remote(to_wire(weights[1]), 1))
        first, second = ray.get([service.rollout.remote(2, PROMPTS) for _ in range(2)])  # 2 ranks
        reference.load_weights(weights[1], 1)
        expected = reference.generate([GroupRequest(p.index, p.prompt_ids, 2) for p in PROMPTS])
        assert first.groups == second.groups == expected
        assert torch.equal(first.advantages, second.advantages)
        pids = set(first.rewards_per_function[:, 0].tolist())
        assert os.getpid() not in pids and len(pids) >= 1  # scored in tasks of their own
        rewards_ = combined_rewards(first.rewards_per_function, [0.0, 1.0])
        assert torch.equal(first.rewards, rewards_)
        assert torch.equal(first.advantages, group_advantages(rewards_, 4, ScaleRewards.group))
        with pytest.raises(ray.exceptions.RayTaskError, match=r"load_weights\(2\) never came"):
            ray.get(service.rollout.remote(3, PROMPTS, wait_s=1.0))
        ray.get(service.load_weights.remote(to_wire(weights[2]), 2))
        (_, lost), (_, kept) = ray.get(service.engine_placements.remote())
        (_, dead_spare), (_, spare) = ray.get(service.spare_placements.remote())  # models built
        os.kill(dead_spare, signal.SIGKILL)  # a spare lost while idle is passed over
        os.kill(lost, signal.SIGKILL)  # its groups go to the other engine, whole
        third = ray.get(service.rollout.remote(3, PROMPTS))
        reference.load_weights(weights[2], 2)
        assert third.groups == reference.generate(
            [GroupRequest(p.index, p.prompt_ids, 3) for p in PROMPTS]
        )
        again = ray.get(service.rollout.remote(3, PROMPTS))  # a re-formed trainer asks again
        assert again.groups == third.groups
        stats = wait_until(  # Ray's verdict is asked off the step's path
            lambda: (
                (st := ray.get(service.stats.remote()))["recoveries"][0]["fate"] != "pending" and st
            ),
            "the lost engine's verdict",
        )
        assert stats["generations"] == 2 and stats["version"] == 2
        ((engine, fate, groups, from_spare),) = [
            (r["engine"], r["fate"], r["groups_reissued"], r["from_spare"])
            for r in stats["recoveries"]
        ]
        assert (engine, fate, groups, from_spare) == (0, "process_died", 2, True)
        (_, replacement), (_, still) = ray.get(service.engine_placements.remote())
        assert still == kept and replacement == spare  # the live spare took the lost one's place
        new_spares = {pid for _, pid in ray.get(service.spare_placements.remote())}
        assert len(new_spares) == stats["spares"] == 2  # two new ones started
        assert not new_spares & {lost, kept, spare, dead_spare}
        reference_4 = reference.generate([GroupRequest(p.index, p.prompt_ids, 4) for p in PROMPTS])
        ray.get(
            service.load_weights.remote(to_wire(weights[2]), 3)
        )  # the replacement takes them too
        fourth = ray.get(service.rollout.remote(4, PROMPTS)).groups
        assert fourth == [replace(g, weights_version=3) for g in reference_4]
    finally:
        ray.get(service.shutdown.remote())
        ray.kill(service)
    assert_nothing_left()
