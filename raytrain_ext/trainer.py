"""The Python API: ``Trainer(config).fit()``, used by the CLI, jobs and notebooks.

``fit`` checks everything it can on the driver first (``inputs/preflight``: paths,
data, S3, an explicit resume), then records an attempt in ``runs/<name>/`` (see
``run_dir``), connects to Ray (an already-initialised session,
``scaling.ray_address``, ``RAY_ADDRESS``, or a new local instance) and runs the
controller.  A Ray instance that ``fit`` started is stopped again.
"""

from __future__ import annotations

import copy
import importlib.metadata
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from raytrain_ext.checkpoint.tiers.memory import start_memory_tier, stop_memory_tier
from raytrain_ext.config import config_digest, config_from_dict, load_config, to_dict, to_yaml
from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.ray_input import materialise_dataset
from raytrain_ext.data.row_input import start_row_readers
from raytrain_ext.data.stream_input import is_stream, start_stream_reader, stream_config, streams
from raytrain_ext.elastic.controller import Controller, ControllerResult, RunState
from raytrain_ext.errors import InputError
from raytrain_ext.inputs.preflight import preflight
from raytrain_ext.messages import FitResult
from raytrain_ext.metrics import FanOut, MetricsSink, StdoutSink, TensorBoardSink, summarize_records
from raytrain_ext.metrics.sinks import JsonlSink, ReportSink, eval_fields
from raytrain_ext.metrics.start_phases import start_phases
from raytrain_ext.models.sources import model_source
from raytrain_ext.objectives import check_objective, objective_name
from raytrain_ext.ray_group.cluster import RayCluster
from raytrain_ext.ray_group.port import RayGroup
from raytrain_ext.ray_session import connect_ray, stop_private_ray
from raytrain_ext.rollout.config import check_rollout
from raytrain_ext.run_dir import METRICS, SUMMARY, RunDirectory, refuse_finished_run
from raytrain_ext.user_code import UserCode
from raytrain_ext.worker.priority import with_niceness
from raytrain_ext.worker.process_env import rank_env_vars

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        config: DictConfig | str | Path | None = None,
        overrides: Sequence[str] = (),
        model: Any = None,
        loss_fn: Optional[Callable] = None,
        dataset: Any = None,
        train_loop: Any = None,
        reward_fns: Optional[Sequence[Callable]] = None,
    ):
        """``config`` is a loaded config, a YAML path, or None for the packaged default.

        ``model``: with ``model.source=python``, your model from Python instead of
        ``model.factory``: a callable ``(model_cfg, seed) -> nn.Module`` or a ``ModelSpec``.
        ``loss_fn``: your objective instead of ``objective.fn``: ``(logits, batch) ->`` the
        sum of its per-token losses.  Both are pickled to every worker (cloudpickle: a
        closure or a class defined in a notebook works), so they must behave the same on
        every rank.

        ``dataset``: a ``ray.data.Dataset`` instead of ``data.path``, in ``data.format``
        (a ``tokens`` column of id lists, or the text/chat/preference columns).  ``fit``
        streams it to the ranks through a reader actor (:mod:`raytrain_ext.data.stream_input`;
        nothing written, no shared filesystem), or with ``data.ray_dataset=materialise`` (or
        DPO, or ``eval.fraction``) materialises it once into the run directory
        (:mod:`raytrain_ext.data.ray_input`).  It must be finite and deterministic: a resumed
        run whose dataset differs is refused.

        ``reward_fns``: with ``objective.name=grpo``, the reward functions instead of
        ``rollout.reward_fns`` (TRL's signature ``fn(prompts, completions, **columns) ->
        list[float | None]``); they run in Ray tasks, pickled as the model is.
        """
        if isinstance(config, DictConfig):
            if overrides:
                raise ValueError(
                    "overrides go with a config path; for a loaded config apply "
                    "them with load_config(path, overrides) instead"
                )
            self.cfg = config_from_dict(to_dict(config))  # typed and checked, as a loaded one
        else:
            self.cfg = load_config(config, overrides)
        self.cfg = absolute_paths(self.cfg)
        self._user = UserCode(model=model, loss_fn=loss_fn, train_loop=train_loop)
        self._dataset = dataset
        _check_model_argument(self.cfg, model)
        check_objective(self.cfg, loss_fn)
        check_rollout(self.cfg, reward_fns, loss_fn)
        _check_dataset_argument(self.cfg, dataset)
        self._reward_fns = None if reward_fns is None else list(reward_fns)
        self._rollout_record: Optional[Dict[str, Any]] = None
        self._controller: Optional[Controller] = None
        self._stop_reason: Optional[str] = None
        self._interrupt_reason: Optional[str] = None
        self._marks: Dict[str, float] = {}  # this fit's moments (metrics.start_phases)
        self._pinned: list = []  # the readers' datasets, held while fit runs (restarts)
        self.run_dir = Path(self.cfg.run.output_dir) / self.cfg.run.name
        # the summary that describes the last fit(): the run's, or its attempt's alone when
        # that attempt trained no step (the run's summary then keeps the earlier attempt's)
        self.summary_path = self.run_dir / SUMMARY

    @property
    def controller(self) -> Optional[Controller]:
        """The controller of the attempt in progress (its state, world size and group can be
        watched from another thread); None before ``fit`` starts one."""
        return self._controller

    def fit(self) -> Dict[str, Any]:
        """Train to completion; returns the summary (also written to summary.json).

        Bad input is refused by :func:`preflight` before anything is written or started
        (``InputError``, a ``ConfigError``).  Each call is then one attempt in the run
        directory's history (:class:`RunDirectory`).
        """
        start = time.time()
        self._rollout_record = None  # this fit's, when it has a rollout service
        refuse_finished_run(self.run_dir, self.cfg.run.max_steps, self.cfg.checkpoint.resume)
        if self._dataset is None and is_stream(self.cfg.data.path):
            raise InputError(
                f"data.path: {self.cfg.data.path} names the reader of a Trainer(cfg, "
                "dataset=...) run; pass that dataset again (Trainer(cfg, dataset=ds)) to resume it."
            )
        if self._dataset is not None and streams(self.cfg):
            self.cfg = stream_config(self.cfg)
        elif self._dataset is not None:
            self.cfg = materialise_dataset(self.cfg, self._dataset, self.run_dir)
        preflight(self.cfg)
        records = RunDirectory(self.run_dir)
        attempt = records.begin(to_yaml(self.cfg))
        try:
            result = self._run(start)
        except BaseException as error:
            so_far = self._controller.result if self._controller is not None else None
            summary = self._summary(so_far, start)
            if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C: stopped at once
                summary["status"] = "interrupted"
            records.finish(attempt, summary, error=error)
            raise
        summary = self._summary(result, start)
        promoted = records.finish(attempt, summary)
        self.summary_path = (self.run_dir if promoted else attempt.directory) / SUMMARY
        return summary

    def _run(self, start: float) -> ControllerResult:
        """Connect to Ray, run the controller; whatever fails, nothing it started is left."""
        self._marks = {"ray_connecting_at": time.time()}
        rank_env = rank_env_vars(self.cfg.scaling.worker_niceness, {})
        started_ray = connect_ray(self.cfg.scaling.ray_address, rank_env)
        inherited_env = rank_env if started_ray else {}  # what its processes start with
        self._marks["ray_connected_at"] = time.time()
        run_actors: list = []  # the memory tier's and the dataset readers: this fit's
        rollout = None  # GRPO: the run's rollout service (it owns the engines)
        sink = FanOut([])
        try:
            self.cfg = resolve_cluster_defaults(self.cfg)
            run_actors = self._start_memory_tier()
            if is_stream(self.cfg.data.path):
                reader, dataset_ref = start_stream_reader(self.cfg, self._dataset)
                run_actors.append(reader)
                self._pinned.append(dataset_ref)
            if self._user.train_loop is not None:
                loop = self._user.train_loop
                readers, refs = start_row_readers(loop.experiment_name, loop.datasets)
                run_actors += readers
                self._pinned += refs
            if self.cfg.data.format == DataFormat.prompts:
                from raytrain_ext.rollout.run_service import start_run_rollout

                niceness = with_niceness(None, self.cfg.scaling.worker_niceness)
                rollout = start_run_rollout(self.cfg, self._reward_fns, niceness)
                run_actors.append(rollout)
            sink = FanOut(self._sinks())
            self._controller = Controller(
                self.cfg,
                sink,
                group_factory=partial(
                    RayGroup.for_config, user=self._user, inherited_env=inherited_env
                ),
                cluster=RayCluster(),
            )
            if self._stop_reason is not None:  # stop() came before the controller existed
                self._controller.stop(self._stop_reason)
            if self._interrupt_reason is not None:
                self._controller.interrupt(self._interrupt_reason)
            return self._controller.run()
        finally:
            if rollout is not None:
                from raytrain_ext.rollout.run_service import rollout_record

                self._rollout_record = rollout_record(rollout)
            sink.close()
            stop_memory_tier(run_actors)
            self._pinned = []
            if started_ray:
                stop_private_ray()

    def _summary(self, result: Optional[ControllerResult], start: float) -> Dict[str, Any]:
        summary = build_summary(self.cfg, result, start, self._marks, self._user.loss_fn)
        if self._rollout_record is not None:  # GRPO: the rollout service's record
            record = dict(self._rollout_record)
            summary["rollout_recoveries"] = record.pop("recoveries", [])
            summary["rollout"] = record
        return summary

    def _sinks(self) -> List[MetricsSink]:
        sinks: List[MetricsSink] = [
            ReportSink(self.cfg.run.log_every)
            if self._user.train_loop is not None
            else StdoutSink(self.cfg.run.log_every, self.cfg.run.max_steps),
            JsonlSink(self.run_dir / METRICS),
        ]
        if self.cfg.run.tensorboard:
            sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        return sinks

    def _start_memory_tier(self) -> list:
        """The registry and per-node holders live for this fit(); it removes them at the end."""
        if not (self.cfg.checkpoint.enabled and self.cfg.checkpoint.memory):
            return []
        niceness = with_niceness(None, self.cfg.scaling.worker_niceness)
        return start_memory_tier(self.cfg.run.name, niceness)

    def request_checkpoint(self) -> None:
        """Checkpoint at the next step boundary; callable from another thread during fit()."""
        if self._controller is not None:
            self._controller.request_checkpoint()

    def interrupt(self, reason: str = "by the user") -> None:
        """Stop a fit() as Ctrl-C does (safe from a signal handler): every rank checkpoints
        at the next step boundary, and fit() returns a summary with status ``interrupted``
        (see :meth:`Controller.interrupt`); a fit() not yet training ends at once."""
        self._interrupt_reason = reason
        if self._controller is not None:
            self._controller.interrupt(reason)

    def stop(self, reason: str = "stopped by the user") -> None:
        """End a fit() running in another thread (a notebook cell, a test): within a
        quarter of a second while training (``controller.FLAG_CHECK_S``; a group still
        being placed is placed first), and once rank 0's latest step records are in
        (``controller.STOP_DRAIN_S`` at most), its workers are shut down and fit() raises
        ``TrainingFailed`` naming ``reason``.  Committed checkpoints are kept; the next
        fit() of the same run resumes from them."""
        self._stop_reason = reason
        if self._controller is not None:
            self._controller.stop(reason)


