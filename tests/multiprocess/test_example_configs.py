"""The example SFT and DPO configs (a tiny Llama-family model on the records in
configs/data/) train on 2 gloo processes as shipped, shortened to a few steps: the loss
falls, evaluation runs, DPO's preference accuracy is reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import train_processes

pytest.importorskip("transformers")
CONFIGS = Path(__file__).parents[2] / "configs"


def _run(tmp_path: Path, name: str, steps: int, every: int) -> list:
    overrides = [
        f"run.output_dir={tmp_path / 'runs'}",
        f"run.max_steps={steps}",
        f"optim.decay_steps={steps}",
        f"eval.every_steps={every}",
        "checkpoint.enabled=false",
        "run.tensorboard=false",
    ]
    return train_processes(2, overrides, tmp_path / "out", config=CONFIGS / f"{name}.yaml")[0]


def test_sft_example_config_trains_and_evaluates(tmp_path):
    rank0 = _run(tmp_path, "sft_llama_tiny", steps=10, every=5)
    losses = [r["loss"] for r in rank0["records"]]
    assert losses[-1] < losses[0]
    evals = [r for r in rank0["records"] if "eval_loss" in r]
    assert [r["step"] for r in evals] == [5, 10] and evals[1]["eval_loss"] < evals[0]["eval_loss"]


def test_dpo_example_config_trains_and_reports_preference_accuracy(tmp_path):
    rank0 = _run(tmp_path, "dpo_llama_tiny", steps=10, every=10)
    records = rank0["records"]
    assert records[-1]["loss"] < records[0]["loss"]
    assert 0 <= records[-1]["accuracy"] <= 1 and "eval_accuracy" in records[-1]
