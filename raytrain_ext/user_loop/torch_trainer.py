"""``TorchTrainer``: Ray Train's trainer, run by this project's elastic controller.

The same constructor and ``fit() -> Result``; what changes is what a fault costs: a
failed rank's peers keep their processes and enter ``train_loop_per_worker`` again (a
lost rank gets a prestarted process), and ``report(checkpoint=...)`` only stages the
directory (hard links) before the loop goes on (``user_loop.staging``, ``uploader``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from raytrain_ext.config import load_config
from raytrain_ext.errors import ConfigError
from raytrain_ext.trainer import Trainer
from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.loop_function import LoopFunction, takes_config
from raytrain_ext.user_loop.ray_train_config import (
    RunConfig,
    ScalingConfig,
    overrides_for,
    retention_of,
    run_name,
    storage_path_of,
)
from raytrain_ext.user_loop.storage import RunStorage, storage_root

log = logging.getLogger(__name__)


@dataclass
class Result:
    """Ray Train's ``Result``: rank 0's last reported ``metrics``, the newest persisted
    ``checkpoint``, the run's ``path`` in storage, ``best_checkpoints`` (the kept ones,
    worst first, as Ray Train orders them) and every report in ``metrics_history``
    (``metrics_dataframe`` as pandas: all reports, where Ray Train's has the kept
    checkpoints' only)."""

    metrics: Optional[Dict[str, Any]]
    checkpoint: Optional[Checkpoint]
    path: str
    error: Optional[BaseException] = None
    best_checkpoints: List[Tuple[Checkpoint, Dict[str, Any]]] = field(default_factory=list)
    metrics_history: List[Dict[str, Any]] = field(default_factory=list)
    summary: Dict[str, Any] = field(default_factory=dict)  # this project's summary.json

    @property
    def metrics_dataframe(self):
        import pandas as pd

        return pd.DataFrame(self.metrics_history)


class TorchTrainer:
    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: Optional[Dict[str, Any]] = None,
        torch_config: Any = None,
        scaling_config: Any = None,
        run_config: Any = None,
        datasets: Optional[Dict[str, Any]] = None,
        dataset_config: Any = None,
        resume_from_checkpoint: Optional[Checkpoint] = None,
        metadata: Optional[Dict[str, Any]] = None,
    ):
        """As Ray Train's.  ``torch_config``: only its ``timeout_s`` is taken (the process
        group's); ``dataset_config`` is refused (each dataset is split by
        ``get_dataset_shard``).  Everything is checked here, before Ray starts."""
        if not callable(train_loop_per_worker):
            raise ConfigError("train_loop_per_worker: a function (config) -> None")
        takes_config(train_loop_per_worker)  # more than one argument is refused now
        if dataset_config is not None:
            raise ConfigError(
                "TorchTrainer(dataset_config=...) is not supported by raytrain_ext.train; "
                "each dataset is split by get_dataset_shard in a world-size-independent order"
            )
        scaling = scaling_config if scaling_config is not None else ScalingConfig()
        run = run_config if run_config is not None else RunConfig()
        self.name = run_name(run)
        storage_path = storage_path_of(run)
        records_dir = storage_path if "://" not in storage_path else storage_path_of(RunConfig())
        timeout_s = None if torch_config is None else vars(torch_config).get("timeout_s")
        self.cfg = load_config(None, overrides_for(scaling, run, self.name, records_dir, timeout_s))
        fs, root = storage_root(storage_path, self.name, run.storage_filesystem)
        self.storage = RunStorage(fs, root, retention_of(run))
        self.loop = LoopFunction(
            fn=train_loop_per_worker,
            config=train_loop_config,
            storage=self.storage,
            experiment_name=self.name,
            resume_from=resume_from_checkpoint,
            datasets=dict(datasets or {}),
            metadata=dict(metadata or {}),
        )
        self._trainer = Trainer(self.cfg, train_loop=self.loop)

    @property
    def controller(self):
        """The running attempt's controller (its records and group; another thread may
        watch it), None before ``fit``."""
        return self._trainer.controller

    def stop(self, reason: str = "stopped by the user") -> None:
        """End a ``fit`` running in another thread (``Trainer.stop``)."""
        self._trainer.stop(reason)

    def fit(self) -> Result:
        """Run the loop on every worker until it returns; raises ``TrainingFailed`` (one
        line: the rank, its node, the user's error) when the run fails for good."""
        summary = self._trainer.fit()
        controller = self._trainer.controller
        records = [] if controller is None else controller.result.records
        history = [r["reported"] for r in records if "reported" in r]
        failed = (summary.get("checkpoint") or {}).get("upload_failures")
        if failed:
            log.warning("checkpoints not persisted to %s: %s", self.storage.root, failed)
        latest = self.storage.latest()
        return Result(
            metrics=history[-1] if history else None,
            checkpoint=None if latest is None else latest.checkpoint,
            path=self.storage.root,
            best_checkpoints=[(c.checkpoint, c.metrics) for c in self.storage.best()],
            metrics_history=history,
            summary=summary,
        )
