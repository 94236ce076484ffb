"""The ``checkpoint`` section: when and where checkpoints are written, the S3 tier, how a
run resumes; its own check (``check_checkpoint_section``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from raytrain_ext.errors import ConfigError
from raytrain_ext.storage.s3_errors import endpoint_problem
from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import at_least, positive


class OnBusy(Choice):
    """``checkpoint.on_busy``: a save due while the previous one still persists is skipped, or
    waits for it."""

    skip = "skip"
    wait = "wait"


@dataclass
class S3Config:
    """The S3 tier; ``uri: null`` disables it.  Credentials come from the boto3 chain."""

    uri: Optional[str] = None  # s3://bucket/prefix
    endpoint_url: Optional[str] = None  # MinIO, COS, OSS, moto, ...
    region: Optional[str] = None
    part_size_mb: int = positive(16)
    max_concurrency: int = positive(8)
    max_attempts: int = positive(5)
    retry_backoff_s: float = at_least(0, 1.0)


@dataclass
class CheckpointConfig:
    """When and where checkpoints are written, and how a run resumes.

    A checkpoint is written to the fastest tier, then persisted down the others
    in the background: the Ray object store (``memory``, replicated on a second
    node), local disk (``dir``, on each node) and S3 (``s3.uri``).
    Saves trigger every ``every_steps`` steps and/or every ``every_seconds``
    seconds (``null`` disables either), on demand, and on preemption.
    """

    enabled: bool = True
    memory: Optional[bool] = None  # Ray object store tier; null = on when >1 node
    keep_in_memory: int = positive(2)
    dir: str = "${run.output_dir}/${run.name}/checkpoints"
    local: bool = True
    s3: S3Config = field(default_factory=S3Config)
    every_steps: Optional[int] = positive(None, null="disabled")
    every_seconds: Optional[float] = positive(600.0, null="disabled")
    # without every_steps, the first time-based save comes this soon (a run that dies whole
    # early loses at most this, not every_seconds); about what a restart costs anyway
    first_save_after_s: Optional[float] = positive(60.0, null="every_seconds")
    save_final: bool = True
    # also save every step to the memory tier alone (a copy on a second node); a step's
    # update waits for the last one to persist: a lost node redoes <= 1 step.  null: on
    # where each rank holds its own shards (FSDP, TP, PP, EP) unless it stalls over 5% of a
    # step (checkpoint.snapshot_policy); DDP and HSDP heal from live peers
    snapshot_every_step: Optional[bool] = None
    async_save: bool = True
    write_threads: int = positive(2)  # DCP writer threads per rank (2 doubles write bandwidth here)
    # restore: checksum chunks verified and items loaded at once, per rank
    read_threads: int = positive(4)
    recycle_files: bool = True  # a deleted local step's data files are reused by the next save
    checksum_chunk_kb: int = positive(8192)  # granularity of verified ranged reads from S3
    on_busy: OnBusy = OnBusy.skip
    keep_last: int = positive(3)
    resume: str = "auto"  # auto (newest committed, if any) | never | a step-<N> path or URI
    preemption_grace_s: float = positive(30.0)  # SIGTERM -> emergency checkpoint within this budget
    timeout_s: float = positive(600.0)


def check_checkpoint_section(c: CheckpointConfig) -> None:
    """The ``checkpoint`` section's own consistency, each problem named with its fix."""
    if c.s3.uri is not None and not (c.s3.uri.startswith("s3://") and len(c.s3.uri) > 5):
        raise ConfigError(
            f"checkpoint.s3.uri: {c.s3.uri!r} is not an s3://bucket/prefix URI. "
            "Set it like s3://my-bucket/checkpoints, or null to disable the S3 tier."
        )
    if c.resume not in ("auto", "never") and not re.search(r"step-\d+/?$", c.resume):
        raise ConfigError(
            f"checkpoint.resume: {c.resume!r} must be auto, never, or the path/URI "
            "of one step-<N> checkpoint directory."
        )
    if c.enabled and not (c.local or c.s3.uri):
        raise ConfigError(
            "checkpoint.local: checkpoints are enabled but no persistent tier is; "
            "set checkpoint.local=true or checkpoint.s3.uri, or "
            "checkpoint.enabled=false."
        )
    if c.snapshot_every_step and (c.memory is False or not c.enabled):
        raise ConfigError(
            "checkpoint.snapshot_every_step: the per-step snapshot goes to the memory tier, "
            "which is off (checkpoint.memory=false or checkpoint.enabled=false); set "
            "checkpoint.memory=true (or null: on with more than one node)."
        )
    problem = endpoint_problem(c.s3.endpoint_url, "checkpoint.s3.endpoint_url")
    if problem:
        raise ConfigError(problem)
