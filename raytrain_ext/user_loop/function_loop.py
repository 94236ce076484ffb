"""``FunctionLoop``: one rank runs the user's function where the built-in loop would run.

The worker actor builds one per group, exactly as it builds a ``TrainLoop``, so the
controller drives both alike: a failed rank's peers raise out of the user's collective,
their processes are kept, and the next group enters the function again in them (imports,
CUDA context and caches kept), resuming from the newest committed checkpoint
(``get_checkpoint``); a pause (growing) or a preemption stops every rank at the same
``report``, the next one with a checkpoint (``session.stop_here``).  A user loop keeps no
state between groups for the controller (``live_state`` is None); a loop that
registers its state (``register``) keeps a copy of it at each report in the process
(``user_loop.registered``), and the next group starts from the newest copy a live process
holds when no committed checkpoint is newer.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
import traceback
import uuid
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from raytrain_ext.checkpoint.manager import REQUEST_EMERGENCY, SaveRequests
from raytrain_ext.data.row_input import reader_name
from raytrain_ext.errors.text import is_peer_loss
from raytrain_ext.messages import FitResult, StepReport
from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.dataset_shard import DatasetShard, positions_of
from raytrain_ext.user_loop.held_reports import HeldReport, HeldReports
from raytrain_ext.user_loop.loop_function import LoopFunction
from raytrain_ext.user_loop.registered import (
    LiveResume,
    Offer,
    Registration,
    live_start,
    process_snapshots,
)
from raytrain_ext.user_loop.report_log import LoggedReport, merged, process_report_log
from raytrain_ext.user_loop.session import (
    PAUSE,
    PREEMPT,
    PREEMPT_NOW,
    LoopSession,
    StopAtBoundary,
    TrainContext,
    set_session,
)
from raytrain_ext.user_loop.uploader import COMMIT_TIMEOUT_S, process_uploader

if TYPE_CHECKING:
    from raytrain_ext.worker.rendezvous import WorkerEnv


Positions = Dict[str, Tuple[int, int]]


class UserLoopError(RuntimeError):
    """The user's function raised: its error and the line of the user's code it came from."""


def where(error: BaseException) -> str:
    """``Type: message, at file:line in function: source`` for the deepest frame of the
    traceback outside this package and installed libraries (the user's own line)."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not _library(f.filename)] or frames
    text = f"{type(error).__name__}: {error}"
    if not own:
        return text
    frame = own[-1]
    return f"{text}, at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"


def _library(filename: str) -> bool:
    return any(part in filename for part in ("site-packages", "/raytrain_ext/", "/lib/python"))


class FunctionLoop:
    def __init__(
        self,
        cfg,
        env: WorkerEnv,
        report: Callable[[StepReport], None],
        requests: SaveRequests,
        mark: Callable[[str], None],
        loop_function: LoopFunction,
    ):
        self.cfg, self.env, self.requests = cfg, env, requests
        self._report, self._mark, self.spec = report, mark, loop_function
        self.finished = False
        self.build_marks: Dict[str, float] = {}  # RankLoop's: the starting point's read
        self.restored: Optional[Dict[str, Any]] = None
        self.registration: Optional[Registration] = None
        self._first = True
        # the run's memory tier, which holds each reported checkpoint (``held_reports``)
        memory = cfg.checkpoint.memory
        self.held = HeldReports(cfg.run.name, cfg.checkpoint.keep_in_memory) if memory else None

    def live_state(self) -> None:
        return None

    def held_chunks(self) -> None:
        return None

    def fit(self) -> FitResult:
        timeout = datetime.timedelta(seconds=self.cfg.parallel.timeout_s)
        group = dist.new_group(backend="gloo", timeout=timeout)
        uploader = process_uploader()
        # a survivor's memory copies (without a memory tier: its uploads) of the last group
        # land first, every rank's before rank 0 reads the newest (bounded: well within the
        # group's collective timeout)
        drain = uploader.drain if self.held is None else uploader.drain_holds
        drain(self.cfg.parallel.timeout_s / 4)
        keeper, run = process_snapshots(), self.spec.storage.root
        logged = process_report_log().reports(run)
        gathered = self._all_gather((keeper.offer(run), logged), group)
        offers = [offer for offer, _ in gathered]
        index, checkpoint, group_id, positions, live = self._starting_point(group, offers)
        if self.env.rank == 0:  # what a dead rank 0 reported that the records may lack
            for report in merged([log for _, log in gathered], through=index):
                self._push_report(report, replayed=True)
        uploader.start_group(group_id)
        self.registration = Registration(
            run,
            index,
            live,
            keeper,
            lambda start, objects, layout: keeper.resume(run, start, objects, layout, group),
            self.env.world_size,
        )
        session = LoopSession(
            self._context(),
            start_index=index,
            start_checkpoint=checkpoint,
            exchange=lambda payload: self._all_gather(payload, group),
            push=self._push,
            stop_asked=self._stop_asked,
            uploader=uploader,
            group_id=group_id,
            datasets=self._dataset_shards(group_id, positions),
            registration=self.registration,
            held=self.held,
        )
        set_session(session)
        self._mark("compute")
        try:
            self._call()
            session.finish()
        except StopAtBoundary as stop:
            if stop.kind == PAUSE:  # the grown group resumes from this report's checkpoint
                uploader.drain(COMMIT_TIMEOUT_S)
                return self._result(session, paused_at=stop.index)
            uploader.drain(self._grace_left())
            return self._result(session, preempted_at=stop.index)
        finally:
            set_session(None)
        uploader.drain(COMMIT_TIMEOUT_S)  # the result names persisted checkpoints only
        dist.destroy_process_group(group)
        self.finished = True
        return self._result(session)

    def _call(self) -> None:
        """The user's function; its own error (not a peer's loss, which the controller
        reads as an echo) comes back naming the line of the user's code that raised."""
        try:
            self.spec.call()
        except StopAtBoundary:
            raise
        except Exception as e:
            if is_peer_loss(e):
                raise
            message = f"train_loop_per_worker raised {where(e)}"
            # the user's frames hold its model (a DDP Reducer, its process group): they must
            # not outlive the group (``TrainWorker.fit`` clears only the raised error's)
            traceback.clear_frames(e.__traceback__)
            raise UserLoopError(message) from e

    def _grace_left(self) -> float:
        deadline = self.requests.deadline
        return 0.0 if deadline is None else max(0.0, deadline - time.time())

    def _starting_point(
        self, group, offers: List[Offer]
    ) -> Tuple[int, Optional[Checkpoint], str, Positions, Optional[LiveResume]]:
        """Where this group starts, the same on every rank: the newest committed checkpoint
        (index 0 and ``resume_from_checkpoint`` when the run has none) or the newest report
        the memory tier holds when it is newer (``held_reports``), the dataset positions
        recorded with it, and a new id for this group; the group starts instead at the
        newest report whose registered state a live process holds (``offers``, one per
        rank) when neither is newer (``registered.live_start``).  Rank 0 first removes what
        earlier groups left beyond the newest committed checkpoint (uncommitted uploads
        never commit: every group has its own id) and beyond where the group starts in
        memory."""
        started = self.build_marks["restore_started_at"] = time.time()
        found: list = [None]
        if self.env.rank == 0:
            found = [self._choose_start(offers)]
        dist.broadcast_object_list(found, src=0, group=group)
        index, checkpoint, group_id, positions, live, held = found[0]
        tier = "storage"
        if held is not None and self.held is not None:  # chosen only with a memory tier
            checkpoint, tier = self._materialize(self.held, held), "memory"
        self.build_marks["restored_at"] = time.time()
        if index and live is None:
            self.restored = {"step": index, "tier": tier, "total_s": time.time() - started}
        return index, checkpoint, group_id, positions, live

    def _choose_start(self, offers: List[Offer]) -> Tuple:
        """Rank 0's part of ``_starting_point``: (index, checkpoint, group id, positions,
        live resume, held report)."""
        storage = self.spec.storage
        latest = storage.latest()
        committed = 0 if latest is None else latest.index
        held = None if self.held is None else self.held.newest()
        if held is not None and held.index <= committed:
            held = None
        newest = committed if held is None else held.index
        live = live_start(offers, newest, self.env.world_size)
        storage.discard_after(committed)  # uploads past it never commit: new group ids
        checkpoint = self.spec.resume_from if latest is None else latest.checkpoint
        positions = positions_of(None if latest is None else latest.positions)
        if live is not None:
            index, positions, held = live.index, live.positions, None
        elif held is not None:
            index, positions = held.index, positions_of(held.positions)
        else:
            index = committed
        if self.held is not None:
            self.held.discard_after(index)
        return index, checkpoint, uuid.uuid4().hex[:12], positions, live, held

    def _materialize(self, held_reports: HeldReports, held: HeldReport) -> Checkpoint:
        """The held report's files in this process's directory for them (the one an earlier
        group took is replaced)."""
        target = os.path.join(
            tempfile.gettempdir(), f"raytrain-ext-{self.cfg.run.name}-held-{os.getpid()}"
        )
        shutil.rmtree(target, ignore_errors=True)
        return held_reports.materialize(held, target)

    def _dataset_shards(self, group_id: str, positions: Positions) -> Dict[str, DatasetShard]:
        """This rank's shard of each dataset, read from the run's reader of it
        (``dataset_shard``), from where the checkpoint the group resumes from left it."""
        return {
            name: DatasetShard(
                name,
                reader_name(self.spec.experiment_name, name),
                rank=self.env.rank,
                world=self.env.world_size,
                group=group_id,
                position=positions.get(name, (0, 0)),
                timeout_s=self.cfg.parallel.timeout_s,
            )
            for name in self.spec.datasets
        }

    def _context(self) -> TrainContext:
        e = self.env
        return TrainContext(
            e.rank,
            e.world_size,
            e.local_rank,
            e.local_world_size,
            e.node_rank,
            self.spec.experiment_name,
            self.spec.storage,
            self.spec.metadata,
        )

    @staticmethod
    def _all_gather(payload: Tuple, group) -> list:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, payload, group=group)
        return gathered

    def _stop_asked(self) -> Optional[str]:
        if self.requests.paused:
            return PAUSE
        if self.requests.flag != REQUEST_EMERGENCY:
            return None
        deadline = self.requests.deadline
        return PREEMPT_NOW if deadline is not None and time.time() >= deadline else PREEMPT

    def _push(self, index: int, metrics: Dict[str, Any], interval_s: float) -> None:
        self._push_report(LoggedReport(index, time.time(), interval_s, metrics))

    def _push_report(self, logged: LoggedReport, replayed: bool = False) -> None:
        """Hand a report to the controller's records (``replayed``: one made by an earlier
        group's rank 0, ``report_log``)."""
        loss = logged.metrics.get("loss")
        first = self._first and not replayed
        report = StepReport(
            step=logged.index,
            time=logged.time,
            step_time_s=logged.interval_s,
            loss=float(loss) if isinstance(loss, (int, float)) else float("nan"),
            world_size=self.env.world_size,
            metrics={"reported": logged.metrics},
            first_of_group=first,
            restored=self._restore_record() if first else None,
            replayed=replayed,
        )
        self._first = self._first and replayed
        self._report(report)

    def _restore_record(self) -> Optional[Dict[str, Any]]:
        """Where this group's state came from: the live copy ``register`` loaded, or the
        committed checkpoint the group started from."""
        live = None if self.registration is None else self.registration.restored
        return live or self.restored

    def _result(
        self,
        session: LoopSession,
        paused_at: Optional[int] = None,
        preempted_at: Optional[int] = None,
    ) -> FitResult:
        blocked = session.blocked_s
        return FitResult(
            rank=self.env.rank,
            steps=session.index,
            restored=self._restore_record(),
            checkpoint={
                "reports_with_checkpoint": len(blocked),
                "report_blocked_s": sorted(blocked),
                "registered_copy_s": sorted(session.registration.copy_s),
                "upload_failures": list(process_uploader().failures),
            },
            paused_at=paused_at,
            preempted_at=preempted_at,
        )