def absolute_paths(cfg: DictConfig, base: Optional[Path] = None) -> DictConfig:
    """Workers do not share the driver's working directory: ship absolute local paths.

    Relative paths are taken from ``base`` (default: the current directory); a Tune
    trial passes the directory its sweep was started from, since Tune moves the trial
    into a directory of its own.
    """
    base = Path.cwd() if base is None else Path(base)
    cfg = copy.deepcopy(cfg)
    OmegaConf.set_readonly(cfg, False)
    cfg.run.output_dir = str(base / cfg.run.output_dir)
    cfg.profile.dir = str(base / cfg.profile.dir)
    if not str(cfg.checkpoint.dir).startswith("s3://"):
        cfg.checkpoint.dir = str(base / cfg.checkpoint.dir)
    if cfg.data.path != "builtin:corpus" and not cfg.data.path.startswith("s3://"):
        cfg.data.path = str(base / cfg.data.path)
    if cfg.data.eval_path and not cfg.data.eval_path.startswith("s3://"):
        cfg.data.eval_path = str(base / cfg.data.eval_path)
    if cfg.data.tokenizer and (base / cfg.data.tokenizer).exists():  # else a cached model id
        cfg.data.tokenizer = str(base / cfg.data.tokenizer)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def resolve_cluster_defaults(cfg: DictConfig) -> DictConfig:
    """Settings whose default depends on the cluster: the memory tier is on with >1 node."""
    if cfg.checkpoint.memory is not None:
        return cfg
    import ray

    cfg = copy.deepcopy(cfg)
    OmegaConf.set_readonly(cfg, False)
    cfg.checkpoint.memory = sum(1 for n in ray.nodes() if n["Alive"]) > 1
    OmegaConf.set_readonly(cfg, True)
    return cfg


