"""Ray Tune sweeps over elastic training runs (raytrain_ext.tune)."""

import json
import math
import time
from pathlib import Path

import pytest

from raytrain_ext.tune import concurrent_trials, param_overrides, scalar_fields

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")


def test_param_space_becomes_dotted_overrides():
    params = {"optim.lr": 0.001, "model": {"n_layers": 2, "dropout": None}, "run.tag": [1, 2]}
    assert param_overrides(params) == [
        "optim.lr=0.001",
        "model.n_layers=2",
        "model.dropout=null",
        "run.tag=[1, 2]",
    ]


def test_only_scalar_summary_fields_are_reported():
    summary = {
        "final_loss": 5.1,
        "status": "finished",
        "steps_completed": 4,
        "replicas_identical": True,
        "loss_history": [[1, 5.5]],
        "error": None,
    }
    assert scalar_fields(summary) == {
        "final_loss": 5.1,
        "status": "finished",
        "steps_completed": 4,
        "replicas_identical": True,
    }


def test_concurrent_trials_counts_worker_groups_plus_trial_drivers():
    assert concurrent_trials(CONFIG, cluster_resources={"CPU": 4.0}) == 1  # 2 x 1 + 0.25
    assert concurrent_trials(CONFIG, cluster_resources={"CPU": 4.5}) == 2
    assert (
        concurrent_trials(
            CONFIG, ["scaling.resources_per_worker.CPU=0.5"], cluster_resources={"CPU": 4.0}
        )
        == 3
    )  # 2 x 0.5 + 0.25
    with pytest.raises(ValueError, match=r"scaling.max_workers=2 .* Lower scaling.max_workers"):
        concurrent_trials(CONFIG, cluster_resources={"CPU": 2.0})
    elastic = ["scaling.min_workers=1", "scaling.max_workers=4"]  # may grow to 4 x 1 + 0.25
    assert concurrent_trials(CONFIG, elastic, cluster_resources={"CPU": 8.5}) == 2


def test_relative_paths_resolve_against_the_sweeps_directory_not_the_trials():
    from raytrain_ext.config import load_config
    from raytrain_ext.trainer import absolute_paths

    cfg = absolute_paths(
        load_config(CONFIG, ["run.output_dir=runs", "data.path=data/x.arrow"]), base=Path("/sweep")
    )
    assert cfg.run.output_dir == "/sweep/runs" and cfg.data.path == "/sweep/data/x.arrow"
    assert cfg.checkpoint.dir == "/sweep/runs/tiny/checkpoints"
    assert absolute_paths(cfg, base=Path("/elsewhere")).run.output_dir == "/sweep/runs"


def _wait_for_no_placement_groups(timeout_s=15.0):
    from tests.helpers.leaks import live_placement_groups, live_worker_actors

    deadline = time.time() + timeout_s
    while (left := (live_worker_actors(), live_placement_groups())) != ([], []):
        assert time.time() < deadline, f"left behind (actors, placement groups): {left}"
        time.sleep(0.25)


@pytest.mark.slow
def test_tuner_sweeps_lr_with_one_training_run_per_trial(ray_local, tmp_path, monkeypatch):
    from ray import tune

    from raytrain_ext.tune import training_trial

    monkeypatch.chdir(tmp_path)  # relative run.output_dir lands here, not in Tune's trial dirs
    overrides = [
        "run.max_steps=4",
        "run.log_every=2",
        "run.tensorboard=false",
        "run.output_dir=runs",
        "optim.warmup_steps=0",
    ]
    limit = concurrent_trials(CONFIG, overrides)
    assert limit == 1  # 4 CPUs: one trial's driver (0.25) + 2 workers (1 each) at a time
    tuner = tune.Tuner(
        training_trial(CONFIG, overrides),
        param_space={"optim.lr": tune.grid_search([1e-3, 1e-2])},
        tune_config=tune.TuneConfig(metric="final_loss", mode="min", max_concurrent_trials=limit),
        run_config=tune.RunConfig(name="lr-sweep", storage_path=str(tmp_path / "tune"), verbose=0),
    )
    results = tuner.fit()

    assert results.num_terminated == 2 and results.num_errors == 0, results.errors
    by_lr = {r.config["optim.lr"]: r.metrics for r in results}
    assert set(by_lr) == {1e-3, 1e-2}
    for lr, metrics in by_lr.items():
        run_dir = Path(metrics["run_dir"])
        assert run_dir.parent == tmp_path / "runs" and run_dir.name == f"tiny-{metrics['trial_id']}"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == metrics["status"] == "finished"
        assert summary["steps_completed"] == 4 and summary["final_loss"] == metrics["final_loss"]
        assert math.isfinite(metrics["final_loss"])
        assert f"lr: {lr}" in (run_dir / "config.yaml").read_text()
    assert by_lr[1e-3]["final_loss"] != by_lr[1e-2]["final_loss"]
    assert by_lr[1e-3]["first_loss"] == by_lr[1e-2]["first_loss"]  # same seed, same start
    best_lr = min(by_lr, key=lambda lr: by_lr[lr]["final_loss"])
    assert results.get_best_result().config["optim.lr"] == best_lr
    _wait_for_no_placement_groups()
