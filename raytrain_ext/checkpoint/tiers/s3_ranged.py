"""Restoring from S3 by fetching only what this rank's DCP load plan needs.

Before loading, the rank builds its DCP load plan against the checkpoint's
metadata, which tells exactly which byte ranges of which files it will read.
When those ranges (rounded to the manifest's checksum chunks) are less than
``RANGED_FRACTION`` of the files' bytes, only those chunks are fetched (ranged
GETs, in parallel) and each is verified against its chunk checksum; otherwise
whole files are downloaded (multipart) and verified while DCP loads them
(``VerifiedReader``).  Either way no byte reaches a target before it has been
verified, and a problem is reported (by ``prepare``, or by the reader after the
load), so the caller can fall back to the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Set, Tuple

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from raytrain_ext.checkpoint.manifest import Manifest, checksum_bytes, step_dir_name, verify_dir
from raytrain_ext.checkpoint.reader import (
    METADATA,
    PlannedOnce,
    VerifiedReader,
    map_files,
    size_problem,
)

if TYPE_CHECKING:
    from raytrain_ext.checkpoint.tiers.s3 import S3Tier

RANGED_FRACTION = 0.5


class PlannedS3Fetch:
    """Fetch and verify what one rank's load needs; then serve it to DCP."""

    def __init__(self, tier: S3Tier, step: int, manifest: Manifest, cache: Path, threads: int = 8):
        self.tier, self.step, self.manifest = tier, step, manifest
        self.planner = PlannedOnce()  # plans this rank's load once, for the fetch and the load
        self.directory = cache / step_dir_name(step)
        self.threads = threads
        self.chunks: Dict[Tuple[str, int], bytes] = {}
        self.ranged = False
        self.fetched_bytes = 0
        self.metadata = None
        self.views: Dict[str, memoryview] = {}

    def fetch_metadata(self) -> Optional[str]:
        """Download and verify DCP's ``.metadata``; returns a problem or None."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tier.materialize(self.step, [METADATA], self.directory.parent)
        problem = verify_dir(self.directory, _only(self.manifest, {METADATA}))
        if problem is None:
            self.metadata = dcp.FileSystemReader(self.directory).read_metadata()
        return problem

    def prepare(self, targets: Dict[str, Any], is_coordinator: bool) -> Optional[str]:
        """Fetch and verify this rank's share; returns the first problem, or None."""
        needed = self._needed_chunks(targets, self.metadata, is_coordinator)
        chunk_bytes = sum(self._chunk_len(name, i) for name, i in needed)
        whole = sum(self.manifest.files[name].size for name in {n for n, _ in needed})
        self.ranged = (
            bool(needed)
            and chunk_bytes < RANGED_FRACTION * whole
            and all(self.manifest.files[name].chunk_xxh3 for name, _ in needed)
        )
        if self.ranged:
            return self._fetch_chunks(needed)
        names = sorted({name for name, _ in needed})
        self.tier.materialize(self.step, names, self.directory.parent)
        self.fetched_bytes = whole
        self.views = map_files(self.directory, [METADATA] + names)
        return size_problem(self.views, self.manifest, self.tier.key(self.step))

    def reader(self, threads: int = 4) -> dcp.FileSystemReader:
        """Ranged: DCP's reader over the verified chunks; whole files: a reader that
        verifies them while it loads (check its ``problem`` after ``dcp.load``)."""
        if self.ranged:
            return ChunkReader(self)
        return VerifiedReader(self.views, self.manifest, self.tier.key(self.step), threads)

    def read(self, name: str, offset: int, length: int) -> bytes:
        size = self.manifest.files[name].chunk_size
        first, last = offset // size, (offset + length - 1) // size
        data = b"".join(self.chunks[(name, i)] for i in range(first, last + 1))
        start = offset - first * size
        return data[start : start + length]

    def _needed_chunks(self, targets, metadata, is_coordinator: bool) -> Set[Tuple[str, int]]:
        self.planner.set_up_planner(targets, metadata, is_coordinator)
        needed: Set[Tuple[str, int]] = set()
        for item in self.planner.create_local_plan().items:
            info = metadata.storage_data[item.storage_index]
            size = self.manifest.files[info.relative_path].chunk_size or 1
            first, last = info.offset // size, (info.offset + info.length - 1) // size
            needed.update((info.relative_path, i) for i in range(first, last + 1))
        return needed

    def _chunk_len(self, name: str, index: int) -> int:
        entry = self.manifest.files[name]
        size = entry.chunk_size or entry.size
        return min(size, entry.size - index * size)

    def _fetch_chunks(self, needed: Set[Tuple[str, int]]) -> Optional[str]:
        def fetch(key: Tuple[str, int]) -> Optional[str]:
            name, index = key
            entry = self.manifest.files[name]
            start = index * entry.chunk_size
            data = self.tier.read_range(self.step, name, start, start + self._chunk_len(*key))
            if checksum_bytes(data) != entry.chunk_xxh3[index]:
                return f"{name} bytes {start}-{start + len(data)} fail their checksum (corrupted)"
            self.chunks[key] = data
            return None

        with ThreadPoolExecutor(self.threads) as pool:
            problems = [p for p in pool.map(fetch, sorted(needed)) if p]
        self.fetched_bytes = sum(len(c) for c in self.chunks.values())
        return problems[0] if problems else None


def _only(manifest: Manifest, names: Set[str]) -> Manifest:
    return Manifest(
        step=manifest.step,
        world_size=manifest.world_size,
        tier=manifest.tier,
        files={n: e for n, e in manifest.files.items() if n in names},
    )


class _NoFile(FileSystem):
    """Data files are served from verified chunks, so opening one yields a placeholder."""

    def create_stream(self, path, mode):
        if Path(path).name == METADATA:
            return super().create_stream(path, mode)
        return contextlib.nullcontext(Path(path).name)


class ChunkReader(dcp.FileSystemReader):
    """DCP's file reader, reading each item from the verified chunks in memory."""

    def __init__(self, fetch: PlannedS3Fetch):
        super().__init__(fetch.directory)
        self.fs = _NoFile()
        self.fetch = fetch

    def _slice_file(self, file, sinfo):
        return io.BytesIO(self.fetch.read(sinfo.relative_path, sinfo.offset, sinfo.length))
