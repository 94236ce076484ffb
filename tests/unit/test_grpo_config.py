"""GRPO's configuration and input, before Ray: ``objective.grpo.*`` are TRL's keys with TRL's
defaults; what cannot run is refused naming the key and the fix (a reward function that
does not import, a prompt record that cannot be one, rows longer than the model's
positions, what is not built yet); the global order names each prompt group by its step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raytrain_ext.config import ConfigError, load_config
from raytrain_ext.data.sampler import GlobalSampler
from raytrain_ext.errors import InputError
from raytrain_ext.objectives import check_objective
from raytrain_ext.rollout.config import check_rollout
from raytrain_ext.rollout.order import RolloutOrder
from raytrain_ext.rollout.prompt_records import check_prompt_data
from tests.helpers.text_data import build_tokenizer, write_jsonl

TRL_KEYS = (
    "num_generations",
    "beta",
    "epsilon",
    "epsilon_high",
    "loss_type",
    "scale_rewards",
    "num_iterations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
)
TINY_HF = (
    "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
    "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 512, "
    "max_position_embeddings: 128}"
)
REWARD = "raytrain_ext.rollout.example_rewards:reward_len"


def check(cfg, reward_fns=None):
    """The driver's checks of the objective and of the rollout, as ``Trainer`` runs them."""
    check_objective(cfg)
    check_rollout(cfg, reward_fns)


def grpo(*extra):
    return load_config(
        None,
        [
            "data.format=prompts",
            "model.source=hf",
            f"model.hf.config={TINY_HF}",
            "model.seq_len=64",
            f"rollout.reward_fns=[{REWARD}]",
            *extra,
        ],
    )


def test_the_grpo_keys_are_trls_with_trls_defaults():
    from trl.trainer.grpo_config import GRPOConfig

    trl = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours = grpo().objective.grpo
    assert {k: ours[k] for k in TRL_KEYS} == {k: trl[k] for k in TRL_KEYS}
    assert grpo().objective.name is None  # data.format=prompts trains grpo
    check(grpo())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.reward_fns=[]"], r"rollout.reward_fns: objective.name=grpo needs at least one"),
        (["rollout.reward_fns=[nowhere.at_all:fn]"], r"rollout.reward_fns: cannot import nowhere"),
        (["rollout.reward_weights=[1.0,2.0]"], r"rollout.reward_weights: 2 weights for 1 reward"),
        (["objective.grpo.top_p=0"], r"objective.grpo.top_p: must be in \(0, 1\]"),
        (["model.source=gpt"], r"model.source: objective.name=grpo generates with Hugging Face"),
        (["eval.fraction=0.1"], r"eval.fraction: evaluating GRPO .* is not built yet"),
        (["data.format=chat", "objective.name=grpo"], r"objective.name=grpo does not train on"),
        (["objective.name=sft"], r"objective.name=sft does not train on data.format=prompts"),
        (
            ["guards.nan_policy=rollback"],
            r"guards.nan_policy: not supported .* set guards.nan_policy=skip_step or fail",
        ),
        (
            ["objective.name=user", f"objective.fn={REWARD}"],
            r"objective.name: data.format=prompts is generated from and trained by",
        ),
    ],
)
def test_what_cannot_run_is_refused_naming_the_key(overrides, message):
    with pytest.raises(InputError, match=message):
        check(grpo(*overrides))


def test_reward_functions_belong_to_grpo_and_come_from_one_place():
    with pytest.raises(InputError, match=r"reward_fns were also given from Python"):
        check(grpo(), reward_fns=[len])
    check(grpo("rollout.reward_fns=[]"), reward_fns=[len])
    with pytest.raises(InputError, match=r"reward_fns: 3 is not callable"):
        check(grpo("rollout.reward_fns=[]"), reward_fns=[3])
    tokens = load_config(None, [f"rollout.reward_fns=[{REWARD}]"])
    with pytest.raises(InputError, match=r"only objective.name=grpo has \(this run trains"):
        check(tokens)


def test_fewer_than_two_generations_is_refused_by_the_schema():
    with pytest.raises(ConfigError, match=r"objective.grpo.num_generations: must be >= 2"):
        grpo("objective.grpo.num_generations=1")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), with_chat_template=True)


