"""One small interface for metrics, four sinks: stdout, ``metrics.jsonl``, TensorBoard,
Ray metrics.

A sink takes ``write(step, record)`` and ``close()``.  The driver feeds rank 0's
per-step records to the stdout, JSON-lines and TensorBoard sinks; rank 0 itself feeds the
``ray.util.metrics`` gauges (Prometheus through the Ray dashboard), because
Ray exports metrics from worker processes.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Protocol, TextIO

SCALARS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "step_time_s",
    "compute_s",
    "wait_s",
    "ckpt_stall_s",
    "peak_memory_gb",
    "world_size",
    "recoveries",
    # the objective's metrics (DPO)
    "reward_margin",
    "accuracy",
    "chosen_reward",
    "rejected_reward",
)
EVAL_PREFIX = "eval_"


def eval_fields(record: Mapping[str, Any]) -> Dict[str, float]:
    """The evaluation results a step record carries (``eval_loss``, ``eval_ppl``, ...)."""
    return {k: v for k, v in record.items() if k.startswith(EVAL_PREFIX)}


class MetricsSink(Protocol):
    def write(self, step: int, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def format_eval(record: Mapping[str, Any]) -> str:
    fields = "  ".join(
        f"{key[len(EVAL_PREFIX) :]} {value:.4f}" for key, value in eval_fields(record).items()
    )
    return f"eval at step {record['step']}:  {fields}"


def format_progress(record: Mapping[str, Any], max_steps: int) -> str:
    return (
        f"step {record['step']:>6}/{max_steps}  loss {record['loss']:.4f}  "
        f"lr {record['lr']:.2e}  grad_norm {record['grad_norm']:.3f}  "
        f"tokens/s {record['tokens_per_s']:>9.0f}  step_time {record['step_time_s'] * 1e3:.1f} ms  "
        f"world {record['world_size']}"
        + (f"  reward {record['reward']:.4f}" if "reward" in record else "")
    )


class StdoutSink:
    """One line every ``every`` steps (and at the last step)."""

    def __init__(self, every: int, max_steps: int, stream: TextIO | None = None):
        self.every, self.max_steps = every, max_steps
        self.stream = stream or sys.stdout

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        if step % self.every == 0 or step == self.max_steps:
            print(format_progress(record, self.max_steps), file=self.stream, flush=True)
        if eval_fields(record):
            print(format_eval(record), file=self.stream, flush=True)

    def close(self) -> None:
        self.stream.flush()


class ReportSink:
    """A user's loop (``raytrain_ext.train``): one line every ``every`` reports with what
    it reported (numbers and short strings), the world size and the time since the last."""

    def __init__(self, every: int, stream: TextIO | None = None):
        self.every = every
        self.stream = stream or sys.stdout

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        if step % self.every:
            return
        reported = record.get("reported") or {}
        shown = "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in reported.items()
            if isinstance(v, (int, float, str)) and len(str(v)) <= 40
        )
        print(
            f"report {step:>6}  {shown}  (world {record['world_size']}, "
            f"{record['step_time_s']:.2f} s since the last)",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        self.stream.flush()


class JsonlSink:
    """Every step's whole record, one JSON object a line, appended to ``path``.

    Why: the summary keeps medians, and a step that was slow for a moment (a process
    starting beside the ranks, a save) hides in a median; each line carries its step's
    ``phases_s``, which add up to its ``step_time_s``.  A resumed run appends to the same
    file, so a step may appear twice (before and after a rollback or restart): its
    ``time`` says which came last.  Lines are written as they arrive (line-buffered), so
    a driver that dies leaves every record it had; a run that made no step writes none
    (the file is opened at the first record)."""

    def __init__(self, path: Path):
        self.path = path
        self.file: TextIO | None = None

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        if self.file is None:
            self.file = self.path.open("a", buffering=1)
        self.file.write(json.dumps(dict(record), default=str) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class TensorBoardSink:
    """Scalars as TensorBoard event files under ``log_dir``, opened at the first record.

    Why at the first record: ``tensorboardX`` imports torch, 1.2-1.3 s on the driver
    (measured here), which at the sink's creation lay on the path to the first step (the
    gang is placed after the sinks exist); at the first record it runs while the ranks
    train.  A run that made no step writes no event file, as ``JsonlSink`` writes no line."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir))
        return self._writer

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        for key in SCALARS:
            if record.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", record[key], step)
        for key, value in eval_fields(record).items():
            self.writer.add_scalar(f"eval/{key[len(EVAL_PREFIX) :]}", value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class RayMetricsSink:
    """``ray.util.metrics`` gauges tagged with the run name."""

    def __init__(self, run_name: str):
        from ray.util.metrics import Gauge

        self.tags = {"run": run_name}
        self.gauges = {
            key: Gauge(f"raytrain_ext_{key}", description=f"training {key}", tag_keys=("run",))
            for key in SCALARS + ("step",)
        }

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        self.gauges["step"].set(step, tags=self.tags)
        for key in SCALARS:
            if record.get(key) is not None:
                self.gauges[key].set(float(record[key]), tags=self.tags)

    def close(self) -> None:
        pass


class FanOut:
    """Writes every record to several sinks."""

    def __init__(self, sinks: Iterable[MetricsSink]):
        self.sinks: List[MetricsSink] = list(sinks)

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(step, record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def summarize_records(records: List[Dict[str, Any]], skip_first: int = 1) -> Dict[str, float]:
    """Mean throughput, median step time and the share of step time rank 0 spent fetching
    its micro-batches (the input pipeline's cost), ignoring warm-up steps."""
    steady = records[skip_first:] or records
    if not steady:
        return {}
    times = sorted(r["step_time_s"] for r in steady)
    total_time = sum(times)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in steady)
    mfus = sorted(r["mfu"] for r in steady if r.get("mfu") is not None)
    peaks = [r["peak_memory_gb"] for r in records if r.get("peak_memory_gb") is not None]
    return {
        "median_step_time_s": times[len(times) // 2],
        "tokens_per_s": tokens / total_time,
        "mfu": mfus[len(mfus) // 2] if mfus else None,
        "peak_memory_gb": max(peaks) if peaks else None,
        "data_time_share": sum(r.get("data_s", 0.0) for r in steady) / total_time,
        "step_phases_s": median_phases(steady),
    }


def median_phases(records: List[Dict[str, Any]]) -> Dict[str, float]:
    """The median seconds of each phase of a step (``train.step_clock``) over ``records``
    (a phase a record lacks, one written before the phase existed, counts 0)."""
    phases = [r["phases_s"] for r in records if r.get("phases_s")]
    names = list(dict.fromkeys(name for p in phases for name in p))
    return {name: statistics.median(p.get(name, 0.0) for p in phases) for name in names}
