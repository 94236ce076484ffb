"""Rank 0's recent reports, kept by every rank's process, so a run's records keep every
report although rank 0 died before the controller read its last ones.

Why: rank 0 hands each report to the controller, which reads them once per
``elastic.poll_interval_s``.  When rank 0's process dies, the reports it made since the
last read die with it.  A group that resumes from an older checkpoint makes those reports
again, but one that resumes from a report held in memory or registered live state goes on
after them, and they would be missing from the history for good.  So rank 0's metrics
travel in the report's all-gather (``session``), every rank logs them here, and the next
group's rank 0 hands the controller the logged reports up to where the group starts
(``merged``), marked replayed: the controller keeps those newer than its newest record
and drops the rest.

Invariant: a process keeps, per run, the newest ``KEPT`` reports by index; for an index
reported by several groups (a group that rewound), the latest one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

KEPT = 64  # reports a process keeps per run: a few poll intervals' worth


@dataclass(frozen=True)
class LoggedReport:
    """A report as rank 0 made it: its index, metrics, time and interval since the last."""

    index: int
    time: float
    interval_s: float
    metrics: Dict[str, Any] = field(default_factory=dict)


class ReportLog:
    def __init__(self) -> None:
        self._runs: Dict[str, Dict[int, LoggedReport]] = {}

    def add(self, run: str, report: LoggedReport) -> None:
        reports = self._runs.setdefault(run, {})
        reports[report.index] = report
        for index in sorted(reports)[:-KEPT]:
            del reports[index]

    def reports(self, run: str) -> List[LoggedReport]:
        return [r for _, r in sorted(self._runs.get(run, {}).items())]


def merged(logs: List[List[LoggedReport]], through: int) -> List[LoggedReport]:
    """Every rank's logged reports up to index ``through``, by index, the latest of each."""
    newest: Dict[int, LoggedReport] = {}
    for report in (r for log in logs for r in log if r.index <= through):
        kept = newest.get(report.index)
        if kept is None or report.time > kept.time:
            newest[report.index] = report
    return [newest[i] for i in sorted(newest)]


_PROCESS_LOG = ReportLog()


def process_report_log() -> ReportLog:
    return _PROCESS_LOG
