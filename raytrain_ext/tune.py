"""Hyperparameter sweeps with Ray Tune: each trial is one elastic training run.

    from ray import tune
    from raytrain_ext.tune import concurrent_trials, training_trial

    trainable = training_trial("configs/tiny_cpu.yaml", ["run.max_steps=200"])
    tuner = tune.Tuner(trainable, param_space={"optim.lr": tune.grid_search([1e-3, 3e-3])},
                       tune_config=tune.TuneConfig(metric="final_loss", mode="min",
                           max_concurrent_trials=concurrent_trials("configs/tiny_cpu.yaml")))
    best = tuner.fit().get_best_result()

How resources are split (the Ray Train V2 arrangement): a trial reserves only a
small CPU share for its driver, and the run inside it places its own worker
group, as it does outside Tune. The worker group's placement group is not nested
in the trial's, because the elastic controller re-places the gang after failures,
sized by the cluster's free resources; bundles reserved by Tune would not show as
free and could not grow. Tune therefore does not see the workers' resources, so
``max_concurrent_trials`` must keep the running trials' worker groups within the
cluster: ``concurrent_trials`` computes it. Trials beyond it would wait for a
placement and, past ``scaling.placement_timeout_s``, fail.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from raytrain_ext.config import load_config
from raytrain_ext.trainer import Trainer, absolute_paths

DRIVER_CPUS = 0.25  # a trial's own process only waits on its workers


def training_trial(
    config: Optional[str | Path] = None,
    overrides: Sequence[str] = (),
    *,
    driver_cpus: float = DRIVER_CPUS,
) -> Callable[[dict], None]:
    """A Tune function trainable that trains ``config`` + ``overrides`` + the trial's params.

    Param keys are dotted config keys (``{"optim.lr": 1e-3}``, or nested dicts that
    flatten to them). The config is checked here, before any trial starts, and its
    text travels with the trainable, so trials need no access to the file. Relative
    paths resolve against the current directory, not the trial's (Tune moves each
    trial into a directory of its own). Each trial's run is named
    ``<run.name>-<trial id>`` and reports the scalar fields of its summary.json
    (``final_loss``, ``steps_completed``, ``status``, ...) plus ``run_dir``.
    """
    from ray import tune

    overrides = list(overrides)
    base = load_config(config, overrides)
    yaml_text = Path(config).read_text() if config is not None else None
    start_dir = Path.cwd()

    def train_trial(params: dict) -> None:
        ctx = tune.get_context()
        trial_overrides = [
            *overrides,
            f"run.name={base.run.name}-{ctx.get_trial_id()}",
            *param_overrides(params),
        ]
        cfg = load_config(_config_copy(yaml_text, ctx.get_trial_dir()), trial_overrides)
        trainer = Trainer(absolute_paths(cfg, base=start_dir))
        summary = trainer.fit()
        tune.report({**scalar_fields(summary), "run_dir": str(trainer.run_dir)})

    return tune.with_resources(train_trial, {"CPU": driver_cpus})


def param_overrides(params: Mapping[str, Any], prefix: str = "") -> List[str]:
    """``{"optim": {"lr": 0.1}, "run.seed": 3}`` -> ``["optim.lr=0.1", "run.seed=3"]``."""
    items: List[str] = []
    for key, value in params.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            items += param_overrides(value, prefix=f"{dotted}.")
        else:
            items.append(f"{dotted}={'null' if value is None else value}")
    return items


def scalar_fields(summary: Mapping[str, Any]) -> Dict[str, Any]:
    """What Tune can show and compare: numbers, strings and booleans (no histories)."""
    return {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))}


def concurrent_trials(
    config: Optional[str | Path] = None,
    overrides: Sequence[str] = (),
    *,
    cluster_resources: Optional[Mapping[str, float]] = None,
    driver_cpus: float = DRIVER_CPUS,
) -> int:
    """How many trials' drivers and worker groups fit the cluster's totals at once.

    A trial is counted at ``scaling.max_workers`` (its elastic group may grow that
    far), so trials never starve each other of the capacity one of them grows into.
    A bound, not a placement: workers are packed per node, so a cluster of many
    small nodes may fit fewer. ``cluster_resources`` defaults to the connected Ray
    cluster's ``ray.cluster_resources()``.
    """
    cfg = load_config(config, overrides)
    if cluster_resources is None:
        import ray

        cluster_resources = ray.cluster_resources()
    workers = cfg.scaling.max_workers
    need = {k: float(v) * workers for k, v in cfg.scaling.resources_per_worker.items() if v}
    need["CPU"] = need.get("CPU", 0.0) + driver_cpus
    fits = min(math.floor(cluster_resources.get(k, 0.0) / v + 1e-9) for k, v in need.items())
    if fits < 1:
        raise ValueError(
            f"one trial needs {need} (scaling.max_workers={workers} x "
            f"scaling.resources_per_worker, plus {driver_cpus} CPU for the trial) but the "
            f"cluster has {dict(cluster_resources)}. Lower scaling.max_workers (and "
            "num_workers) or scaling.resources_per_worker, or add nodes."
        )
    return fits


def _config_copy(yaml_text: Optional[str], trial_dir: str) -> Optional[Path]:
    """The sweep's config file, written into the trial's directory (also a record of it)."""
    if yaml_text is None:
        return None
    path = Path(trial_dir) / "base_config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml_text)
    return path
