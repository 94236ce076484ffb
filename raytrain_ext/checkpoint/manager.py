"""Saving the whole training state (and restoring it, through ``Restorer``), one per rank.

Save protocol (every rank, same step, agreed through the training loop's
per-step exchange):
1. In the loop: snapshot the state to host memory (the only stall).
2. In a background thread, on a dedicated gloo group (an async DCP save on
   the training group crashes gloo): DCP writes this rank's shards into the
   staging directory (the local tier's own directory when it is enabled).
3. Each rank's files are checksummed as DCP writes them; an all-gather gives
   every rank the file list.
4. Tier by tier (local, then S3): each rank uploads its files, the ranks agree
   that all uploads landed, then the manifest is written last (commit) and old
   checkpoints are pruned.  A tier that fails is alarmed and skipped; the
   others still commit.

Restore is :mod:`.restore` (``Restorer``), which this manager holds and calls.

A strategy with its own checkpoint format (DeepSpeed, ``native_checkpoint``)
also writes it in step 1, on the training thread (it is a collective on the
training group); its files join the same manifest (:mod:`.native`).
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from raytrain_ext.checkpoint import native
from raytrain_ext.checkpoint import state as ckpt_state
from raytrain_ext.checkpoint.agreement import gather_from_all
from raytrain_ext.checkpoint.held_chunks import HeldChunks
from raytrain_ext.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    checksum_file,
    step_dir_name,
)
from raytrain_ext.checkpoint.peer_loss_latch import PeerLossLatch
from raytrain_ext.checkpoint.recycle import POOL
from raytrain_ext.checkpoint.restore import Restorer
from raytrain_ext.checkpoint.save_failure import save_failure_text
from raytrain_ext.checkpoint.snapshot_policy import SnapshotPolicy
from raytrain_ext.checkpoint.tiers import build_tiers
from raytrain_ext.checkpoint.tiers.base import Tier, prune
from raytrain_ext.checkpoint.train_state import TrainState
from raytrain_ext.checkpoint.writer import ChecksummingWriter
from raytrain_ext.version import __version__

log = logging.getLogger(__name__)

REQUEST_NONE, REQUEST_SAVE, REQUEST_EMERGENCY = 0.0, 1.0, 2.0


class SaveRequests:
    """Save requests from outside the loop: the API (on demand) and SIGTERM (preemption).

    Set from another thread or a signal handler; the loop folds ``vote()`` into
    its per-step exchange, so a request on any rank makes every rank save.
    """

    def __init__(self) -> None:
        self.flag = REQUEST_NONE
        self.deadline: Optional[float] = None
        self.paused = False

    def on_demand(self) -> None:
        self.flag = max(self.flag, REQUEST_SAVE)

    def preempt(self, grace_s: float) -> None:
        self.flag = REQUEST_EMERGENCY
        self.deadline = time.time() + grace_s

    def pause(self) -> None:
        """Stop at the next step boundary without saving (the group is about to grow)."""
        self.paused = True

    def pause_vote(self) -> float:
        return float(self.paused)

    def vote(self) -> float:
        flag = self.flag
        if flag == REQUEST_SAVE:
            self.flag = REQUEST_NONE
        return flag


def seconds_between_saves(ckpt_cfg, saves: int) -> Optional[float]:
    """The time schedule: ``every_seconds``; before a group's first save, with no step
    schedule (``every_steps`` null), ``first_save_after_s`` if sooner, so a run that dies
    whole in its first minutes loses at most that, not ``every_seconds``."""
    every, first = ckpt_cfg.every_seconds, ckpt_cfg.first_save_after_s
    if saves or ckpt_cfg.every_steps is not None or first is None:
        return every
    return first if every is None else min(every, first)


def carried_by(regular: bool, request: float) -> ckpt_state.Carry:
    """What a save carries of GRPO's generations made with older weights: a per-step
    snapshot none (it serves a re-form whose engines live on), an emergency save the one
    the next step trains on (a deadline waits for at most one generation, which every
    rank must agree on), any other save all."""
    if not regular:
        return ckpt_state.Carry.NONE
    return ckpt_state.Carry.NEXT if request >= REQUEST_EMERGENCY else ckpt_state.Carry.ALL


class CheckpointManager:
    def __init__(
        self,
        ckpt_cfg,
        run_name: str,
        rank: int,
        world_size: int,
        local_rank: int,
        config_digest: str,
        stall_s: float = 0.0,
        own_shards: bool = False,
    ):
        """``own_shards``: the layout's ranks each hold their own shards (``snapshot_policy``:
        per-step snapshots by default)."""
        self.cfg = ckpt_cfg
        self.stall_s = stall_s  # chaos: hold saves open between write and commit
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.config_digest = config_digest
        self.tiers: List[Tier] = build_tiers(ckpt_cfg, run_name)
        scratch = Path(tempfile.gettempdir()) / f"raytrain-ext-{run_name}"
        self.staging = Path(ckpt_cfg.dir) if ckpt_cfg.local else scratch / "staging"
        self.cache = scratch / f"cache-rank{rank}"
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ckpt_cfg.timeout_s))
        self.restorer = Restorer(ckpt_cfg, self.tiers, rank, world_size, self.group, self.cache)
        self._thread: Optional[threading.Thread] = None
        self._persisting_regular = False  # what _thread persists: a regular save, or a snapshot
        self._buffers: Any = None  # host copy of the last snapshot, reused by the next
        self.peer_loss = PeerLossLatch()  # _thread's persist met a vanished peer
        self._last_save_time = time.time()
        self.snapshots = SnapshotPolicy(ckpt_cfg.snapshot_every_step, own_shards)
        self._waited_s = 0.0  # before this step's update, for the last save (a stall)
        self._step_started: Optional[float] = None  # the previous after_step's end
        self.stats: Dict[str, Any] = {
            "saves": 0,
            "skipped": 0,
            "stall_s": 0.0,
            "committed": {t.name: None for t in self.tiers},
            "failed": [],
            "timings": [],
            "stalls_s": [],
        }

    # ---- deciding -------------------------------------------------------------------------
    def request_flag(self) -> float:
        """This rank's vote for saving after the current step (max over ranks wins)."""
        flag = REQUEST_NONE
        every = seconds_between_saves(self.cfg, self.stats["saves"])
        if self.rank == 0 and every is not None and time.time() - self._last_save_time >= every:
            flag = max(flag, REQUEST_SAVE)
        return flag

    def busy(self) -> bool:
        """A regular save still persists (``checkpoint.on_busy``); a per-step snapshot's
        persist does not count: the next save waits for it (``before_update``)."""
        return self._thread is not None and self._thread.is_alive() and self._persisting_regular

    def is_due(self, step: int, request: float, final: bool) -> bool:
        every = self.cfg.every_steps
        return (
            (final and self.cfg.save_final)
            or request >= REQUEST_SAVE
            or (every is not None and step % every == 0)
        )

    def after_step(
        self,
        state: TrainState,
        step: int,
        request: float,
        any_busy: bool,
        final: bool,
        deadline: Optional[float] = None,
    ) -> float:
        """Save if due (identically on every rank); returns the training stall in seconds.

        Final and emergency saves are synchronous: they are committed (to every
        tier that fits before ``deadline``) when this returns.  With
        ``checkpoint.snapshot_every_step``, a step not otherwise due is saved to the
        memory tier alone (replicated to a second node).  A snapshot is never skipped:
        when the last save still persists, the step waits for it (counted in the stall),
        so the newest committed step is at most one behind the last finished one.
        """
        regular = self.is_due(step, request, final)
        waited, self._waited_s = self._waited_s, 0.0
        if not regular and not self._snapshot_due():
            self._step_started = time.perf_counter()
            return waited
        urgent = final or request >= REQUEST_EMERGENCY
        if any_busy and regular and self.cfg.on_busy == "skip" and not urgent:
            self.stats["skipped"] += 1
            if self.rank == 0:
                log.warning(
                    "checkpoint at step %d skipped: the previous save is still "
                    "persisting (checkpoint.on_busy=skip)",
                    step,
                )
            return waited
        start = time.perf_counter()
        self.wait()  # the previous snapshot's buffers are free again (before_update: mostly)
        native_files = self._save_native(state, step) if regular else native.NativeFiles()
        tiers = None if regular else [t for t in self.tiers if t.holds_snapshots]
        carry = carried_by(regular, request)
        snap = ckpt_state.snapshot(ckpt_state.capture(state, carry), reuse=self._buffers)
        self._buffers = snap
        if torch.cuda.is_available() and state.ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        stall = time.perf_counter() - start + waited
        if not regular:
            self._judge_snapshots(stall)
        self._step_started = time.perf_counter()
        self.stats["saves"] += 1
        self.stats["stall_s"] += stall
        self.stats["stalls_s"].append(round(stall, 6))
        self._last_save_time = time.time()
        if self.cfg.async_save and not urgent:
            self._persisting_regular = regular
            self._thread = threading.Thread(
                target=self._persist,
                args=(step, snap, None, native_files, tiers),
                name=f"ckpt-step-{step}",
                daemon=True,
            )
            self._thread.start()
        else:
            # an emergency is agreed, its deadline is not: only the ranks that got the notice
            # have one, and every rank must join the deadline checks' all-gathers
            emergency = request >= REQUEST_EMERGENCY
            self._persist(
                step,
                snap,
                (math.inf if deadline is None else deadline) if emergency else None,
                native_files,
                tiers,
            )
        return stall

    def _save_native(self, state: TrainState, step: int) -> native.NativeFiles:
        """The strategy's own checkpoint files of this step, moved into its staging dir.

        A failed native save leaves the step with its DCP files only (which any
        restore can load); like a failed persist, it never stops training.
        """
        strategy = state.strategy
        if not strategy.native_checkpoint:
            return native.NativeFiles()
        step_dir = self.staging / step_dir_name(step)
        saved_root = native.private_dir(step_dir, self.rank)
        try:
            shutil.rmtree(saved_root, ignore_errors=True)
            strategy.native_save(state.model, saved_root, step_dir_name(step))
            return native.NativeFiles(
                native.collect(saved_root, step_dir),
                {**strategy.native_info(), "tag": step_dir_name(step)},
            )
        except Exception as e:
            self.stats["failed"].append({"step": step, "tier": "native", "error": str(e)})
            log.error(
                "ALARM: native checkpoint of step %d failed on rank %d (its DCP files "
                "are still saved): %s",
                step,
                self.rank,
                e,
            )
            return native.NativeFiles()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def before_update(self) -> None:
        """With per-step snapshots, wait for the save in flight before this step's
        optimizer update: a node lost during the wait leaves the ranks one step past the
        newest committed snapshot, not two (after the update they would have finished
        another step that no snapshot holds).  The wait is a stall of this step's save.
        Raises ``SnapshotPeerLost`` when that save's collectives met a vanished peer."""
        # a regular save in flight is waited for only while snapshots are on; a snapshot
        # always (also in the step whose verdict turned them off)
        if self._thread is None or (self._persisting_regular and not self._snapshot_due()):
            return
        start = time.perf_counter()
        self.wait()
        self._waited_s += time.perf_counter() - start
        self.peer_loss.raise_if_tripped()

    def _judge_snapshots(self, stall_s: float) -> None:
        """Count a per-step snapshot for ``snapshot_policy``'s probe (its step: since the
        previous ``after_step`` ended)."""
        step_s = 0.0 if self._step_started is None else time.perf_counter() - self._step_started
        said = self.snapshots.observe(
            stall_s, step_s, lambda share: max(gather_from_all(share, self.group))
        )
        if said and self.rank == 0:
            log.info(said)

    # ---- saving ---------------------------------------------------------------------------
    def _snapshot_due(self) -> bool:
        return self.snapshots.on and any(t.holds_snapshots for t in self.tiers)

    def _persist(
        self,
        step: int,
        snap: Dict[str, Any],
        deadline: Optional[float] = None,
        native_files: Optional[native.NativeFiles] = None,
        tiers: Optional[List[Tier]] = None,
    ) -> None:
        """Write the snapshot, then upload and commit it to ``tiers`` in order (None: every
        tier; a per-step snapshot names the memory tier alone and its staged files go once
        uploaded); a tier that fails is recorded and the others go on; a failure because a
        peer vanished in a collective trips ``peer_loss`` for ``before_update``."""
        self.peer_loss.reset()
        try:
            native_files = native_files or native.NativeFiles()
            step_dir = self.staging / step_dir_name(step)
            timing: Dict[str, Any] = {"step": step, "tiers_s": {}}
            mine, entries = self._write(snap, step_dir, timing, native_files.names)
            parts = self._gather((entries, bool(native_files.info)))
            files = {name: entry for part, _ in parts for name, entry in part.items()}
            timing["bytes"] = sum(entry.size for entry in files.values())
            # native files are loadable only if every rank saved its own
            native_info = native_files.info if all(saved for _, saved in parts) else {}
            manifest = Manifest(
                step=step,
                world_size=self.world_size,
                tier="",
                files=files,
                config_digest=self.config_digest,
                versions=_versions(),
                native=native_info,
            )
            time.sleep(self.stall_s)
            for index, tier in enumerate(self.tiers if tiers is None else tiers):
                if index and self._agree_past(deadline):
                    self.stats["failed"].append(
                        {
                            "step": step,
                            "tier": tier.name,
                            "error": "preemption grace period ran out",
                        }
                    )
                    if self.rank == 0:
                        log.error(
                            "ALARM: preemption grace period ran out before step %d reached tier %s",
                            step,
                            tier.name,
                        )
                    continue
                tier_start = time.perf_counter()
                committed = self._persist_to(tier, manifest, step_dir, mine)
                timing["tiers_s"][tier.name] = time.perf_counter() - tier_start
                if committed:  # retention once the step is safe, outside its save time
                    self._retain(tier)
            self.stats["timings"].append(timing)
            if not self.cfg.local or tiers is not None:  # a snapshot's files live in memory
                shutil.rmtree(step_dir, ignore_errors=True)
        except (Exception, CheckpointException) as e:  # never kill training for a failed save
            self._save_failed(e, step, snap)

    def _save_failed(self, error: BaseException, step: int, snap: Dict[str, Any]) -> None:
        """Record a failed save, free what its partial files took, and say in one line
        (rank 0; the others and DCP's per-rank tracebacks at debug) what happens next."""
        step_dir = self.staging / step_dir_name(step)
        if not (step_dir / MANIFEST).exists():  # never committed: its partial files go
            shutil.rmtree(step_dir, ignore_errors=True)
        committed = [s for s in self.stats["committed"].values() if s is not None]
        key = "checkpoint.dir" if self.cfg.local else "the temporary directory"
        text = save_failure_text(
            error,
            step,
            self.staging,
            key,
            ckpt_state.tensor_bytes(snap),
            max(committed, default=None),
        )
        self.stats["failed"].append({"step": step, "error": text})
        log.log(logging.ERROR if self.rank == 0 else logging.DEBUG, "ALARM: %s", text)
        log.debug("checkpoint of step %d on rank %d: %s", step, self.rank, error)

    def _write(
        self, snap: Dict[str, Any], step_dir: Path, timing: Dict[str, Any], native_names: List[str]
    ) -> Tuple[List[str], Dict[str, Any]]:
        """DCP-write this rank's shards; returns (its files, their manifest entries).

        The data files are checksummed as they are written (``ChecksummingWriter``);
        only files it did not write (rank 0's small ``.metadata``, leftovers of an
        interrupted save of the same step, the strategy's native files) are read back.
        """
        chunk = self.cfg.checksum_chunk_kb * 1024
        started = time.perf_counter()
        pool = self.staging / POOL if self.cfg.local and self.cfg.recycle_files else None
        writer = ChecksummingWriter(step_dir, chunk, pool, thread_count=self.cfg.write_threads)
        with self.peer_loss.watch():
            dcp.save(snap, storage_writer=writer, process_group=self.group)
        timing["write_s"] = time.perf_counter() - started
        mine, written = sorted(self._own_files(step_dir) + native_names), writer.entries
        entries = {
            name: written.get(name) or checksum_file(step_dir / name, chunk) for name in mine
        }
        timing["checksum_s"] = time.perf_counter() - started - timing["write_s"]
        return mine, entries

    def _gather(self, value: Any) -> List[Any]:
        """Every rank's ``value`` (the checkpoint group's all-gather), watched for a
        vanished peer."""
        with self.peer_loss.watch():
            return gather_from_all(value, self.group)

    def _agree_past(self, deadline: Optional[float]) -> bool:
        """True on every rank when any rank is past ``deadline`` (one all-gather)."""
        if deadline is None:
            return False
        return any(self._gather(time.time() > deadline))

    def _own_files(self, step_dir: Path) -> List[str]:
        names = [p.name for p in step_dir.iterdir() if p.name.startswith(f"__{self.rank}_")]
        if self.rank == 0:
            names.append(".metadata")
        return sorted(names)

    def _persist_to(self, tier: Tier, manifest: Manifest, step_dir: Path, mine: List[str]) -> bool:
        """Upload every rank's files, then commit; True once the step is committed there."""
        error = None
        try:
            tier.upload(manifest.step, step_dir, mine)
        except Exception as e:
            error = f"rank {self.rank}: {e}"
        errors = [e for e in self._gather(error) if e]
        if errors:
            self.stats["failed"].append(
                {"step": manifest.step, "tier": tier.name, "error": errors[0]}
            )
            if self.rank == 0:
                log.error(
                    "ALARM: step %d not committed to tier %s: %s",
                    manifest.step,
                    tier.name,
                    "; ".join(errors),
                )
            return False
        if self._commits(tier):
            tier.commit(manifest.for_tier(tier.name))
        self.stats["committed"][tier.name] = manifest.step
        if self.rank == 0:
            log.info("checkpoint step %d committed to %s", manifest.step, tier.name)
        return True

    def _retain(self, tier: Tier) -> None:
        """Keep the tier's last K committed steps; the committing rank deletes the rest."""
        if not self._commits(tier):
            return
        keep = tier.kept_steps(self.cfg)
        deleted = prune(tier, keep)
        if deleted and self.rank == 0:
            log.info("checkpoint retention (%s): deleted steps %s", tier.name, deleted)

    def _commits(self, tier: Tier) -> bool:
        """Node-local tiers are committed by each node's first rank, shared ones by rank 0."""
        return self.local_rank == 0 if tier.node_local else self.rank == 0

    # ---- restoring ------------------------------------------------------------------------
    def restore(
        self, state: TrainState, newest: bool = False, held: Optional[HeldChunks] = None
    ) -> Optional[Dict[str, Any]]:
        """Load the newest committed checkpoint that verifies (``checkpoint.restore``); the
        time-based save clock restarts from a restore.  ``held``: this rank's own shards,
        copied instead of read when the step loaded is theirs."""
        loaded = self.restorer.restore(state, newest, held)
        if loaded is not None:
            self._last_save_time = time.time()
        return loaded

    def close(self) -> None:
        """Wait for the save in flight; record per-tier retry counts in ``stats``."""
        self.wait()
        self.stats["retries"] = {t.name: t.retries for t in self.tiers}


def _versions() -> Dict[str, str]:
    return {"torch": torch.__version__, "raytrain_ext": __version__}
