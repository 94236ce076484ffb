"""Reported checkpoints persisted off the training thread: one uploader per process.

``report`` only stages the user's directory (``staging``: hard links, as the directory may
be deleted as soon as ``report`` returns) and queues it here.  Two threads take each job in
turn.  The first holds the files in the run's memory tier when it has one
(``held_reports``: a memory copy on this node and another, and on rank 0 the report's
record), so a re-formed group can resume from it at once.  The second uploads them,
writes the rank's marker, and, on rank 0, commits the report once every uploading rank's
marker of this group landed (``storage.RunStorage.commit``: it gives up at once on a
failed upload or when a new group starts), then applies retention; it removes the staged
files.  Jobs run in order in each thread, so a commit never overtakes its own rank's
upload, and a slow upload never holds back the next report's memory copy.  The uploader
outlives a group: at a new group's start every rank waits a bounded time for what it
queued (``drain``, or only the memory copies with ``drain_holds``) before rank 0 reads the
newest checkpoint.  A failed upload is logged and listed in ``failures``; its report is
never committed.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from raytrain_ext.user_loop.held_reports import HeldReport, HeldReports
from raytrain_ext.user_loop.staging import Staged, check_unchanged
from raytrain_ext.user_loop.storage import RunStorage

log = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 600.0  # how long rank 0 waits for the other ranks' uploads
ABANDONED = ""  # the group between two groups: every job queued before is an earlier one's
HOLD, UPLOAD = "ckpt-hold", "ckpt-upload"  # the two threads


@dataclass(frozen=True)
class UploadJob:
    """Report ``index``: this rank's staged files (None: it passed no checkpoint) and, on
    rank 0, the commit of the ranks in ``commit_ranks`` (empty: no commit to make);
    ``held``: the run's memory tier, which takes the files first (None: it has none)."""

    storage: RunStorage
    index: int
    rank: int
    group: str  # the id of the group that reported it
    staged: Optional[Staged]
    commit_ranks: Sequence[int] = ()
    metrics: Dict[str, Any] = field(default_factory=dict)
    positions: Dict[str, List[int]] = field(default_factory=dict)  # of each dataset shard
    held: Optional[HeldReports] = None


class Uploader:
    def __init__(self) -> None:
        self._holds: "queue.Queue[UploadJob]" = queue.Queue()
        self._jobs: "queue.Queue[UploadJob]" = queue.Queue()
        self.failures: List[str] = []
        self.group: Optional[str] = None  # the current group: older commits are abandoned
        self._busy: Dict[str, UploadJob] = {}  # each thread's job in flight, under _idle
        self._idle = threading.Condition()
        for target, name in ((self._hold_all, HOLD), (self._run, UPLOAD)):
            threading.Thread(target=target, name=name, daemon=True).start()

    def start_group(self, group: str) -> None:
        """A new group formed: a commit of an earlier group still waiting gives up (its
        ranks were re-formed; the new group resumes from what was committed)."""
        self.group = group

    def abandon(self, timeout_s: float) -> bool:
        """A new group is forming (before its rank 0 reads storage): the last group's jobs
        not begun are skipped, its commits give up, and this waits (bounded) for one in
        flight, so none lands after rank 0 chose where the group starts.  False when
        ``timeout_s`` passed first."""
        self.group = ABANDONED
        return self._wait_idle(lambda job: bool(job.commit_ranks), timeout_s)

    def settle(self, start: int, timeout_s: float) -> bool:
        """The new group starts after report ``start``: wait (bounded) for a job of the last
        group in flight that could still write where the new group will (a report after
        ``start``), so none lands after rank 0 removed what earlier groups left there.
        False when ``timeout_s`` passed first."""
        return self._wait_idle(lambda job: job.index > start, timeout_s)

    def _wait_idle(self, matters: Callable[[UploadJob], bool], timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(
                lambda: not any(matters(job) for job in self._busy.values()), timeout_s
            )

    def _begin(self, thread: str, job: UploadJob) -> None:
        with self._idle:
            self._busy[thread] = job

    def _end(self, thread: str) -> None:
        with self._idle:
            self._busy.pop(thread, None)
            self._idle.notify_all()

    def submit(self, job: UploadJob) -> None:
        self._holds.put(job)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued job is done; False when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        return self.drain_holds(timeout_s) and _join(self._jobs, deadline - time.monotonic())

    def drain_holds(self, timeout_s: float) -> bool:
        """Wait until every queued job's memory copy is done (its upload may go on)."""
        return _join(self._holds, timeout_s)

    def _hold_all(self) -> None:
        while True:
            job = self._holds.get()
            self._begin(HOLD, job)
            try:
                if job.held is not None and self.group in (None, job.group):  # else: stale
                    _hold(job, job.held)
            except Exception as e:  # a holder's node lost mid-copy: the upload goes on
                log.warning("checkpoint of report %d not held in memory: %s", job.index, e)
            finally:
                self._end(HOLD)
                self._jobs.put(job)  # before task_done: a drain never sees it nowhere
                self._holds.task_done()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            self._begin(UPLOAD, job)
            try:
                self._do(job)
            except Exception as e:  # storage down, disk full: that report stays uncommitted
                self.failures.append(f"report {job.index}: {type(e).__name__}: {e}")
                log.error("checkpoint of report %d not persisted: %s", job.index, e)
            finally:
                if job.staged is not None:
                    shutil.rmtree(job.staged.directory, ignore_errors=True)
                self._end(UPLOAD)
                self._jobs.task_done()

    def _do(self, job: UploadJob) -> None:
        if self.group is not None and job.group != self.group:
            return  # an earlier group's report: it can no longer commit
        staged = job.staged
        if staged is not None:
            job.storage.upload(
                staged.directory,
                job.index,
                job.rank,
                job.group,
                verify=lambda: check_unchanged(staged),
            )
        if not job.commit_ranks:
            return
        committed = job.storage.commit(
            job.index,
            job.commit_ranks,
            job.metrics,
            job.positions,
            job.group,
            still_wanted=lambda: self.group == job.group,
            timeout_s=COMMIT_TIMEOUT_S,
        )
        if committed:
            job.storage.prune()
        else:
            self.failures.append(f"report {job.index}: not every rank's upload landed")


def _hold(job: UploadJob, held: HeldReports) -> None:
    """This rank's files of the report into memory, and on rank 0 the report's record,
    then retention (rank 0)."""
    if job.commit_ranks:
        held.record(
            HeldReport(job.index, job.group, tuple(job.commit_ranks), job.metrics, job.positions)
        )
    if job.staged is not None:
        held.hold(job.index, job.group, job.rank, job.staged)
    if job.commit_ranks:
        held.retain()


def _join(jobs: "queue.Queue[UploadJob]", timeout_s: float) -> bool:
    """``Queue.join`` with a timeout (the queue's own condition, no waiting thread left
    behind when it times out); False when ``timeout_s`` passed first."""
    with jobs.all_tasks_done:
        return jobs.all_tasks_done.wait_for(lambda: jobs.unfinished_tasks == 0, max(0.0, timeout_s))


_PROCESS_UPLOADER: Optional[Uploader] = None


def process_uploader() -> Uploader:
    """This process's uploader, started on first use and kept across groups."""
    global _PROCESS_UPLOADER
    if _PROCESS_UPLOADER is None:
        _PROCESS_UPLOADER = Uploader()
    return _PROCESS_UPLOADER
