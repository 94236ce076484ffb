"""Restoring a checkpoint: which committed step, fetched from which tier, loaded how.

The restore half of the checkpoint manager (the save half stays in :mod:`.manager`).
Rank 0 lists the committed steps (newest first; memory, local, S3 on ties) and
broadcasts the plan.  For each candidate every rank reads the manifest, builds its load
targets, fetches what its DCP load plan reads (:mod:`.fetch`) and loads it through
:class:`.reader.VerifiedReader`; the ranks agree on any problem after the fetch and
again after the load, and fall back to the previous step together.  A restore at the
world size and stage a strategy's native files were saved with loads them through the
engine's own loader instead.

Invariant: either every rank installs the same step, or none installs anything and the
restore raises (``NoUsableCheckpoint``) or returns None (no checkpoint at all).
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner

from raytrain_ext.checkpoint import native
from raytrain_ext.checkpoint import state as ckpt_state
from raytrain_ext.checkpoint.agreement import gather_from_all
from raytrain_ext.checkpoint.fetch import Fetched, StepLoad, fetch_step
from raytrain_ext.checkpoint.held_chunks import HeldChunks
from raytrain_ext.checkpoint.manifest import Manifest, parse_step_dir
from raytrain_ext.checkpoint.phases import MemoryWatch, RestorePhases
from raytrain_ext.checkpoint.reader import VerifiedReader
from raytrain_ext.checkpoint.resolve import check_step, describe
from raytrain_ext.checkpoint.tiers import tier_for_location
from raytrain_ext.checkpoint.tiers.base import Tier
from raytrain_ext.checkpoint.tiers.s3_ranged import ChunkReader
from raytrain_ext.checkpoint.train_state import TrainState
from raytrain_ext.collector import collection_paused

log = logging.getLogger(__name__)


class CheckpointMismatch(RuntimeError):
    """The checkpoint does not fit the model being trained."""


class NoUsableCheckpoint(RuntimeError):
    """Committed checkpoints exist, but none verifies."""


class Restorer:
    """Loads checkpoints for one rank over the checkpoint group (every method is collective)."""

    def __init__(self, ckpt_cfg, tiers: List[Tier], rank: int, world_size: int, group, cache: Path):
        self.cfg, self.tiers, self.group, self.cache = ckpt_cfg, tiers, group, cache
        self.rank, self.world_size = rank, world_size

    def restore(
        self, state: TrainState, newest: bool = False, held: Optional[HeldChunks] = None
    ) -> Optional[Dict[str, Any]]:
        """Load the newest committed checkpoint that verifies; None when there is none.

        ``newest`` ignores ``checkpoint.resume`` (a NaN rollback goes back to this
        run's newest checkpoint even when the run started from an explicit one).
        ``held``: this rank's own shards of a step; a candidate of that step copies them
        from memory and reads the rest (:mod:`.held_chunks`).
        """
        if self.cfg.resume == "never" and not newest:
            return None
        started = time.perf_counter()
        with collection_paused(), MemoryWatch() as memory:
            loaded = self._restore(state, newest, held)
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

    def _restore(
        self, state: TrainState, newest: bool, held: Optional[HeldChunks]
    ) -> Optional[Dict[str, Any]]:
        phases = RestorePhases()
        with phases.time("plan"):
            plan: List[Any] = [self._plan(newest) if self.rank == 0 else None]
            dist.broadcast_object_list(plan, src=0, group=self.group)
        location, candidates = plan[0]
        tiers = [tier_for_location(self.cfg, location)] if location else self.tiers
        problems_seen: List[str] = []
        for step, index in candidates:
            own = held if held is not None and held.usable_for(step, state.config_digest) else None
            loaded = self._try_load(state, tiers[index], step, problems_seen, phases, own)
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
        self,
        state: TrainState,
        tier: Tier,
        step: int,
        problems_seen: List[str],
        phases: RestorePhases,
        held: Optional[HeldChunks] = None,
    ):
        started = time.perf_counter()
        with phases.time("plan"):
            check = check_step(tier, step)  # the same reading as ckpt export and report
        manifest, problem = check.manifest, check.problem
        fetched, targets, use_native = Fetched(None), None, False
        if manifest is not None:
            with phases.time("targets"):
                targets = ckpt_state.load_targets(state, manifest.world_size)
            use_native = self._native_loadable(state, manifest)
            try:
                load = StepLoad(
                    step,
                    manifest,
                    targets,
                    phases,
                    self.cache,
                    self.rank == 0,
                    self._check_shapes,
                    self.cfg.read_threads,
                    held,
                )
                fetched = fetch_step(tier, load, whole=use_native)
                problem = fetched.problem
            except CheckpointMismatch:
                raise
            except Exception as e:
                problem = f"cannot fetch: {e}"
        with phases.time("agree"):
            unusable = self._unusable(_of_step(tier, step, problem), problems_seen)
        if unusable:
            return None
        if manifest is None or targets is None:  # a step without one is unusable just above
            raise RuntimeError(f"checkpoint step {step}: usable without a manifest")
        fetched_s = time.perf_counter() - started
        start = time.perf_counter()
        if use_native:  # model and optimizer come from the strategy's own files
            targets = ckpt_state.without_model(targets)
        with phases.time("read"):  # VerifiedReader checks each chunk as it loads it
            late = load_planned(targets, fetched.reader, fetched.planner)
        with phases.time("agree"):
            unusable = self._unusable(_of_step(tier, step, late), problems_seen)
        if unusable:
            return None
        info = self._install(
            state, manifest, fetched.reader, targets, tier.name, phases, use_native
        )
        info["state_bytes"] = 0 if use_native else ckpt_state.tensor_bytes(targets)
        info["fetch_verify_s"] = fetched_s
        if isinstance(fetched.reader, VerifiedReader):  # bytes from the medium, from memory
            info["read_bytes"] = fetched.reader.read_bytes
            info["held_bytes"] = fetched.reader.held_bytes
        info["seconds"] = time.perf_counter() - start
        return info

    def _unusable(self, problem: Optional[str], problems_seen: List[str]) -> bool:
        """Whether any rank found a problem (one all-gather); the first is recorded."""
        problems = [p for p in gather_from_all(problem, self.group) if p]
        if problems:
            problems_seen.append(problems[0])
            if self.rank == 0:
                log.warning(
                    "checkpoint %s is unusable; falling back to the previous committed checkpoint",
                    problems[0],
                )
        return bool(problems)

    def _native_loadable(self, state: TrainState, manifest: Manifest) -> bool:
        """Whether the strategy's own loader can take this checkpoint: it holds native
        files of the same format and stage, saved at this world size (same on every rank)."""
        strategy = state.strategy
        if not (manifest.native and strategy.native_checkpoint):
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
        state: TrainState,
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
                self._load_native(state, manifest, Path(reader.path))
        else:
            ckpt_state.apply_model_and_optim(state, targets, phases)
        with phases.time("train"):
            items = ckpt_state.apply_train(state, targets)
        info = {
            "step": items["step"],
            "tier": tier_name,
            "path": str(reader.path),
            "saved_world_size": manifest.world_size,
            "ranged": isinstance(reader, ChunkReader),
            "native": use_native,
        }
        return info

    def _load_native(self, state: TrainState, manifest: Manifest, directory: Path) -> None:
        names = [name for name in manifest.files if native.is_native(name)]
        tree = native.rebuild(directory, names, self.cache / f"native-{manifest.step}")
        state.strategy.native_load(state.model, tree, manifest.native["tag"])


def load_planned(
    targets: Dict[str, Any], reader, planner: Optional[LoadPlanner] = None
) -> Optional[str]:
    """Load ``targets`` through ``reader`` on this rank alone; the problem, or None.
    ``planner``: the one that planned this load while fetching (DCP's default if None).

    Why alone: DCP's coordinated load gathers every rank's plan and gathers again after
    the reads, two collectives that only re-check what this rank planned (a load plan
    reads each rank's own targets; DCP's global load plan changes nothing).  The ranks
    agree on the outcome afterwards instead (``Restorer._unusable``), so a rank that
    fails here reports it rather than raising alone while its peers wait.
    """
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(targets, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's wrapper is a BaseException
        return f"cannot load: {e}"
    return reader.problem if isinstance(reader, VerifiedReader) else None


def _of_step(tier: Tier, step: int, problem: Optional[str]) -> Optional[str]:
    """``problem`` prefixed with the step it belongs to, unless it names it already (a
    manifest problem from ``check_step`` does)."""
    if problem is None or problem.startswith(describe(tier, step)):
        return problem
    return f"{describe(tier, step)}: {problem}"


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
