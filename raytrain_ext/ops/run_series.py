"""A run's records as series on the wall-time axis: what ``report`` plots and tabulates.

Every figure comes from ``summary.json``; nothing is re-measured.  Times are seconds since
``started_at``.  The records of steps that a recovery redid stay in the series: they show
what the cluster did, the loss dropping back to the checkpoint and training again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class RunSeries:
    """Per-record series on the wall-time axis (all records, redone steps included)."""

    time_s: List[float]
    steps: List[int]
    loss: List[float]
    throughput: List[float]
    throughput_unit: str  # "tokens/s" with the config's batch shape, else "steps/s"


def run_series(summary: Dict[str, Any], tokens_per_step: Optional[int]) -> RunSeries:
    start = summary["started_at"]
    ends = summary["step_end_times"]
    step_times = summary["step_times"]
    work = tokens_per_step or 1
    return RunSeries(
        time_s=[t - start for _, t in ends],
        steps=[s for s, _ in ends],
        loss=[loss for _, loss in summary["loss_history"]],
        throughput=[work / dt for dt in step_times],
        throughput_unit="tokens/s" if tokens_per_step else "steps/s",
    )


def recovery_phases(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Split each recovery into phases (seconds; None where the run never got that far).

    detect: end of the last step before the failure -> the controller noticing it;
    stop + decide: -> leaving RECOVERING (survivors stopped, capacity settled);
    re-form: -> the new group RUNNING (placement, rendezvous); restore: loading the
    checkpoint on the workers; first step: the rest until the first step after the
    re-form ended (worker setup and the step itself).  MTTR, the sum, runs from the
    last good step to the first new one.
    """
    start = summary["started_at"]
    ends = [t for _, t in summary.get("step_end_times", [])]
    transitions = summary.get("transitions", [])
    phases = []
    for recovery in summary.get("recoveries", []):
        detected = recovery["detected_at"]
        before = [t for t in ends if t <= detected]
        left = _next_transition(transitions, "RECOVERING", "SCHEDULING", detected)
        running = _next_transition(transitions, "SCHEDULING", "RUNNING", left)
        row = {
            "at_s": detected - start,
            "reason": recovery["reason"],
            "detect_s": detected - before[-1] if before else None,
            "decide_s": _minus(left, detected),
            "reform_s": _minus(running, left),
            "restore_s": recovery.get("restore_s"),
            "first_step_s": None,
            "mttr_s": None,
            "restored_from": recovery.get("restored_from"),
            "restored_step": recovery.get("restored_step"),
            "steps_redone": recovery.get("steps_redone"),
        }
        after = recovery.get("first_step_after_s")
        if after is not None and running is not None:
            row["first_step_s"] = after - (running - detected) - (row["restore_s"] or 0.0)
            row["mttr_s"] = after + (row["detect_s"] or 0.0)
        phases.append(row)
    return phases


def _next_transition(transitions, source: str, target: str, after: Optional[float]):
    if after is None:
        return None
    for t in transitions:
        if t["source"] == source and t["target"] == target and t["at"] >= after:
            return t["at"]
    return None


def _minus(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def world_size_changes(summary: Dict[str, Any]) -> List[tuple]:
    """(seconds since start, world size) each time a group started RUNNING.

    ``world_size_history`` gets one entry per successful group formation, in the
    same order as the SCHEDULING -> RUNNING transitions.
    """
    start = summary["started_at"]
    formed = [
        t["at"] - start
        for t in summary.get("transitions", [])
        if t["source"] == "SCHEDULING" and t["target"] == "RUNNING"
    ]
    return [
        (at, entry["world_size"])
        for at, entry in zip(formed, summary.get("world_size_history", []), strict=False)
    ]
