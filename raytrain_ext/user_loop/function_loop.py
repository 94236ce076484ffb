"""``FunctionLoop``: one rank runs the user's function where the built-in loop would run.

The worker actor builds one per group, exactly as it builds a ``TrainLoop``, so the
controller drives both alike: a failed rank's peers raise out of the user's collective,
their processes are kept, and the next group enters the function again in them (imports,
CUDA context and caches kept), resuming from the newest reported checkpoint
(``get_checkpoint``: committed in storage, or held in the memory tier, ``starting_point``);
a pause (growing) or a preemption stops every rank at the same ``report``, the next one
with a checkpoint (``session.stop_here``).  A user loop keeps no state between groups for
the controller (``live_state`` is None); a loop that registers its state (``register``)
keeps a copy of it at each report in the process (``user_loop.registered``), and the next
group starts from the newest copy a live process holds when no checkpoint is newer.  Each
group's rank 0 first hands the controller the reports a dead rank 0 may not have
delivered (``report_log``).
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from raytrain_ext.checkpoint.agreement import gather_from_all
from raytrain_ext.checkpoint.manager import REQUEST_EMERGENCY, SaveRequests
from raytrain_ext.data.row_input import reader_name
from raytrain_ext.errors.text import is_peer_loss
from raytrain_ext.messages import FitResult, StepReport
from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.dataset_shard import DatasetShard
from raytrain_ext.user_loop.held_reports import HeldReport, HeldReports
from raytrain_ext.user_loop.loop_function import LoopFunction
from raytrain_ext.user_loop.registered import (
    Offer,
    PeerOffer,
    Registration,
    peer_exchange,
    process_snapshots,
)
from raytrain_ext.user_loop.registered_files import RegisteredFiles
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
from raytrain_ext.user_loop.starting_point import Start, choose_start, fall_back
from raytrain_ext.user_loop.uploader import COMMIT_TIMEOUT_S, process_uploader

if TYPE_CHECKING:
    from raytrain_ext.worker.rendezvous import WorkerEnv

log = logging.getLogger(__name__)


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
        # where a held report's files are written for get_checkpoint (one per process)
        self._held_copy = os.path.join(
            tempfile.gettempdir(), f"raytrain-ext-{cfg.run.name}-held-{os.getpid()}"
        )

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
        uploader.abandon(self.cfg.parallel.timeout_s / 4)
        keeper, run = process_snapshots(), self.spec.storage.root
        mine = (keeper.offers(run), keeper.peer_offers(run), self.env.node_rank)
        offers, peers, nodes = zip(*gather_from_all(mine, group), strict=True)
        start = self._starting_point(group, list(offers), list(peers))
        self._settle(group, start, uploader)
        self._replay(group, run, start.index)
        index, group_id = start.index, start.group_id
        uploader.start_group(group_id)
        self.registration = Registration(
            run,
            index,
            start.live,
            keeper,
            lambda at, objects, layout: keeper.resume(run, at, objects, layout, group),
            self.env.world_size,
            peer_exchange(nodes, self.env.rank, group),
            RegisteredFiles(group),
            start.checkpoint,
        )
        session = LoopSession(
            self._context(),
            start_index=index,
            start_checkpoint=start.checkpoint,
            exchange=lambda payload: gather_from_all(payload, group),
            push=self._push_report,
            stop_asked=self._stop_asked,
            uploader=uploader,
            group_id=group_id,
            datasets=self._dataset_shards(group_id, start.positions),
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
            shutil.rmtree(self._held_copy, ignore_errors=True)
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
        self, group, offers: List[Sequence[Offer]], peers: List[Sequence[PeerOffer]]
    ) -> Start:
        """Where this group starts, the same on every rank (``starting_point``); a held
        report's files are written here on every rank, and when any rank cannot read them
        every rank starts from storage's newest instead."""
        started = self.build_marks["restore_started_at"] = time.time()
        found: list = [None]
        if self.env.rank == 0:
            spec = self.spec
            found = [
                choose_start(
                    spec.storage, self.held, offers, self.env.world_size, spec.resume_from, peers
                )
            ]
        dist.broadcast_object_list(found, src=0, group=group)
        start: Start = found[0]
        tier = "storage"
        if start.held is not None and self.held is not None:  # chosen only with a memory tier
            checkpoint = self._materialize(self.held, start.held)
            if all(gather_from_all(checkpoint is not None, group)):
                start, tier = replace(start, checkpoint=checkpoint), "memory"
            else:
                start = fall_back(start, offers, self.env.world_size, peers)
        self.build_marks["restored_at"] = time.time()
        if start.index and start.live is None:
            self.restored = {"step": start.index, "tier": tier, "total_s": time.time() - started}
        return start

    def _materialize(self, held_reports: HeldReports, held: HeldReport) -> Optional[Checkpoint]:
        """The held report's files in this process's directory for them (the one an earlier
        group took is replaced); None when one cannot be read (its holders are gone)."""
        shutil.rmtree(self._held_copy, ignore_errors=True)
        try:
            return held_reports.materialize(held, self._held_copy)
        except Exception as e:  # noqa: BLE001 - every rank then starts from storage
            log.warning("report %d held in memory is not readable here (%s)", held.index, e)
            return None

    def _settle(self, group, start: Start, uploader) -> None:
        """Nothing of an earlier group lands after this group's rank 0 removed what earlier
        groups left beyond its start (``Uploader.settle``, bounded; past the bound every
        rank raises, and the group re-forms): uploads past the newest commit never commit
        (every group has its own id), and held reports past the start are reported
        again."""
        settled = uploader.settle(start.index, self.cfg.parallel.timeout_s / 2)
        late = [rank for rank, ok in enumerate(gather_from_all(settled, group)) if not ok]
        if late:
            raise RuntimeError(
                f"ranks {late} still upload a checkpoint of the last group past report "
                f"{start.index}, where this group will write: this group gives up and the "
                "next one waits for them again (storage slower than parallel.timeout_s / 2)"
            )
        if self.env.rank == 0:
            self.spec.storage.discard_after(start.committed)
            if self.held is not None:
                self.held.discard_after(start.index)

    def _replay(self, group, run: str, index: int) -> None:
        """Rank 0 hands the controller every rank's logged reports up to ``index`` again:
        those a dead rank 0 made that the records may lack (``report_log``)."""
        logs: list = [None] * self.env.world_size if self.env.rank == 0 else []
        dist.gather_object(process_report_log().reports(run), logs or None, dst=0, group=group)
        if self.env.rank == 0:
            for report in merged(logs, through=index):
                self._push_report(report, replayed=True)

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

    def _stop_asked(self) -> Optional[str]:
        if self.requests.paused:
            return PAUSE
        if self.requests.flag != REQUEST_EMERGENCY:
            return None
        deadline = self.requests.deadline
        return PREEMPT_NOW if deadline is not None and time.time() >= deadline else PREEMPT

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
        committed checkpoint the group started from (``registered``: what ``register``
        loaded from its files)."""
        registration = self.registration
        if registration is not None and registration.restored is not None:
            return registration.restored
        if registration is not None and registration.loaded is not None and self.restored:
            return {**self.restored, "registered": registration.loaded}
        return self.restored

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
                "registered_write_failures": list(session.failed_writes),
            },
            paused_at=paused_at,
            preempted_at=preempted_at,
        )
