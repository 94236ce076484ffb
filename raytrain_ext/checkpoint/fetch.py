"""Bringing one committed step within reach of this rank's DCP load, tier by tier.

Each tier hands over only what this rank's load plan reads (plus DCP's ``.metadata``), by
the ``Tier.fetch_mode`` it declares:
- directory (local disk): the files themselves, mapped (nothing is read before the load);
- views (memory): the holders' buffers, this node's copy first (zero-copy when held here);
- ranged (S3): the byte ranges the plan needs when they are under half the files (verified as
  they arrive, see :mod:`.ranged`), else whole files downloaded into the cache, mapped.
The data files' checksums are verified during the load (:class:`.reader.VerifiedReader`);
sizes and ``.metadata`` before it, so a shape mismatch or a missing file is reported
before any target changes.  A strategy's native files (``whole``) are read whole by the
engine's own loader, so they are materialised and verified whole, before the load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlanner

from raytrain_ext.checkpoint.held_chunks import HeldChunks
from raytrain_ext.checkpoint.manifest import Manifest, verify_dir
from raytrain_ext.checkpoint.phases import RestorePhases
from raytrain_ext.checkpoint.reader import (
    METADATA,
    PlannedOnce,
    VerifiedReader,
    map_files,
    plan_files,
)
from raytrain_ext.checkpoint.tiers.base import FetchMode, Tier

ShapeCheck = Callable[[Any, Dict[str, Any], str], None]  # (metadata, targets, where): raises
ReadViews = Callable[[List[str]], Dict[str, memoryview]]  # file names -> their bytes


@dataclass
class Fetched:
    """A reader for DCP, or the problem that makes this step unusable on this rank."""

    reader: Optional[dcp.FileSystemReader]
    problem: Optional[str] = None
    planner: Optional[LoadPlanner] = None  # the plan made while fetching, for the load


@dataclass
class StepLoad:
    """One rank's load of one committed step: what the fetch of every tier needs."""

    step: int
    manifest: Manifest
    targets: Dict[str, Any]  # the state dict DCP loads into (checkpoint/state.load_targets)
    phases: RestorePhases
    cache: Path  # this rank's scratch directory for downloaded or materialised files
    is_coordinator: bool  # rank 0 (DCP's planner plans the replicated items there)
    check_shapes: ShapeCheck
    read_threads: int
    held: Optional[HeldChunks] = None  # this rank's own chunks of ``step``, not read


def fetch_step(tier: Tier, load: StepLoad, whole: bool = False) -> Fetched:
    """Fetch what this rank's ``load`` needs from ``tier``, the way it declares (module doc)."""
    if whole:
        return _fetch_whole(tier, load)
    if tier.fetch_mode is FetchMode.ranged:
        return _fetch_ranged(tier, load)
    if tier.fetch_mode is FetchMode.views:

        def read(names: List[str]) -> Dict[str, memoryview]:
            with load.phases.time("fetch"):
                return tier.read_files(load.step, names)

        return _fetch_planned(read, load, tier.location(load.step))
    directory = tier.materialize(load.step, [], load.cache)
    return _fetch_planned(lambda names: map_files(directory, names), load, str(directory))


def _fetch_planned(read: ReadViews, load: StepLoad, where: str) -> Fetched:
    """Metadata first (verified, shapes checked), then the files this rank's plan reads."""
    manifest = load.manifest
    if METADATA not in manifest.files:
        return Fetched(None, f"{where}: the manifest lists no {METADATA}")
    try:
        reader = VerifiedReader(
            read([METADATA]), manifest, where, load.read_threads, held=load.held
        )
    except FileNotFoundError as e:
        return Fetched(None, f"{where}/{METADATA} is missing ({e})")
    with load.phases.time("verify"):
        problem = reader.problem_before_load()
    if problem:
        return Fetched(None, problem)
    metadata = reader.read_metadata()
    load.check_shapes(metadata, load.targets, where)
    planner = PlannedOnce()
    with load.phases.time("plan"):
        names = plan_files(planner, load.targets, metadata, load.is_coordinator, load.held)
    unknown = [name for name in names if name not in manifest.files]
    if unknown:
        return Fetched(None, f"{where}/{unknown[0]} is read by the load but not in the manifest")
    try:
        reader.add_views(read(names))
    except FileNotFoundError as e:
        return Fetched(None, f"{where}: {e}")
    return Fetched(reader, reader.problem_before_load(), planner)


def _fetch_ranged(tier: Tier, load: StepLoad) -> Fetched:
    fetch = tier.ranged_fetch(load.step, load.manifest, load.cache)
    with load.phases.time("fetch"):  # each ranged chunk is verified as it arrives
        problem = fetch.fetch_metadata()
        if problem is None:
            load.check_shapes(fetch.metadata, load.targets, tier.location(load.step))
            problem = fetch.prepare(load.targets, load.is_coordinator)
    return Fetched(fetch.reader(load.read_threads), problem, fetch.planner)


def _fetch_whole(tier: Tier, load: StepLoad) -> Fetched:
    with load.phases.time("fetch"):
        directory = tier.materialize(load.step, sorted(load.manifest.files), load.cache)
    with load.phases.time("verify"):
        problem = verify_dir(directory, load.manifest)
    reader = dcp.FileSystemReader(directory)
    if problem is None:
        load.check_shapes(reader.read_metadata(), load.targets, str(directory))
    return Fetched(reader, problem)
