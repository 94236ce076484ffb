"""What ``report``, ``get_checkpoint``, ``get_context`` and ``get_dataset_shard`` reach from
inside the user's function: the rank's ``LoopSession``, set while the function runs.

Invariant: every rank makes the same sequence of reports.  Each ``report`` is one
all-gather on a gloo group of its own (index, checkpoint or not, a stop asked), so all
ranks agree which ranks uploaded and whether to stop at this boundary.  A rank whose
report does not match (another index, or it returned from the function instead) makes
every rank raise ``ReportMismatch`` naming the ranks; a rank that skips a report and
enters another collective (a DDP all-reduce) instead meets it only at
``parallel.timeout_s``, as any mismatched collective does.
"""

from __future__ import annotations

import logging
import numbers
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.dataset_shard import DatasetShard, shard_positions
from raytrain_ext.user_loop.held_reports import HeldReports
from raytrain_ext.user_loop.registered import Registration
from raytrain_ext.user_loop.registered_files import REGISTERED_DIR
from raytrain_ext.user_loop.report_log import LoggedReport, process_report_log
from raytrain_ext.user_loop.staging import Staged, stage
from raytrain_ext.user_loop.storage import RunStorage
from raytrain_ext.user_loop.uploader import Uploader, UploadJob

log = logging.getLogger(__name__)

REPORT, RETURNED = "report", "returned"
# a report's payload, gathered from every rank: (kind, index, has a checkpoint, the stop
# it asks for, every dataset's position, whether it registered state that loads at any
# world size: ``registered_state.Layout``, on rank 0 the report as the run's records
# take it: a ``report_log.LoggedReport``, whether it sends its copy to a peer, and whether
# a checkpoint also takes its registered state: ``registered_files``)
KIND, INDEX, HAS_CHECKPOINT, STOP, POSITIONS, RESIZABLE, LOGGED, COPIES, FILES = range(9)
PAUSE, PREEMPT, PREEMPT_NOW = "pause", "preempt", "preempt-now"


def stop_here(gathered: List[Tuple]) -> Optional[str]:
    """Whether the group stops at this report, and why: a pause or a preemption asked on
    any rank stops every rank at the next report that carries a checkpoint (nothing is
    then redone after the re-form), a preemption whose grace ran out at the next report.
    A pause also stops at any report of a loop whose registered state loads at any size
    (replicated, or FSDP/HSDP shards that join into the whole: the grown group takes it
    from the live processes; other sharded state would not load into it); a loop that
    does neither is never paused."""
    asked = [g[STOP] for g in gathered if g[STOP] is not None]
    checkpointed = any(g[HAS_CHECKPOINT] for g in gathered)
    if PREEMPT_NOW in asked:
        return PREEMPT
    if asked and checkpointed:
        return asked[0]
    if asked and set(asked) == {PAUSE} and all(g[RESIZABLE] for g in gathered):
        return PAUSE
    return None


class ReportMismatch(RuntimeError):
    """The ranks did not make the same report (a rank skipped ``report`` or returned)."""


class StopAtBoundary(BaseException):
    """Raised out of ``report`` to unwind the user's function when the group stops at this
    report (a pause to grow, a preemption); a BaseException so ``except Exception`` in
    the user's loop does not swallow it."""

    def __init__(self, index: int, kind: str):
        super().__init__(f"stopping at report {index} ({kind})")
        self.index, self.kind = index, kind


