"""What a worker and the controller tell each other, typed once for both sides.

A rank sends these through Ray (pickled, so both sides import this one module) and the
controller reads their fields by name: a field added to a message is added here, where
the worker fills it and the controller and the fakes of its tests read it.  A plain dict
appears only where a step's record leaves for the sinks (stdout, TensorBoard,
``ray.util.metrics``) and the run's summary: ``StepReport.to_record``.

Invariant: this module imports nothing of the package and neither torch nor Ray, so the
driver, the worker and the controller's Ray-free unit tests all import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class RankInfo:
    """Where a rank's process runs (``TrainWorker.node_info``)."""

    node_id: str
    node_ip: str
    pid: int
    gpu_ids: List[str] = field(default_factory=list)
    niceness: int = 0  # scaling.worker_niceness, as applied
    hostname: str = ""
    process_age_s: float = 0.0  # on its node's clock (a pool's stocked process is older)
    marks: Dict[str, float] = field(default_factory=dict)  # when it started and imported


@dataclass(frozen=True)
class Heartbeat:
    """A rank's last finished step and what its loop is doing (setup | compute | exchange),
    answered while the training thread is busy (hang detection)."""

    step: int
    phase: str
    beat: float = 0.0  # when that step was reported, on the rank's clock


@dataclass
class StepReport:
    """One step as a rank reports it.  Every rank builds one (its straggler guard observes
    on each); rank 0's go to the controller.

    ``metrics``: the objective's per-unit metrics, an evaluation's ``eval_*`` results and
    rank 0's ``expert_load``, by name (what a sink plots, nothing the controller acts on).
    ``first_of_group``: the first report of a new group, whose ``restored`` says where it
    resumed from (None: it started afresh) and ``start_marks`` when its loop was built."""

    step: int
    time: float  # the step's end, on the rank's clock
    step_time_s: float
    loss: float
    lr: float = 0.0
    grad_norm: float = 0.0
    tokens_per_s: float = 0.0
    compute_s: float = 0.0
    data_s: float = 0.0
    ckpt_stall_s: float = 0.0
    wait_s: float = 0.0  # communication and waiting for peers
    phases_s: Dict[str, float] = field(default_factory=dict)
    world_size: int = 1
    peak_memory_gb: float = 0.0
    mfu: Optional[float] = None
    metrics: Dict[str, Any] = field(default_factory=dict)
    rank_compute_s: Optional[List[float]] = None  # rank 0: every rank's compute time
    stragglers: List[int] = field(default_factory=list)  # rank 0: ranks flagged this step
    skipped: bool = False
    rolled_back: Optional[Dict[str, int]] = None  # {from_step, to_step} after a rollback
    first_of_group: bool = False
    restored: Optional[Dict[str, Any]] = None
    start_marks: Optional[Dict[str, float]] = None
    # a report a dead rank 0 made that the controller may not have read, handed over again
    # by the next group's rank 0 (``user_loop.report_log``): kept only when it is newer
    # than the controller's newest record
    replayed: bool = False

    def to_record(self, **extra: Any) -> Dict[str, Any]:
        """The flat record the sinks write (``metrics.jsonl``, TensorBoard, the summary):
        the always-present fields, the metrics by name, and each optional field only when
        set (``restored`` on a group's first record even when None), then ``extra``."""
        record: Dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "compute_s": self.compute_s,
            "data_s": self.data_s,
            "ckpt_stall_s": self.ckpt_stall_s,
            "wait_s": self.wait_s,
            "phases_s": self.phases_s,
            "world_size": self.world_size,
            "time": self.time,
            "peak_memory_gb": self.peak_memory_gb,
            "mfu": self.mfu,
            **self.metrics,
        }
        if self.rank_compute_s is not None:
            record.update(rank_compute_s=self.rank_compute_s, stragglers=self.stragglers)
        if self.skipped:
            record["skipped"] = True
        if self.rolled_back is not None:
            record["rolled_back"] = self.rolled_back
        if self.first_of_group:
            record["restored"] = self.restored
        if self.start_marks is not None:
            record["start_marks"] = self.start_marks
        if self.replayed:
            record["replayed"] = True
        return {**record, **extra}


@dataclass(frozen=True)
class PollReply:
    """A rank's answer to a poll: its last step, and rank 0's reports not taken yet."""

    step: int
    beat: float = 0.0
    reports: List[StepReport] = field(default_factory=list)


@dataclass(frozen=True)
class FitResult:
    """What one rank's ``fit`` returns once its loop stops (finished, paused or preempted)."""

    rank: int
    steps: int
    final_loss: float = float("nan")
    params_sha256: str = ""
    samples_digest: str = ""
    samples_consumed: int = 0
    stream_fingerprint: Optional[str] = None  # a streamed dataset: its content consumed
    restored: Optional[Dict[str, Any]] = None  # where this group resumed from
    preempted_at: Optional[int] = None  # the step it stopped at, checkpointed, for a notice
    paused_at: Optional[int] = None  # the step it paused at, state kept in memory
    checkpoint: Optional[Dict[str, Any]] = None  # its checkpoint manager's stats
    sigterm: bool = False  # its process was sent SIGTERM (the controller avoids that node)
