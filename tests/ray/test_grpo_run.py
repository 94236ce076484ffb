"""GRPO end to end on Ray, with the tiny config users start from (``configs/grpo_tiny.yaml``:
a tiny Llama, DDP on 2 ranks; here 2 rollout engines, Ray actors of the run) and a
verifiable reward given from Python: the completion says the record's ``chosen`` word (a
column passed through to the reward), with the KL term against the reference policy
(``beta > 0``: the engines score every completion under it) and the engines a step
behind (``rollout.sync_every=2``, ``rollout.overlap``, ``num_iterations=2``: the loss's
ratio is against the weights that generated).  The mean reward rises from below 0.2 to
above 0.8; every step's prompt groups are generated once and consumed once; and a run
that loses a rollout engine (its process SIGKILLed from outside) and then a trainer rank
between sync points, mid-generation (chaos) keeps going, keeps the other engine's process
through the trainer's loss, and ends with the very weights and samples of the run that lost
nothing.  An interrupted run resumes from its checkpoint on another number of trainers and
engines and consumes exactly the global order's prompt groups."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from raytrain_ext import Trainer
from raytrain_ext.config import load_config
from raytrain_ext.rollout.run_service import find_run_rollout
from tests.helpers.grpo import CONFIG, expected_samples_digest
from tests.helpers.runs import FitThread, last_step, step_floor, wait_until

STEPS, GROUPS = 12, 4
KL = "objective.grpo.beta=0.04"
BEHIND = "rollout.sync_every=2"  # the engines take the weights every second update
# the pair of runs compared bit for bit: engines behind, each generation made while the
# step before it updates (rollout.overlap) and trained twice (TRL's num_iterations)
FAULTED = [KL, BEHIND, "rollout.overlap=true", "objective.grpo.num_iterations=2", "run.max_steps=6"]
VERSIONS = [0, 0, 0, 0, 2, 2]  # WeightsSchedule(2, lag=1, iterations=2), per step


def says_chosen(prompts, completions, chosen, **columns):
    """1 when the completion has the record's ``chosen`` word (``.`` in the tiny data)."""
    return [
        1.0 if word in text.split() else 0.0 for text, word in zip(completions, chosen, strict=True)
    ]


def grpo_config(tmp_path, name, *extra):
    return load_config(
        str(CONFIG),
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"run.max_steps={STEPS}",
            "run.tensorboard=false",
            f"data.global_batch_size={GROUPS}",
            "rollout.engines=2",
            "rollout.reward_fns=[]",
            *extra,
        ],
    )


def engine_placements(run_name):
    """The run's engines' (node, pid), once its rollout service is up; None before."""
    import ray

    try:
        return ray.get(find_run_rollout(run_name).engine_placements.remote(), timeout=30)
    except ValueError:  # no service of that name yet
        return None


def step_records(tmp_path, name):
    lines = (Path(tmp_path) / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_grpo_learns_and_a_lost_engine_and_trainer_change_nothing(ray_local, tmp_path):

    clean = Trainer(grpo_config(tmp_path, "clean", KL), reward_fns=[says_chosen]).fit()
    assert clean["status"] == "finished" and clean["objective"] == "grpo"
    assert clean["rollout"]["generated_steps"] == list(range(1, STEPS + 1))
    assert clean["rollout_recoveries"] == []
    assert clean["samples_consumed"] == STEPS * GROUPS
    assert clean["samples_digest"] == expected_samples_digest(STEPS, GROUPS, 1234)  # run.seed
    records = step_records(tmp_path, "clean")
    rewards = [r["reward"] for r in records]
    assert all(r["rollout_generate_s"] > 0 and r["rollout_reward_s"] > 0 for r in records)
    assert records[0]["kl"] == 0 and all(r["kl"] > 0 for r in records[1:])  # moved off it
    assert [r["weights_version"] for r in records] == list(range(STEPS))  # on-policy
    assert rewards[0] < 0.2 and sum(rewards[-3:]) / 3 > 0.8, rewards

    behind = Trainer(grpo_config(tmp_path, "behind", *FAULTED), reward_fns=[says_chosen]).fit()
    assert [r["weights_version"] for r in step_records(tmp_path, "behind")] == VERSIONS
    # rank 1 dies after step 3, between sync points and mid-generation: the re-formed group
    # trains step 4 on the kept result of generation 3, and generation 5 is made with the
    # weights of step 2 the service kept, as in the run that lost nothing
    # every step at least 0.3 s (a sleep changes no number): the engine is lost while the
    # run still generates, however fast the machine
    config = grpo_config(
        tmp_path,
        "faulted",
        *FAULTED,
        *step_floor(0.3, attempts=2),
        "chaos.kill_rank=1",
        "chaos.kill_at_step=3",
    )
    trainer = Trainer(config, reward_fns=[says_chosen])
    with FitThread(trainer) as run:
        # as soon as the engines are up (a step's record reaches the driver a poll late, and
        # this run generates only 3 times): a later generation always meets the loss
        engines = wait_until(lambda: engine_placements("faulted"), "the engines", timeout_s=120)
        os.kill(engines[0][1], signal.SIGKILL)
        faulted = run.summary(timeout_s=300)
    assert faulted["status"] == "finished"
    (lost,) = faulted["rollout_recoveries"]
    assert lost["engine"] == 0 and lost["fate"], lost
    (recovery,) = faulted["recoveries"]  # the trainer rank, re-formed in place
    assert recovery["restored_from"] == "peers" and recovery["restored_step"] == 3
    assert faulted["rollout"]["generated_steps"] == [1, 3, 5]  # none again
    final_engines = faulted["rollout"]["engines"]
    assert final_engines[1] == list(engines[1])  # kept through the trainer's loss
    assert final_engines[0][1] != engines[0][1]  # the killed engine's replacement
    assert faulted["params_sha256"] == behind["params_sha256"]
    assert faulted["samples_digest"] == behind["samples_digest"]
    faulted_records = step_records(tmp_path, "faulted")
    assert [r["weights_version"] for r in faulted_records] == VERSIONS
    assert faulted_records[-1]["reward"] == step_records(tmp_path, "behind")[-1]["reward"]


def test_an_interrupted_grpo_run_resumes_on_other_trainers_and_engines(ray_local, tmp_path):
    slowed = grpo_config(tmp_path, "resumed", BEHIND, "chaos.slow_rank=0", "chaos.slow_s=0.3")
    trainer = Trainer(slowed, reward_fns=[says_chosen])  # slowed: the interrupt lands mid-run
    with FitThread(trainer) as run:
        wait_until(lambda: last_step(trainer) >= 4, "step 4", timeout_s=120)
        trainer.interrupt("the test")
        first = run.summary(timeout_s=120)
    assert first["status"] == "interrupted" and 4 <= first["steps_completed"] < STEPS
    smaller = grpo_config(tmp_path, "resumed", BEHIND, "scaling.num_workers=1", "rollout.engines=1")
    resumed = Trainer(smaller, reward_fns=[says_chosen]).fit()
    assert (
        resumed["status"] == "finished" and resumed["restored"]["step"] == first["steps_completed"]
    )
    assert resumed["rollout"]["generations"] == STEPS - first["steps_completed"]
    # new engines: the resumed group's own start anchors the steps up to the next sync point
    resumed_at = first["steps_completed"]
    after = [r for r in step_records(tmp_path, "resumed") if r["step"] == resumed_at + 1]
    assert after[-1]["weights_version"] == resumed_at
    expected = expected_samples_digest(STEPS, GROUPS, smaller.data.seed)
    assert resumed["samples_digest"] == expected
