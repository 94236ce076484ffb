"""Ray Train's config objects (``ScalingConfig``, ``RunConfig``, ``FailureConfig``,
``CheckpointConfig``, ours or Ray's own, read by field name) -> this project's config.

What has no counterpart here is refused by name with what to use instead, before Ray
starts, rather than silently ignored.  Ray Train's defaults are kept: one worker, no
retries (``FailureConfig.max_failures=0``), ``~/ray_results`` as storage.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import pyarrow.fs as pafs

from raytrain_ext.errors import ConfigError
from raytrain_ext.user_loop.storage import Retention

DEFAULT_STORAGE = "~/ray_results"
NO_STEP_LIMIT = 2**31 - 1  # run.max_steps: the user's function decides when it ends


@dataclass(frozen=True)
class ScalingConfig:
    """Ray Train's ``ScalingConfig`` fields this project takes (``num_workers=(min, max)``
    included)."""

    num_workers: Any = 1
    use_gpu: bool = False
    resources_per_worker: Optional[Dict[str, float]] = None
    placement_strategy: str = "PACK"
    elastic_resize_monitor_interval_s: float = 60.0


@dataclass(frozen=True)
class FailureConfig:
    max_failures: int = 0


@dataclass(frozen=True)
class CheckpointConfig:
    num_to_keep: Optional[int] = None
    checkpoint_score_attribute: Optional[str] = None
    checkpoint_score_order: str = "max"


@dataclass(frozen=True)
class RunConfig:
    name: Optional[str] = None
    storage_path: Optional[str] = None
    storage_filesystem: Any = None
    failure_config: Optional[FailureConfig] = None
    checkpoint_config: Optional[CheckpointConfig] = None


# field -> (the value that means "not used", what to do instead)
UNSUPPORTED: Dict[str, Dict[str, Tuple[Any, str]]] = {
    "ScalingConfig": {
        "trainer_resources": (None, "the driver needs no resources here; drop it"),
        "accelerator_type": (None, "resources_per_worker={'accelerator_type:<T>': 0.001}"),
        "label_selector": (None, "resources_per_worker with a custom node resource"),
        "use_tpu": (False, "GPUs (use_gpu=True) or CPUs"),
        "topology": (None, "GPUs (use_gpu=True) or CPUs"),
    },
    "RunConfig": {
        "callbacks": (None, "read the run's records (metrics.jsonl, TensorBoard) instead"),
        "worker_runtime_env": (None, "ray.init(runtime_env=...) for the job"),
    },
    "FailureConfig": {
        "controller_failure_limit": (-1, "the controller runs in the driver; drop it"),
        "relax_collectives_on_preemption": (False, "drop it"),
    },
}


def refuse_unsupported(obj: Any, kind: str) -> None:
    """A set field without a counterpart here raises ``ConfigError`` naming it."""
    for name, (unused, instead) in UNSUPPORTED.get(kind, {}).items():
        value = vars(obj).get(name, unused)  # Ray's config classes are dataclasses
        if value not in (unused, None, "DEPRECATED", [], {}):
            raise ConfigError(
                f"{kind}.{name}={value!r} is not supported by raytrain_ext.train; use {instead}."
            )


def worker_counts(num_workers: Any) -> Dict[str, int]:
    """``num_workers``: an int, or ``(min, max)`` for an elastic run."""
    if isinstance(num_workers, int) and num_workers >= 1:
        return {"num_workers": num_workers}
    if (
        isinstance(num_workers, (tuple, list))
        and len(num_workers) == 2
        and all(isinstance(n, int) for n in num_workers)
        and 1 <= num_workers[0] <= num_workers[1]
    ):
        low, high = num_workers
        return {"num_workers": high, "min_workers": low, "max_workers": high}
    raise ConfigError(
        f"ScalingConfig.num_workers={num_workers!r}: an int >= 1, or (min, max) with "
        "1 <= min <= max"
    )


def overrides_for(
    scaling: Any, run: Any, name: str, output_dir: str, parallel_timeout_s: Optional[float]
) -> List[str]:
    """The ``key=value`` overrides of this project's config for a ``TorchTrainer`` run."""
    refuse_unsupported(scaling, "ScalingConfig")
    refuse_unsupported(run, "RunConfig")
    failure = run.failure_config or FailureConfig()
    refuse_unsupported(failure, "FailureConfig")
    resources = dict(scaling.resources_per_worker or {})
    if scaling.use_gpu:
        resources.setdefault("GPU", 1.0)
    resources.setdefault("CPU", 0.0 if scaling.use_gpu else 1.0)
    counts = worker_counts(scaling.num_workers)
    settings: Dict[str, Any] = {
        **{f"scaling.{k}": v for k, v in counts.items()},
        # the built-in loop's batch, unused by the user's loop, set to pass its checks
        "data.micro_batch_size": 1,
        "data.global_batch_size": counts["num_workers"],
        "scaling.use_gpu": bool(scaling.use_gpu),
        "scaling.resources_per_worker": resources,
        "scaling.placement_strategy": str(scaling.placement_strategy),
        "elastic.max_failures": int(failure.max_failures),
        # a user's loop re-enters at every re-form and resumes from its last reported
        # checkpoint, so a replacement joining later would cost a second resume: wait for it
        "elastic.replacement": "in_place",
        # Ray Train's pace for growing an elastic run: ours checks and cools down alike
        "elastic.grow_check_s": min(2.0, float(scaling.elastic_resize_monitor_interval_s)),
        "elastic.resize_cooldown_s": float(scaling.elastic_resize_monitor_interval_s),
        "run.name": name,
        "run.output_dir": output_dir,
        "run.max_steps": NO_STEP_LIMIT,
        "checkpoint.enabled": True,
        # each reported checkpoint is also held in memory (``held_reports``) where that beats
        # storage after a fault: storage is remote, or a node may be lost (>1 node: null)
        "checkpoint.memory": True if remote_storage(run) else None,
        "checkpoint.dir": os.path.join(output_dir, name, "unused-builtin-checkpoints"),
    }
    if parallel_timeout_s is not None:
        settings["parallel.timeout_s"] = parallel_timeout_s
    return [f"{key}={json.dumps(value)}" for key, value in settings.items()]


def retention_of(run: Any) -> Retention:
    c = run.checkpoint_config or CheckpointConfig()
    if c.checkpoint_score_order not in ("max", "min"):
        raise ConfigError(
            f"CheckpointConfig.checkpoint_score_order={c.checkpoint_score_order!r}: max or min"
        )
    return Retention(c.num_to_keep, c.checkpoint_score_attribute, c.checkpoint_score_order)


def run_name(run: Any) -> str:
    """``RunConfig.name``, or Ray Train's default ``TorchTrainer_<date>_<time>``."""
    if run.name:
        return str(run.name)
    return "TorchTrainer_" + datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def remote_storage(run: Any) -> bool:
    """Whether the run's checkpoints persist anywhere but the local filesystem (a URI, or
    a ``storage_filesystem`` of another kind)."""
    filesystem = run.storage_filesystem
    if filesystem is not None:
        return not isinstance(filesystem, pafs.LocalFileSystem)
    return "://" in storage_path_of(run)


def storage_path_of(run: Any) -> str:
    path = run.storage_path or DEFAULT_STORAGE
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))