def goodput(records, wall_time_s: float) -> Optional[float]:
    """Time spent on steps that were kept (the last run of each step) / wall time."""
    if not records or wall_time_s <= 0:
        return None
    kept = {r["step"]: r["step_time_s"] for r in records}  # a redone step overwrites its first run
    return sum(kept.values()) / wall_time_s


def _installed_version(package: str) -> Optional[str]:
    """A package's version as installed, without importing it (the driver imports no torch)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_summary(
    cfg,
    result: Optional[ControllerResult],
    start: float,
    marks: Optional[Dict[str, float]] = None,
    loss_fn: Optional[Callable] = None,
) -> Dict[str, Any]:
    """What a run did, from the controller's result (None: it never got to run); ``marks``:
    the driver's moments of its start (``metrics.start_phases``)."""
    import ray

    result = result or ControllerResult(state=RunState.FAILED)
    records = result.records
    ranks = result.worker_results
    hashes = sorted({r.params_sha256 for r in ranks})
    digests = sorted({r.samples_digest for r in ranks})
    summary: Dict[str, Any] = {
        "run_name": cfg.run.name,
        "objective": str(objective_name(cfg.objective, cfg.data.format, loss_fn)),
        "status": (
            result.state.value.lower()
            if result.state in (RunState.FINISHED, RunState.PREEMPTED, RunState.INTERRUPTED)
            else "failed"
        ),
        "steps_completed": ranks[0].steps if ranks else (records[-1]["step"] if records else 0),
        "final_loss": records[-1]["loss"] if records else None,
        "first_loss": records[0]["loss"] if records else None,
        **summarize_records(records),
        "wall_time_s": time.time() - start,
        "started_at": start,
        "first_step_at": records[0]["time"] if records else None,
        "time_to_first_step_s": records[0]["time"] - start if records else None,
        "start_phases_s": _start_phases(start, marks or {}, result) if records else None,
        "world_size_history": result.world_size_history,
        "workers": result.workers,
        "recoveries": result.recoveries,
        "resizes": result.resizes,
        "stragglers": result.stragglers,
        "skipped_steps": [r["step"] for r in records if r.get("skipped")],
        "rollbacks": [r["rolled_back"] for r in records if "rolled_back" in r],
        "goodput": goodput(records, time.time() - start),
        "params_sha256": hashes[0] if len(hashes) == 1 else hashes or None,
        "samples_digest": digests[0] if len(digests) == 1 else digests or None,
        "samples_consumed": ranks[0].samples_consumed if ranks else 0,
        "stream_fingerprint": ranks[0].stream_fingerprint if ranks else None,
        "replicas_identical": len(hashes) == 1 if ranks else None,
        "restored": ranks[0].restored if ranks else None,
        "checkpoint": checkpoint_stats(ranks),
        "checkpoint_stall_s": sum(r.get("ckpt_stall_s", 0.0) for r in records),
        "backend": result.backend,
        "config_digest": config_digest(cfg),
        "transitions": [t.__dict__ for t in result.transitions],
        "versions": {"torch": _installed_version("torch"), "ray": ray.__version__},
        "loss_history": [[r["step"], r["loss"]] for r in records],
        "eval_history": [{"step": r["step"], **eval_fields(r)} for r in records if eval_fields(r)],
        "step_times": [r["step_time_s"] for r in records],
        "step_end_times": [[r["step"], r["time"]] for r in records],
    }
    return summary


