"""Raw text records through the real loop on gloo processes: SFT on chat examples and DPO
on preference records, tokenized at start into the run's cache, with evaluation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.dist import train_processes
from tests.helpers.text_data import (
    build_tokenizer,
    preference_records,
    prompt_response_records,
    write_jsonl,
)

TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32"]


@pytest.fixture(scope="module")
def text_inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    build_tokenizer(root / "tokenizer", with_chat_template=False)
    write_jsonl(root / "chat.jsonl", prompt_response_records(96, seed=1))
    write_jsonl(root / "pref.jsonl", preference_records(128, seed=2))
    return root


def _sft(root: Path, out: Path, *extra: str) -> list:
    return [
        *TINY,
        f"run.output_dir={out}",
        f"data.path={root / 'chat.jsonl'}",
        "data.format=chat",
        f"data.tokenizer={root / 'tokenizer'}",
        "objective.name=sft",
        "data.global_batch_size=8",
        "data.micro_batch_size=2",
        "run.max_steps=6",
        "optim.warmup_steps=1",
        "checkpoint.enabled=false",
        *extra,
    ]


def test_sft_on_chat_records_is_world_size_independent_and_evaluated(text_inputs, tmp_path):
    """1 vs 2 ranks: the same samples, losses and evaluations equal to float32 summation-order
    noise.  (That evaluation leaves parameters and samples unchanged is shown bit for bit
    across a kill in tests/ray/test_hf_elastic.py.)"""
    evaluated = _sft(text_inputs, tmp_path / "a", "eval.every_steps=3", "eval.fraction=0.1")
    two = train_processes(2, evaluated, tmp_path / "two")
    one = train_processes(1, evaluated, tmp_path / "one")
    assert two[0]["result"]["samples_digest"] == one[0]["result"]["samples_digest"]
    losses = lambda run: np.array([r["loss"] for r in run[0]["records"]])  # noqa: E731
    # each loss is a mean of ~100 float32 token terms summed in another order: |err| << 1e-4
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-4)
    evals = [r for r in one[0]["records"] if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_ppl"] > 1 for r in evals)
    two_evals = [r["eval_loss"] for r in two[0]["records"] if "eval_loss" in r]
    np.testing.assert_allclose(two_evals, [r["eval_loss"] for r in evals], rtol=1e-4)


def _dpo(root: Path, out: Path, *extra: str) -> list:
    return [
        *TINY,
        f"run.output_dir={out}",
        f"data.path={root / 'pref.jsonl'}",
        "data.format=preference",
        f"data.tokenizer={root / 'tokenizer'}",
        "objective.name=dpo",
        "objective.dpo.beta=0.5",
        "data.global_batch_size=16",
        "data.micro_batch_size=4",
        "run.max_steps=24",
        "optim.decay_steps=24",
        "optim.warmup_steps=2",
        "optim.lr=3e-3",
        "eval.every_steps=12",
        "eval.fraction=0.25",
        *extra,
    ]


def test_dpo_learns_the_preference_and_resumes_on_another_world_size(text_inputs, tmp_path):
    """The synthetic preference (chosen says 'yes', rejected 'no') is learned: held-out
    preference accuracy ends above 0.9.  Stopped at step 12 on 2 ranks and resumed on 1,
    the run consumes the same samples as the uninterrupted one, and its reference
    log-probs come from the checkpoint (the losses agree to summation-order noise)."""
    ckpt = "checkpoint.every_steps=12"
    whole = train_processes(2, _dpo(text_inputs, tmp_path / "w", ckpt), tmp_path / "whole")
    final = whole[0]["records"][-1]
    assert final["eval_accuracy"] > 0.9, final
    assert final["eval_reward_margin"] > 0
    part = _dpo(text_inputs, tmp_path / "r", ckpt, f"checkpoint.dir={tmp_path / 'ckpt'}")
    train_processes(2, [*part, "run.max_steps=12"], tmp_path / "first")
    resumed = train_processes(1, part, tmp_path / "second")
    assert resumed[0]["result"]["restored"]["step"] == 12
    assert resumed[0]["result"]["samples_digest"] == whole[0]["result"]["samples_digest"]
    tail = lambda run: np.array([r["loss"] for r in run[0]["records"] if r["step"] > 12])  # noqa: E731
    np.testing.assert_allclose(tail(resumed), tail(whole), rtol=1e-3)
