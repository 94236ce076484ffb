"""The user's model handed to the Trainer from Python (a notebook's closure, no importable
factory): pickled to the Ray workers, trained on both ranks, and refused before Ray when the
config does not say model.source=python."""

from __future__ import annotations

import pytest

from raytrain_ext import Trainer
from raytrain_ext.config import ConfigError, load_config
from tests.helpers.runs import tiny_overrides
from tests.helpers.user_models import TinyLM


def test_a_model_given_from_python_trains_on_the_ray_workers(ray_local, tmp_path):
    width = 48  # captured by the closure: nothing here is importable by name on a worker

    def build(model_cfg, seed):
        import torch

        torch.manual_seed(seed)
        return TinyLM(model_cfg.vocab_size, width, 2)

    cfg = load_config(
        None,
        tiny_overrides(
            tmp_path, "model.source=python", "model.block_class=TinyBlock", "parallel.strategy=fsdp"
        ),
    )
    summary = Trainer(cfg, model=build).fit()
    assert summary["status"] == "finished" and summary["steps_completed"] == 6
    assert summary["final_loss"] < summary["first_loss"]


def test_a_model_argument_needs_the_python_source_and_a_python_source_needs_a_model(tmp_path):
    with pytest.raises(ConfigError, match=r"model.source: Trainer\(cfg, model=...\) trains"):
        Trainer(load_config(None, tiny_overrides(tmp_path)), model=lambda c, s: None)
    python = load_config(None, tiny_overrides(tmp_path, "model.source=python"))
    with pytest.raises(ConfigError, match=r"model.factory: model.source=python needs"):
        Trainer(python)
    tp = load_config(
        None,
        tiny_overrides(
            tmp_path,
            "model.source=python",
            "parallel.strategy=fsdp",
            "parallel.tp=2",
            "scaling.num_workers=2",
        ),
    )
    with pytest.raises(ConfigError, match=r"parallel.tp: the model given to Trainer gives no"):
        Trainer(tp, model=lambda c, s: None)
    assert not (tmp_path / "tiny").exists()
