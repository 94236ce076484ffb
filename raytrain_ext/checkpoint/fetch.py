"""Bringing one committed step within reach of this rank's DCP load, tier by tier.

Each tier hands over only what this rank's load plan reads (plus DCP's ``.metadata``):
- local disk: the files themselves, mapped (nothing is read before the load);
- memory: the holders' buffers, this node's copy first (zero-copy when held here);
- S3: the byte ranges the plan needs when they are under half the files (verified as
  they arrive, see :mod:`.ranged`), else whole files downloaded into the cache, mapped.
The data files' checksums are verified during the load (:class:`.reader.VerifiedReader`);
sizes and ``.metadata`` before it, so a shape mismatch or a missing file is reported
before any target changes.  A strategy's native files (``whole``) are read whole by the
engine's own loader, so they are materialised and verified whole, before the load.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch.distributed.checkpoint as dcp

from raytrain_ext.checkpoint.manifest import Manifest, step_dir_name, verify_dir
from raytrain_ext.checkpoint.memory import MemoryTier
from raytrain_ext.checkpoint.phases import RestorePhases
from raytrain_ext.checkpoint.ranged import PlannedS3Fetch
from raytrain_ext.checkpoint.reader import (
    METADATA,
    VerifiedReader,
    map_files,
    plan_files,
    size_problem,
    whole_file_problem,
)
from raytrain_ext.checkpoint.s3 import S3Tier
from raytrain_ext.checkpoint.tier import Tier

ShapeCheck = Callable[[Any, Dict[str, Any], str], None]  # (metadata, targets, where): raises


@dataclass
class Fetched:
    """A reader for DCP, or the problem that makes this step unusable on this rank."""

    reader: Optional[dcp.FileSystemReader]
    problem: Optional[str] = None


def fetch_step(
    tier: Tier,
    step: int,
    manifest: Manifest,
    targets: Dict[str, Any],
    phases: RestorePhases,
    cache: Path,
    is_coordinator: bool,
    check_shapes: ShapeCheck,
    read_threads: int,
    whole: bool = False,
) -> Fetched:
    """Fetch what this rank's load of ``step`` needs from ``tier`` (see the module doc)."""
    if whole:
        return _fetch_whole(tier, step, manifest, targets, phases, cache, check_shapes)
    if isinstance(tier, S3Tier):
        return _fetch_s3(
            tier, step, manifest, targets, phases, cache, is_coordinator, check_shapes, read_threads
        )
    if isinstance(tier, MemoryTier):
        where = f"memory://{tier.run}/{step_dir_name(step)}"

        def read(names: List[str]) -> Dict[str, memoryview]:
            with phases.time("fetch"):
                return tier.read_files(step, names)
    else:
        directory = tier.materialize(step, [], cache)
        where = str(directory)

        def read(names: List[str]) -> Dict[str, memoryview]:
            return map_files(directory, names)

    return _fetch_planned(
        read, manifest, targets, where, phases, is_coordinator, check_shapes, read_threads
    )


def _fetch_planned(
    read: Callable[[List[str]], Dict[str, memoryview]],
    manifest: Manifest,
    targets: Dict[str, Any],
    where: str,
    phases: RestorePhases,
    is_coordinator: bool,
    check_shapes: ShapeCheck,
    read_threads: int,
) -> Fetched:
    missing = _unlisted(manifest, where)
    if missing:
        return Fetched(None, missing)
    try:
        views = read([METADATA])
    except FileNotFoundError as e:
        return Fetched(None, f"{where}/{METADATA} is missing ({e})")
    with phases.time("verify"):
        problem = size_problem(views, manifest, where) or whole_file_problem(
            views[METADATA], manifest.files[METADATA], f"{where}/{METADATA}"
        )
    if problem:
        return Fetched(None, problem)
    metadata = pickle.loads(views[METADATA])
    check_shapes(metadata, targets, where)
    with phases.time("plan"):
        names = plan_files(targets, metadata, is_coordinator)
    unknown = [name for name in names if name not in manifest.files]
    if unknown:
        return Fetched(None, f"{where}/{unknown[0]} is read by the load but not in the manifest")
    try:
        views.update(read(names))
    except FileNotFoundError as e:
        return Fetched(None, f"{where}: {e}")
    return Fetched(
        VerifiedReader(views, manifest, where, read_threads), size_problem(views, manifest, where)
    )


def _unlisted(manifest: Manifest, where: str) -> Optional[str]:
    if METADATA not in manifest.files:
        return f"{where}: the manifest lists no {METADATA}"
    return None


def _fetch_s3(
    tier: S3Tier,
    step: int,
    manifest: Manifest,
    targets: Dict[str, Any],
    phases: RestorePhases,
    cache: Path,
    is_coordinator: bool,
    check_shapes: ShapeCheck,
    read_threads: int,
) -> Fetched:
    fetch = PlannedS3Fetch(tier, step, manifest, cache, tier.max_concurrency)
    with phases.time("fetch"):  # each ranged chunk is verified as it arrives
        problem = fetch.fetch_metadata()
        if problem is None:
            check_shapes(fetch.metadata, targets, tier.key(step))
            problem = fetch.prepare(targets, is_coordinator)
    return Fetched(fetch.reader(read_threads), problem)


def _fetch_whole(
    tier: Tier,
    step: int,
    manifest: Manifest,
    targets: Dict[str, Any],
    phases: RestorePhases,
    cache: Path,
    check_shapes: ShapeCheck,
) -> Fetched:
    with phases.time("fetch"):
        directory = tier.materialize(step, sorted(manifest.files), cache)
    with phases.time("verify"):
        problem = verify_dir(directory, manifest)
    reader = dcp.FileSystemReader(directory)
    if problem is None:
        check_shapes(reader.read_metadata(), targets, str(directory))
    return Fetched(reader, problem)
