"""Reward functions (raytrain_ext.rollout.rewards): TRL's signature, every column passed
through, None left out, and every way a reward can go wrong stops with the function's
name and the prompt's index instead of becoming a reward of 0."""

import math

import pytest

from raytrain_ext.errors import InputError
from raytrain_ext.rollout.rewards import (
    RewardError,
    ScoredGroup,
    load_reward_fn,
    score_groups,
)


def length_reward(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def answer_reward(prompts, completions, answer, **columns):
    return [
        None if a is None else float(c.strip() == a)
        for c, a in zip(completions, answer, strict=True)
    ]


def groups():
    return [
        ScoredGroup(10, "2+2=", ["4", " 5", "four"], {"answer": "4"}),
        ScoredGroup(11, "3+3=", ["6 ", "7"], {"answer": None}),
    ]


def test_each_function_scores_every_completion_with_the_prompts_columns():
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [0.5] * len(completions)

    scores = score_groups([length_reward, answer_reward, spy], groups())
    assert seen["prompts"] == ["2+2="] * 3 + ["3+3="] * 2  # TRL's: one prompt per completion
    assert seen["columns"] == {"answer": ["4"] * 3 + [None] * 2}
    assert scores[0] == [[1.0, 1.0, 0.5], [2.0, 0.0, 0.5], [4.0, 0.0, 0.5]]
    assert [row[0] for row in scores[1]] == [2.0, 1.0]
    assert all(math.isnan(row[1]) for row in scores[1])  # None: does not apply, not 0


@pytest.mark.parametrize(
    "reward, text",
    [
        (
            lambda p, c, **k: 1 / 0,
            r"raised ZeroDivisionError: division by zero \(prompts from index 10\)",
        ),
        (lambda p, c, **k: [1.0], "returned 1 values for 5 completions"),
        (
            lambda p, c, **k: [1.0, 2.0, float("nan"), 0.0, 0.0],
            "returned nan for a completion of prompt 10",
        ),
        (
            lambda p, c, **k: [1.0, 2.0, 3.0, "1", 0.0],
            r"returned '1' \(str\) for a completion of prompt 11",
        ),
        (lambda p, c, **k: [True] * 5, r"returned True \(bool\) for a completion of prompt 10"),
        (lambda p, c, **k: 1.0, "returned float, not a list"),
    ],
    ids=["raises", "short", "nan", "string", "bool", "scalar"],
)
def test_a_broken_reward_stops_naming_the_function_and_the_prompt(reward, text):
    with pytest.raises(RewardError, match=text) as caught:
        score_groups([length_reward, reward], groups())
    assert "<lambda>" in str(caught.value)  # the function's own name


def test_reward_functions_are_loaded_by_name_with_the_key_in_the_error():
    assert load_reward_fn("tests.unit.test_rollout_rewards:length_reward") is length_reward
    with pytest.raises(
        InputError, match="rollout.reward_fns: tests.unit.test_rollout_rewards has no 'nope'"
    ):
        load_reward_fn("tests.unit.test_rollout_rewards:nope")
    with pytest.raises(InputError, match="rollout.reward_fns: 'nope' is not 'pkg.module:name'"):
        load_reward_fn("nope")
    with pytest.raises(InputError, match="prompt 11 has the columns"):
        score_groups([length_reward], [groups()[0], ScoredGroup(11, "x", ["y"], {})])