def prompt_config(tmp_path, tokenizer, records, *extra):
    path = write_jsonl(tmp_path / "prompts.jsonl", records)
    return grpo(f"data.path={path}", f"data.tokenizer={tokenizer}", "data.global_batch_size=2",
                "data.micro_batch_size=1", "objective.grpo.max_completion_length=16", *extra)  # fmt: skip


def test_prompt_records_are_checked_before_ray_naming_the_record(tmp_path, tokenizer):
    chat = [{"role": "user", "content": "a"}]
    good = [{"prompt": "the cat", "answer": 1}, {"prompt": chat, "answer": 2}]
    check_prompt_data(prompt_config(tmp_path, tokenizer, good))
    cases = [
        ([{"text": "the cat"}] * 2, r"has no 'prompt' or 'messages' column"),
        ([good[0], {"prompt": 3}], r"prompt record 1: 'prompt' must be text or a list"),
        ([good[0]], r"holds 1 prompts, fewer than one global batch"),
        (
            [good[0], {"prompt": "the " * 120}],
            r"max_completion_length: prompt record 1 .* has 120 ",
        ),
    ]
    for records, message in cases:
        with pytest.raises(InputError, match=message):
            check_prompt_data(prompt_config(tmp_path, tokenizer, records))


def test_the_order_names_each_prompt_group_by_its_step():
    order = RolloutOrder(GlobalSampler(5, 3, seed=1))
    upcoming = order.peek_global_batch()
    first = order.next_global_batch()
    assert np.array_equal(first, upcoming)
    step, prompts = order.split(first)
    assert step == 1 and np.array_equal(prompts, order.prompts_of(1))
    second = order.next_global_batch()  # crosses into the second epoch: ids stay distinct
    assert order.split(second)[0] == 2 and not set(first) & set(second)
    saved = order.state_dict()
    resumed = RolloutOrder(GlobalSampler(5, 3, seed=1))
    resumed.load_state_dict(saved)
    assert np.array_equal(resumed.next_global_batch(), order.next_global_batch())
    with pytest.raises(ValueError, match=r"are not of one step"):
        order.split(np.concatenate([first, second]))
    with pytest.raises(InputError, match=r"not trained with objective.name=grpo"):
        resumed.load_state_dict(GlobalSampler(5, 3, seed=1).state_dict())


def test_with_num_iterations_each_generation_trains_that_many_steps_under_their_own_ids():
    order = RolloutOrder(GlobalSampler(7, 3, seed=1), iterations=3)
    batches = []
    for _ in range(5):
        upcoming = order.peek_global_batch()
        batches.append(order.next_global_batch())
        assert np.array_equal(batches[-1], upcoming)
    steps_prompts = [order.split(ids) for ids in batches]
    assert [step for step, _ in steps_prompts] == [1, 2, 3, 4, 5]
    assert [order.generation_step(s) for s in range(1, 8)] == [1, 1, 1, 4, 4, 4, 7]
    first, fourth = steps_prompts[0][1], steps_prompts[3][1]
    assert all(np.array_equal(prompts, first) for _, prompts in steps_prompts[:3])
    assert np.array_equal(steps_prompts[4][1], fourth) and not np.array_equal(first, fourth)
    assert len({i for ids in batches for i in ids.tolist()}) == 15  # each step's ids its own
    resumed = RolloutOrder(GlobalSampler(7, 3, seed=1), iterations=3)
    resumed.load_state_dict(order.state_dict())  # mid-generation: step 6 repeats step 5's
    assert np.array_equal(resumed.next_global_batch(), order.next_global_batch())
    assert np.array_equal(
        resumed.split(resumed.next_global_batch())[1], order.prompts.peek_global_batch()
    )


def test_the_vllm_backend_is_refused_without_the_extra_or_without_a_gpu(monkeypatch):
    """``rollout.backend=vllm``: the extra where the driver runs (this machine has none),
    and a GPU for every engine; both refused before Ray, naming the key and the fix."""
    import importlib.util

    cfg = grpo("rollout.backend=vllm")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(InputError, match=r"pip install 'raytrain-ext\[vllm\]'"):
            check(cfg)
        real = importlib.util.find_spec
        monkeypatch.setattr(  # as where the extra is installed
            importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name)
        )
    with pytest.raises(InputError, match=r"rollout.resources_per_engine: the vllm backend .* GPU"):
        check(cfg)