def checkpoint_stats(ranks: List[FitResult]) -> Optional[Dict[str, Any]]:
    """Rank 0's checkpoint stats; for a user's loop, whose every rank uploads its own
    files (``user_loop.uploader``), the upload failures of every rank, each naming it."""
    stats = ranks[0].checkpoint if ranks else None
    if stats is None or "upload_failures" not in stats:
        return stats
    failures = [
        f"rank {r.rank}: {failure}"
        for r in ranks
        for failure in (r.checkpoint or {}).get("upload_failures", [])
    ]
    return {**stats, "upload_failures": failures}


def _start_phases(start: float, marks: Dict[str, float], result: ControllerResult) -> Dict:
    """The first group's start, split (``metrics.start_phases``): the driver's moments, the
    group's and rank 0's (``ControllerResult.start_marks``), and its first step's end."""
    first = result.records[0]
    return start_phases(start, {**marks, **result.start_marks, "first_step_at": first["time"]})


def _check_dataset_argument(cfg, dataset: Any) -> None:
    if dataset is not None and cfg.data.format == DataFormat.prompts:
        raise InputError(
            "dataset: data.format=prompts reads its prompts from data.path; a Ray Dataset of "
            "prompts is not supported yet. Write the prompts to JSONL or Parquet and set "
            "data.path."
        )


def _check_model_argument(cfg, model: Any) -> None:
    """``Trainer(cfg, model=...)`` goes with ``model.source=python``; the model (or
    ``model.factory``) is checked before Ray, as a config key would be."""
    model_source(cfg.model).check_model(cfg, model)