@dataclass(frozen=True)
class TrainContext:
    """Ray Train's ``TrainContext`` (the same getters)."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    storage: RunStorage
    metadata: Dict[str, Any]

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_storage(self) -> RunStorage:
        return self.storage

    def get_metadata(self) -> Dict[str, Any]:
        return dict(self.metadata)


def checked_metrics(metrics: Any) -> Dict[str, Any]:
    """``metrics`` as plain JSON values (numpy and torch scalars taken as numbers); a
    value that is not one raises ``TypeError`` naming its key."""
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics=...): a dict of str -> number, not {type(metrics)}")
    out: Dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"report(metrics=...): key {key!r} is not a str")
        out[key] = _plain(key, value)
    return out


def _plain(key: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _plain(key, value.item())
    if isinstance(value, np.ndarray) and value.size == 1:
        return _plain(key, value.item())
    if isinstance(value, (list, tuple)):
        return [_plain(key, v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(f"{key}.{k}", v) for k, v in value.items()}
    raise TypeError(
        f"report(metrics=...): {key!r} is a {type(value).__name__}, which cannot be "
        "recorded; report a number, a string, or a list/dict of them (e.g. loss.item())"
    )


class LoopSession:
    """One rank's side of the user's function for one group.

    ``exchange(payload)``: the all-gather of every rank's report payload;
    ``push(logged)``: hand a report to the controller's records;
    ``stop_asked()``: a stop the controller asked for (``PAUSE``, ``PREEMPT``, or
    ``PREEMPT_NOW`` once a preemption's grace ran out), taken at a report (``stop_here``).
    """

    def __init__(
        self,
        context: TrainContext,
        *,
        start_index: int,
        start_checkpoint: Optional[Checkpoint],
        exchange: Callable[[Tuple], List[Tuple]],
        push: Callable[[LoggedReport], None],
        stop_asked: Callable[[], Optional[str]],
        uploader: Uploader,
        group_id: str,
        datasets: Dict[str, DatasetShard],
        registration: Registration,
        held: Optional[HeldReports] = None,
    ):
        self.context = context
        self.index = start_index
        self._checkpoint = start_checkpoint
        self._exchange, self._push, self._stop_asked = exchange, push, stop_asked
        self._uploader, self._group_id = uploader, group_id
        self._datasets = datasets
        self.registration = registration
        self._held = held  # the run's memory tier: each reported checkpoint goes there first
        self._log, self._run = process_report_log(), context.storage.root
        self._last = time.time()
        self.blocked_s: List[float] = []  # what each report with a checkpoint blocked for
        self.failed_writes: List[int] = []  # reports whose registered state was not written

    def report(self, metrics: Dict[str, Any], checkpoint: Optional[Checkpoint] = None) -> None:
        """Record ``metrics`` (rank 0's reach the run's records); a ``checkpoint``'s files
        are staged now (hard links, ``staging``) and persisted in the background."""
        plain = checked_metrics(metrics)
        self.registration.check_registered("report()")
        index = self.index + 1
        started = time.time()
        staged = None if checkpoint is None else self._stage(checkpoint)
        positions = shard_positions(self._datasets)
        resizable = self.registration.resizable
        now = time.time()
        logged = LoggedReport(index, now, now - self._last, plain)
        mine = logged if self.context.world_rank == 0 else None
        try:
            payload = (REPORT, index, staged is not None, self._stop_asked(), positions, resizable)
            registration = self.registration
            gathered = self._exchange(
                (*payload, mine, registration.copy_to_peer, registration.writes_files)
            )
            self.check_agreement(gathered, REPORT, index)
        except BaseException:
            if staged is not None:  # never queued: nobody else removes it
                shutil.rmtree(staged.directory, ignore_errors=True)
            raise
        self.index = index
        self._log.add(self._run, gathered[0][LOGGED])
        self.registration.at_report(index, positions)
        rank = self.context.world_rank
        uploading = [r for r, g in enumerate(gathered) if g[HAS_CHECKPOINT]]
        if uploading and gathered[0][FILES]:  # every rank writes its part into the checkpoint
            staged = self._with_registered_state(staged, index)
            uploading = list(range(len(gathered))) if staged is not None else []
        commit = uploading if rank == 0 else []
        if staged is not None or commit:
            storage, group = self.context.storage, self._group_id
            job = UploadJob(
                storage, index, rank, group, staged, commit, plain, positions, self._held
            )
            self._uploader.submit(job)
        if staged is not None:
            self.blocked_s.append(time.time() - started)
        self._push(logged)
        self._last = now
        stop_now = stop_here(gathered)
        if stop_now is not None:
            raise StopAtBoundary(index, stop_now)

    def get_checkpoint(self) -> Optional[Checkpoint]:
        """The newest reported checkpoint when this group started, the same on every rank:
        the newest committed one in storage, or a newer one the memory tier holds (then a
        local copy of its files); the trainer's ``resume_from_checkpoint`` before any; None
        for a fresh run."""
        return self._checkpoint

    def get_dataset_shard(self, name: str) -> DatasetShard:
        if name not in self._datasets:
            known = ", ".join(sorted(self._datasets)) or "none"
            raise KeyError(
                f"get_dataset_shard({name!r}): no dataset of that name was passed to "
                f"TorchTrainer(datasets=...) (given: {known})"
            )
        return self._datasets[name]

    def register(self, objects: Dict[str, Any], copy_to_peer: bool = False) -> int:
        return self.registration.register(objects, copy_to_peer)

    def finish(self) -> None:
        """The function returned: agree that every rank did, at the same report."""
        self.registration.check_registered("the function returned")
        gathered = self._exchange(
            (RETURNED, self.index, False, None, {}, False, None, False, False)
        )
        self.check_agreement(gathered, RETURNED, self.index)

    def check_agreement(self, gathered: List[Tuple], kind: str, index: int) -> None:
        """Every rank made the same call at the same index, else ``ReportMismatch``; and
        at a report, every rank is at the same place in every dataset."""
        if all(g[KIND] == kind and g[INDEX] == index for g in gathered):
            self._check_positions(gathered, index)
            self._check_registered_alike(gathered, index)
            return
        calls: Dict[Tuple[str, int], List[int]] = {}
        for rank, g in enumerate(gathered):
            calls.setdefault((g[0], g[1]), []).append(rank)
        said = "; ".join(
            f"ranks {ranks} " + (f"called report #{i}" if k == REPORT else f"returned after {i}")
            for (k, i), ranks in sorted(calls.items(), key=lambda kv: kv[1])
        )
        raise ReportMismatch(
            f"the ranks did not make the same report: {said}. Every rank must call "
            "raytrain_ext.train.report the same number of times (pass checkpoint=None on the "
            "ranks that have nothing to save)."
        )

    @staticmethod
    def _check_registered_alike(gathered: List[Tuple], index: int) -> None:
        """Every rank sends its registered copy to a peer, or none does (the exchange that
        follows the report is a collective); every rank registered its state, or none did
        (writing it into a checkpoint is a collective)."""
        for field, did in (
            (COPIES, "registered with copy_to_peer=True"),
            (FILES, "had called register()"),
        ):
            ranks = [r for r, g in enumerate(gathered) if g[field]]
            if ranks and len(ranks) < len(gathered):
                raise ReportMismatch(
                    f"at report #{index} ranks {ranks} {did} and the others had not; call "
                    "raytrain_ext.train.register(...) alike on every rank (the same "
                    "copy_to_peer), before the same report"
                )

    def _with_registered_state(self, staged: Optional[Staged], index: int) -> Optional[Staged]:
        """Every rank together: its staged files with its part of the registered state
        added; None on every rank, the user's files removed, when writing it failed (a
        checkpoint without it would resume the loop from state it lacks)."""
        try:
            return self.registration.write_files(staged, self.context.experiment_name)
        except CheckpointException as e:
            if staged is not None:
                shutil.rmtree(staged.directory, ignore_errors=True)
            level = logging.ERROR if self.context.world_rank == 0 else logging.DEBUG
            text = "ALARM: report %d keeps no checkpoint: its registered state could not be written: %s"
            log.log(level, text, index, e)
            self.failed_writes.append(index)
            return None

    @staticmethod
    def _check_positions(gathered: List[Tuple], index: int) -> None:
        if all(g[POSITIONS] == gathered[0][POSITIONS] for g in gathered):
            return
        said = "; ".join(f"rank {r}: {g[POSITIONS]}" for r, g in enumerate(gathered))
        raise ReportMismatch(
            f"at report #{index} the ranks are at different places in their dataset shards "
            f"([epoch, row] of each dataset: {said}). Every rank must take the same number of "
            "batches of each get_dataset_shard between reports (the same batch_size on every "
            "rank; leave a loop over a shard on every rank alike)."
        )

    def _stage(self, checkpoint: Checkpoint) -> Staged:
        if not checkpoint.is_local:
            raise ValueError(
                f"report(checkpoint=...): {checkpoint} is not a local directory; pass "
                "Checkpoint.from_directory(a local directory)"
            )
        if self.registration.writes_files and os.path.exists(
            os.path.join(checkpoint.path, REGISTERED_DIR)
        ):
            raise ValueError(
                f"report(checkpoint=...): {checkpoint.path} holds {REGISTERED_DIR}/, where "
                "raytrain_ext.train writes the registered state; rename it"
            )
        return stage(checkpoint.path, self.context.experiment_name)


_CURRENT: Optional[LoopSession] = None


def set_session(session: Optional[LoopSession]) -> None:
    global _CURRENT
    _CURRENT = session


def current_session(what: str) -> LoopSession:
    if _CURRENT is None:
        raise RuntimeError(
            f"raytrain_ext.train.{what}() is called from inside train_loop_per_worker, "
            "while TorchTrainer.fit() runs it"
        )
    return _CURRENT
