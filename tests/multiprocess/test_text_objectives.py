"""The example SFT and DPO configs (configs/*_llama_tiny.yaml: a tiny Llama on the records in
configs/data/, tokenized at start into the run's cache) through the real loop on gloo
processes, with evaluation: world-size independence, learning, and a resume on another world
size."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers.dist import train_processes

CONFIGS = Path(__file__).parents[2] / "configs"


def test_sft_example_is_world_size_independent_and_evaluated(tmp_path):
    """configs/sft_llama_tiny.yaml (a tiny Llama under FSDP, chat records tokenized at start)
    on 1 vs 2 ranks: the same samples, losses and evaluations equal to float32 summation-order
    noise (each loss is a mean of ~100 response-token terms: |err| << 1e-4); the loss falls.
    (That evaluation leaves parameters and samples unchanged is shown bit for bit across a
    kill in tests/ray/test_hf_elastic.py.)"""
    overrides = [
        f"run.output_dir={tmp_path / 'runs'}",
        "run.max_steps=6",
        "optim.decay_steps=6",
        "eval.every_steps=3",
        "checkpoint.enabled=false",
        "run.tensorboard=false",
    ]
    config = CONFIGS / "sft_llama_tiny.yaml"
    two = train_processes(2, overrides, tmp_path / "two", config=config)
    one = train_processes(1, overrides, tmp_path / "one", config=config)
    assert two[0]["result"]["samples_digest"] == one[0]["result"]["samples_digest"]
    losses = lambda run: np.array([r["loss"] for r in run[0]["records"]])  # noqa: E731
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-4)
    assert losses(one)[-1] < losses(one)[0]
    evals = [r for r in one[0]["records"] if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(r["eval_ppl"] > 1 for r in evals)
    two_evals = [r["eval_loss"] for r in two[0]["records"] if "eval_loss" in r]
    np.testing.assert_allclose(two_evals, [r["eval_loss"] for r in evals], rtol=1e-4)


def _dpo(tmp_path: Path, name: str, *extra: str) -> list:
    return [
        f"run.output_dir={tmp_path / name}",
        "run.max_steps=12",
        "optim.decay_steps=12",
        "eval.every_steps=6",
        "checkpoint.every_steps=6",
        "run.tensorboard=false",
        *extra,
    ]


def test_dpo_example_learns_the_preference_and_resumes_on_another_world_size(tmp_path):
    """configs/dpo_llama_tiny.yaml (a tiny Llama under DDP; the preference: end the sentence
    with '.', not '?'): preference accuracy starts at 0 (policy = reference) and ends above 0.9
    on the held-out tenth.  Stopped at step 6 on 2 ranks and resumed on 1, the run consumes the
    same samples as the uninterrupted one and its reference log-probs come from the checkpoint
    (the losses agree to summation-order noise)."""
    config = CONFIGS / "dpo_llama_tiny.yaml"
    whole = train_processes(2, _dpo(tmp_path, "w"), tmp_path / "whole", config=config)
    records = whole[0]["records"]
    assert records[0]["accuracy"] == 0 and records[-1]["eval_accuracy"] > 0.9, records[-1]
    assert records[-1]["eval_reward_margin"] > 0 and records[-1]["loss"] < records[0]["loss"]
    part = _dpo(tmp_path, "r", f"checkpoint.dir={tmp_path / 'ckpt'}")
    train_processes(2, [*part, "run.max_steps=6"], tmp_path / "first", config=config)
    resumed = train_processes(1, part, tmp_path / "second", config=config)
    assert resumed[0]["result"]["restored"]["step"] == 6
    assert resumed[0]["result"]["samples_digest"] == whole[0]["result"]["samples_digest"]
    tail = lambda run: np.array([r["loss"] for r in run[0]["records"] if r["step"] > 6])  # noqa: E731
    np.testing.assert_allclose(tail(resumed), tail(whole), rtol=1e-3, atol=1e-5)
