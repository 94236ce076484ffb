"""Saving and restoring the whole training state, one instance per rank.

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

Restore: rank 0 lists committed checkpoints (newest first, local before S3 on
a tie), every rank fetches and verifies the files, and the first candidate
that verifies on all ranks is loaded by DCP, resharded onto this world size.

A strategy with its own checkpoint format (DeepSpeed, ``native_checkpoint``)
also writes it in step 1, on the training thread (it is a collective on the
training group); its files join the same manifest (:mod:`.native`).  A restore
at the world size and stage they were saved with loads them through the
engine's own loader; any other restore reshards the DCP files.
"""

from __future__ import annotations

import gc
import logging
import math
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from raytrain_ext.checkpoint import native
from raytrain_ext.checkpoint import state as ckpt_state
from raytrain_ext.checkpoint.fetch import Fetched, fetch_step
from raytrain_ext.checkpoint.manifest import (
    Manifest,
    checksum_file,
    parse_step_dir,
    step_dir_name,
)
from raytrain_ext.checkpoint.phases import MemoryWatch, RestorePhases
from raytrain_ext.checkpoint.ranged import ChunkReader
from raytrain_ext.checkpoint.reader import VerifiedReader
from raytrain_ext.checkpoint.recycle import POOL
from raytrain_ext.checkpoint.resolve import check_step, describe
from raytrain_ext.checkpoint.tier import Tier, prune
from raytrain_ext.checkpoint.tiers import build_tiers, tier_for_location
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

    def on_demand(self) -> None:
        self.flag = max(self.flag, REQUEST_SAVE)

    def preempt(self, grace_s: float) -> None:
        self.flag = REQUEST_EMERGENCY
        self.deadline = time.time() + grace_s

    def vote(self) -> float:
        flag = self.flag
        if flag == REQUEST_SAVE:
            self.flag = REQUEST_NONE
        return flag


class CheckpointMismatch(RuntimeError):
    """The checkpoint does not fit the model being trained."""


