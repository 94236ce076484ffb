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
nothing.  A stopped run resumes from its checkpoint on another number of trainers and
engines, trains on the completions its checkpoint carried (those of the generations made
with older weights than its own) and consumes exactly the global order's prompt groups."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from raytrain_ext import Trainer, TrainingFailed
from raytrain_ext.config import load_config
from raytrain_ext.rollout.run_service import find_run_rollout
from raytrain_ext.rollout.schedule import WeightsSchedule
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


_BEHIND = {}  # the uninterrupted run the faulted and the resumed runs are held to


def behind_run(tmp_path_factory):
    """The faulted pair's uninterrupted run, made once per session: (summary, records)."""
    if not _BEHIND:
        out = tmp_path_factory.mktemp("behind")
        summary = Trainer(grpo_config(out, "behind", *FAULTED), reward_fns=[says_chosen]).fit()
        _BEHIND["run"] = summary, step_records(out, "behind")
    return _BEHIND["run"]


def test_grpo_learns_and_a_lost_engine_and_trainer_change_nothing(
    ray_local, tmp_path, tmp_path_factory
):

    clean = Trainer(grpo_config(tmp_path, "clean", KL), reward_fns=[says_chosen]).fit()
    assert clean["status"] == "finished" and clean["objective"] == "grpo"
    assert clean["rollout"]["generated_steps"] == list(range(1, STEPS + 1))
    assert clean["rollout_recoveries"] == []
    assert clean["samples_consumed"] == STEPS * GROUPS
    assert clean["samples_digest"] == expected_samples_digest(STEPS, GROUPS, 1234)  # run.seed
    records = step_records(tmp_path, "clean")
    rewards = [r["reward"] for r in records]
    assert all(r["rollout_generate_s"] > 0 and r["rollout_reward_s"] > 0 for r in records)
    # the policy goes to the engines after every update a generation takes, not the last
    assert records[-1]["phases_s"]["weights_sync"] < min(
        r["phases_s"]["weights_sync"] for r in records[:-1]
    )
    assert records[0]["kl"] == 0 and all(r["kl"] > 0 for r in records[1:])  # moved off it
    assert [r["weights_version"] for r in records] == list(range(STEPS))  # on-policy
    assert rewards[0] < 0.2 and sum(rewards[-3:]) / 3 > 0.8, rewards

    behind, behind_records = behind_run(tmp_path_factory)
    assert [r["weights_version"] for r in behind_records] == VERSIONS
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
        # at the trainers' CPU priority (scaling.worker_niceness), not Ray's nice 15
        assert {os.getpriority(os.PRIO_PROCESS, pid) for _, pid in engines} == {0}
        os.kill(engines[0][1], signal.SIGKILL)
        faulted = run.summary(timeout_s=300)
    assert faulted["status"] == "finished"
    (lost,) = faulted["rollout_recoveries"]
    assert lost["engine"] == 0 and lost["fate"], lost
    (recovery,) = faulted["recoveries"]  # the trainer rank, re-formed in place
    assert recovery["restored_from"] == "peers" and recovery["restored_step"] == 3
    assert faulted["rollout"]["generated_steps"] == [1, 3, 5]  # none again
    # the re-formed group sends no weights: the service keeps the step-2 ones it needs
    assert faulted["rollout"]["starts"] == [
        {"step": 0, "kept": True, "weights": True},
        {"step": 3, "kept": True, "weights": False},
    ]
    final_engines = faulted["rollout"]["engines"]
    assert final_engines[1] == list(engines[1])  # kept through the trainer's loss
    assert final_engines[0][1] != engines[0][1]  # the killed engine's replacement
    assert faulted["params_sha256"] == behind["params_sha256"]
    assert faulted["samples_digest"] == behind["samples_digest"]
    faulted_records = step_records(tmp_path, "faulted")
    assert [r["weights_version"] for r in faulted_records] == VERSIONS
    assert faulted_records[-1]["reward"] == behind_records[-1]["reward"]


def test_a_stopped_grpo_run_resumes_on_other_trainers_and_engines(
    ray_local, tmp_path, tmp_path_factory
):
    """The faulted pair's configuration (engines behind, overlap, μ 2) with a checkpoint
    every step, stopped past step 2 (its workers and engines torn down) and resumed on 1
    trainer and 1 engine.  Its newest checkpoint carries the generations made with weights
    older than its own, so the resumed run trains on the very completions the
    uninterrupted run trained on wherever the weights that made them are the
    checkpoint's or older: the same rewards, the schedule's weights versions, and none of
    the carried generations made again."""
    behind, reference = behind_run(tmp_path_factory)
    every_step = [*FAULTED, "checkpoint.every_steps=1"]
    # slowed: a step's record reaches the driver up to a second late (elastic.poll_interval_s),
    # and the stop still lands mid-run
    slowed = grpo_config(tmp_path, "resumed", *every_step, *step_floor(0.6, attempts=2))
    trainer = Trainer(slowed, reward_fns=[says_chosen])
    with FitThread(trainer) as run:
        wait_until(lambda: last_step(trainer) >= 2, "step 2", timeout_s=120)
        trainer.stop("the test")
        stopped = run.join(timeout_s=120)
    assert isinstance(stopped, TrainingFailed) and "the test" in str(stopped)
    smaller = grpo_config(
        tmp_path, "resumed", *every_step, "scaling.num_workers=1", "rollout.engines=1"
    )
    resumed = Trainer(smaller, reward_fns=[says_chosen]).fit()
    at = resumed["restored"]["step"]
    assert resumed["status"] == "finished" and 1 <= at < 6, at
    schedule = WeightsSchedule.of(smaller)
    carried = schedule.carried(at, 6)
    made = [g for g in (3, 5) if g > at and g not in carried]
    assert resumed["rollout"]["generated_steps"] == made
    assert resumed["samples_digest"] == behind["samples_digest"]
    records = {r["step"]: r for r in step_records(tmp_path, "resumed")}  # the resumed last
    assert [records[r["step"]]["weights_version"] for r in reference] == VERSIONS
    shared = [r for r in reference[at:] if schedule.required(schedule.key(r["step"])) <= at]
    assert shared  # made with weights the two runs share: carried, or the checkpoint's
    for r in shared:
        assert records[r["step"]]["reward"] == r["reward"], r["step"]
