"""The commit record of a checkpoint: ``step-<N>/manifest.json``, written last.

Invariants: a checkpoint without a readable manifest does not exist for the
loader; the manifest lists every file of the checkpoint with its size and
xxh3-128 checksum, so a truncated or corrupted file is detected before DCP
reads it.  Manifests are written atomically (temporary name, then rename or a
single PUT).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import xxhash

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d+)$")
CHUNK = 8 * 1024 * 1024


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> Optional[int]:
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass
class FileEntry:
    """Size and checksum of a file, plus one checksum per ``CHUNK`` bytes.

    The chunk checksums let a loader fetch and verify only the byte ranges it
    needs (ranged reads from S3) without giving up corruption detection.
    """

    size: int
    xxh3_128: str
    chunk_xxh3: List[str] = field(default_factory=list)
    chunk_size: int = 0


@dataclass
class Manifest:
    step: int
    world_size: int
    tier: str
    files: Dict[str, FileEntry]
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    config_digest: str = ""
    versions: Dict[str, str] = field(default_factory=dict)
    native: Dict[str, Any] = field(default_factory=dict)  # a strategy's own files: format, tag

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        data["files"] = {k: FileEntry(**v) for k, v in data["files"].items()}
        return cls(**data)

    def for_tier(self, tier: str) -> "Manifest":
        return Manifest(
            **{**asdict(self), "tier": tier, "files": dict(self.files), "created_at": time.time()}
        )


def checksum_bytes(data) -> str:
    return xxhash.xxh3_128(data).hexdigest()


class FileHasher:
    """Whole-file and per-chunk checksums of bytes fed in order, as they are written.

    Feeding a file's bytes in any split gives the same ``FileEntry`` as
    ``checksum_file`` on the finished file, so a writer can checksum what it
    writes instead of reading the file back (one pass over the data, not two).
    """

    def __init__(self, chunk_size: int = CHUNK):
        if chunk_size <= 0:
            raise ValueError(
                f"checkpoint.checksum_chunk_kb must be positive, got "
                f"{chunk_size} bytes; set it to e.g. 8192"
            )
        self.chunk_size = chunk_size
        self.size = 0
        self._whole = xxhash.xxh3_128()
        self._chunk = xxhash.xxh3_128()
        self._chunk_fill = 0
        self._chunks: List[str] = []

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self._whole.update(view)
        self.size += len(view)
        while len(view):
            take = min(len(view), self.chunk_size - self._chunk_fill)
            self._chunk.update(view[:take])
            self._chunk_fill += take
            view = view[take:]
            if self._chunk_fill == self.chunk_size:
                self._chunks.append(self._chunk.hexdigest())
                self._chunk.reset()
                self._chunk_fill = 0

    def entry(self) -> FileEntry:
        chunks = self._chunks + ([self._chunk.hexdigest()] if self._chunk_fill else [])
        return FileEntry(
            size=self.size,
            xxh3_128=self._whole.hexdigest(),
            chunk_xxh3=chunks,
            chunk_size=self.chunk_size,
        )


def checksum_file(path: Path, chunk_size: int = CHUNK) -> FileEntry:
    """Whole-file and per-chunk checksums in one pass over the file."""
    hasher = FileHasher(chunk_size)
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            hasher.update(chunk)
    return hasher.entry()


def verify_dir(directory: Path, manifest: Manifest) -> Optional[str]:
    """Check every listed file; return a description of the first problem, or None."""
    for name, entry in sorted(manifest.files.items()):
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        actual = checksum_file(path)
        if actual.size != entry.size:
            return f"{path} has {actual.size} bytes, the manifest says {entry.size} (truncated?)"
        if actual.xxh3_128 != entry.xxh3_128:
            return f"{path} checksum {actual.xxh3_128} != manifest {entry.xxh3_128} (corrupted)"
    return None