class NoUsableCheckpoint(RuntimeError):
    """Committed checkpoints exist, but none verifies."""


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
    ):
        self.cfg = ckpt_cfg
        self.stall_s = stall_s  # chaos: hold saves open between write and commit
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.config_digest = config_digest
        self.tiers: List[Tier] = build_tiers(ckpt_cfg, run_name)
        scratch = Path(tempfile.gettempdir()) / f"raytrain-ext-{run_name}"
        self.staging = Path(ckpt_cfg.dir) if ckpt_cfg.local else scratch / "staging"
        self.cache = scratch / f"cache-rank{rank}"
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ckpt_cfg.timeout_s))
        self._thread: Optional[threading.Thread] = None
        self._buffers: Any = None  # host copy of the last snapshot, reused by the next
        self._last_save_time = time.time()
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
        every = self.cfg.every_seconds
        if self.rank == 0 and every is not None and time.time() - self._last_save_time >= every:
            flag = max(flag, REQUEST_SAVE)
        return flag

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def is_due(self, step: int, request: float, final: bool) -> bool:
        every = self.cfg.every_steps
        return (
            (final and self.cfg.save_final)
            or request >= REQUEST_SAVE
            or (every is not None and step % every == 0)
        )

    def after_step(
        self,
        loop,
        step: int,
        request: float,
        any_busy: bool,
        final: bool,
        deadline: Optional[float] = None,
    ) -> float:
        """Save if due (identically on every rank); returns the training stall in seconds.

        Final and emergency saves are synchronous: they are committed (to every
        tier that fits before ``deadline``) when this returns.
        """
        if not self.is_due(step, request, final):
            return 0.0
        urgent = final or request >= REQUEST_EMERGENCY
        if any_busy and self.cfg.on_busy == "skip" and not urgent:
            self.stats["skipped"] += 1
            if self.rank == 0:
                log.warning(
                    "checkpoint at step %d skipped: the previous save is still "
                    "persisting (checkpoint.on_busy=skip)",
                    step,
                )
            return 0.0
        start = time.perf_counter()
        self.wait()  # the previous snapshot's buffers are free again
        native_files = self._save_native(loop, step)
        snap = ckpt_state.snapshot(ckpt_state.capture(loop), reuse=self._buffers)
        self._buffers = snap
        if torch.cuda.is_available() and loop.ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        stall = time.perf_counter() - start
        self.stats["saves"] += 1
        self.stats["stall_s"] += stall
        self.stats["stalls_s"].append(round(stall, 6))
        self._last_save_time = time.time()
        if self.cfg.async_save and not urgent:
            self._thread = threading.Thread(
                target=self._persist,
                args=(step, snap, None, native_files),
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
            )
        return stall

    def _save_native(self, loop, step: int) -> native.NativeFiles:
        """The strategy's own checkpoint files of this step, moved into its staging dir.

        A failed native save leaves the step with its DCP files only (which any
        restore can load); like a failed persist, it never stops training.
        """
        strategy = loop.strategy
        if not getattr(strategy, "native_checkpoint", False):
            return native.NativeFiles()
        step_dir = self.staging / step_dir_name(step)
        saved_root = native.private_dir(step_dir, self.rank)
        try:
            shutil.rmtree(saved_root, ignore_errors=True)
            strategy.native_save(loop.model, saved_root, step_dir_name(step))
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

    # ---- saving ---------------------------------------------------------------------------
    def _persist(
        self,
        step: int,
        snap: Dict[str, Any],
        deadline: Optional[float] = None,
        native_files: Optional[native.NativeFiles] = None,
    ) -> None:
        try:
            native_files = native_files or native.NativeFiles()
            step_dir = self.staging / step_dir_name(step)
            timing: Dict[str, Any] = {"step": step, "tiers_s": {}}
            mine, entries = self._write(snap, step_dir, timing, native_files.names)
            parts = self._all_gather((entries, bool(native_files.info)))
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
            for index, tier in enumerate(self.tiers):
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
            if not self.cfg.local:
                shutil.rmtree(step_dir, ignore_errors=True)
        except Exception as e:  # never kill training for a failed save; the log says why
            self.stats["failed"].append({"step": step, "error": str(e)})
            log.error("ALARM: checkpoint of step %d failed on rank %d: %s", step, self.rank, e)

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
        dcp.save(snap, storage_writer=writer, process_group=self.group)
        timing["write_s"] = time.perf_counter() - started
        mine, written = sorted(self._own_files(step_dir) + native_names), writer.entries
        entries = {
            name: written.get(name) or checksum_file(step_dir / name, chunk) for name in mine
        }
        timing["checksum_s"] = time.perf_counter() - started - timing["write_s"]
        return mine, entries

    def _all_gather(self, value: Any) -> List[Any]:
        """Every rank's ``value``, in rank order, over the checkpoint group."""
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def _agree_past(self, deadline: Optional[float]) -> bool:
        """True on every rank when any rank is past ``deadline`` (one all-gather)."""
        if deadline is None:
            return False
        return any(self._all_gather(time.time() > deadline))

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
        errors = [e for e in self._all_gather(error) if e]
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
        keep = self.cfg.keep_in_memory if tier.name == "memory" else self.cfg.keep_last
        deleted = prune(tier, keep)
        if deleted and self.rank == 0:
            log.info("checkpoint retention (%s): deleted steps %s", tier.name, deleted)

    def _commits(self, tier: Tier) -> bool:
        """Node-local tiers are committed by each node's first rank, shared ones by rank 0."""
        return self.local_rank == 0 if tier.name == "local" else self.rank == 0

    # ---- restoring ------------------------------------------------------------------------
    def restore(self, loop, newest: bool = False) -> Optional[Dict[str, Any]]:
        """Load the newest committed checkpoint that verifies; None when there is none.

        ``newest`` ignores ``checkpoint.resume`` (a NaN rollback goes back to this
        run's newest checkpoint even when the run started from an explicit one).
        """
        if self.cfg.resume == "never" and not newest:
            return None
        started = time.perf_counter()
        with collection_paused(), MemoryWatch() as memory:
            loaded = self._restore(loop, newest)
        if loaded is not None:
            loaded["total_s"] = time.perf_counter() - started
            loaded["memory"] = memory.record(loaded.pop("state_bytes"))
            if self.rank == 0:
                log.info(
                    "restored step %d from %s (%s), saved by %d workers, into %d workers in %.2f s",
                    loaded["step"],
                    loaded["tier"],
                    loaded["path"],
                    loaded["saved_world_size"],
                    self.world_size,
                    loaded["total_s"],
                )
        return loaded

    def _restore(self, loop, newest: bool) -> Optional[Dict[str, Any]]:
        phases = RestorePhases()
        with phases.time("plan"):
            plan: List[Any] = [self._plan(newest) if self.rank == 0 else None]
            dist.broadcast_object_list(plan, src=0, group=self.group)
        location, candidates = plan[0]
        tiers = [tier_for_location(self.cfg, location)] if location else self.tiers
        problems_seen: List[str] = []
        for step, index in candidates:
            loaded = self._try_load(loop, tiers[index], step, problems_seen, phases)
            if loaded is not None:
                loaded["skipped"] = problems_seen
                loaded["phases"] = phases.as_dict()
                return loaded
        if problems_seen:
            raise NoUsableCheckpoint(
                "no committed checkpoint verifies:\n  "
                + "\n  ".join(problems_seen)
                + "\nRepair or delete them, point checkpoint.resume at a good one, or set "
                "checkpoint.resume=never to start over."
            )
        return None

    def _plan(self, newest: bool = False) -> Tuple[Optional[str], List[Tuple[int, int]]]:
        """(explicit location or None, [(step, tier index)] newest first, faster tier first)."""
        if self.cfg.resume != "auto" and not newest:
            location, step = split_location(self.cfg.resume)
            return location, [(step, 0)]
        found = [
            (step, index)
            for index, tier in enumerate(self.tiers)
            for step in tier.committed_steps()
        ]
        return None, sorted(found, key=lambda c: (-c[0], c[1]))

    def _try_load(
        self, loop, tier: Tier, step: int, problems_seen: List[str], phases: RestorePhases
    ):
        started = time.perf_counter()
        with phases.time("plan"):
            check = check_step(tier, step)  # the same reading as ckpt export and report
        manifest, problem = check.manifest, check.problem
        fetched, targets, use_native = Fetched(None), None, False
        if manifest is not None:
            with phases.time("targets"):
                targets = ckpt_state.load_targets(loop, manifest.world_size)
            use_native = self._native_loadable(loop, manifest)
            try:
                fetched = fetch_step(
                    tier,
                    step,
                    manifest,
                    targets,
                    phases,
                    self.cache,
                    self.rank == 0,
                    self._check_shapes,
                    self.cfg.read_threads,
                    whole=use_native,
                )
                problem = fetched.problem
            except CheckpointMismatch:
                raise
            except Exception as e:
                problem = f"cannot fetch: {e}"
        if self._unusable(_of_step(tier, step, problem), problems_seen):
            return None
        fetched_s = time.perf_counter() - started
        start = time.perf_counter()
        if use_native:  # model and optimizer come from the strategy's own files
            targets = ckpt_state.without_model(targets)
        with phases.time("read"):  # VerifiedReader checks each chunk as it loads it
            dcp.load(targets, storage_reader=fetched.reader, process_group=self.group)
        late = fetched.reader.problem if isinstance(fetched.reader, VerifiedReader) else None
        if self._unusable(_of_step(tier, step, late), problems_seen):
            return None
        info = self._install(loop, manifest, fetched.reader, targets, tier.name, phases, use_native)
        info["state_bytes"] = 0 if use_native else ckpt_state.tensor_bytes(targets)
        info["fetch_verify_s"] = fetched_s
        info["seconds"] = time.perf_counter() - start
        return info

    def _unusable(self, problem: Optional[str], problems_seen: List[str]) -> bool:
        """Whether any rank found a problem (one all-gather); the first is recorded."""
        problems = [p for p in self._all_gather(problem) if p]
        if problems:
            problems_seen.append(problems[0])
            if self.rank == 0:
                log.warning(
                    "checkpoint %s is unusable; falling back to the previous committed checkpoint",
                    problems[0],
                )
        return bool(problems)

    def _native_loadable(self, loop, manifest: Manifest) -> bool:
        """Whether the strategy's own loader can take this checkpoint: it holds native
        files of the same format and stage, saved at this world size (same on every rank)."""
        strategy = loop.strategy
        if not (manifest.native and getattr(strategy, "native_checkpoint", False)):
            return False
        wanted = strategy.native_info()
        return manifest.world_size == self.world_size and all(
            manifest.native.get(key) == value for key, value in wanted.items()
        )

    @staticmethod
    def _check_shapes(metadata, targets: Dict[str, Any], where: str) -> None:
        mismatches = ckpt_state.shape_mismatches(metadata, targets)
        if mismatches:
            raise CheckpointMismatch(
                f"checkpoint {where} was saved from a different model:\n  "
                + "\n  ".join(mismatches[:20])
                + "\nResume with the model config it was saved "
                "with (model.*), or use a new run.name / checkpoint.dir."
            )

    def _install(
        self,
        loop,
        manifest: Manifest,
        reader,
        targets: Dict[str, Any],
        tier_name: str,
        phases: RestorePhases,
        use_native: bool,
    ) -> Dict[str, Any]:
        """Install what DCP loaded (and a native load's model and optimizer)."""
        if use_native:
            with phases.time("model"):
                self._load_native(loop, manifest, Path(reader.path))
        else:
            ckpt_state.apply_model_and_optim(loop, targets, phases)
        with phases.time("train"):
            items = ckpt_state.apply_train(loop, targets)
        self._last_save_time = time.time()
        info = {
            "step": items["step"],
            "tier": tier_name,
            "path": str(reader.path),
            "saved_world_size": manifest.world_size,
            "ranged": isinstance(reader, ChunkReader),
            "native": use_native,
        }
        return info

    def _load_native(self, loop, manifest: Manifest, directory: Path) -> None:
        names = [name for name in manifest.files if native.is_native(name)]
        tree = native.rebuild(directory, names, self.cache / f"native-{manifest.step}")
        loop.strategy.native_load(loop.model, tree, manifest.native["tag"])

    def close(self) -> None:
        """Wait for the save in flight; record per-tier retry counts in ``stats``."""
        self.wait()
        self.stats["retries"] = {t.name: getattr(t, "retries", 0) for t in self.tiers}


def _of_step(tier: Tier, step: int, problem: Optional[str]) -> Optional[str]:
    """``problem`` prefixed with the step it belongs to, unless it names it already (a
    manifest problem from ``check_step`` does)."""
    if problem is None or problem.startswith(describe(tier, step)):
        return problem
    return f"{describe(tier, step)}: {problem}"


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the length of a restore.

    Why: a restore allocates tens of thousands of small, acyclic objects (DCP's metadata
    and plans); in a worker that tracks ~430k objects, the full collections they
    triggered took 0.22-0.29 s of a 0.6 s restore of 292 MB here.  Reference counting
    still frees everything; the collector runs again afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def split_location(location: str) -> Tuple[str, int]:
    """``.../step-<N>`` -> (parent location, N)."""
    parent, _, leaf = location.rstrip("/").rpartition("/")
    step = parse_step_dir(leaf)
    if step is None:
        raise ValueError(
            f"checkpoint.resume: {location!r} does not end in step-<N>; give "
            "auto, never, or the path/URI of one step-<N> directory"
        )
    return parent, step


def _versions() -> Dict[str, str]:
    return {"torch": torch.__version__, "raytrain_ext": __version__}
