"""DCP loading from checkpoint files held in memory: a restore from the memory tier.

Why: writing the fetched files to a cache directory, hashing them there and
reading them back cost more than the fetch itself (the memory tier restored
slower than local disk).  Here each file stays the array ``ray.get`` returned
(a zero-copy view of the node's object store when it is held there), is
verified in memory against the manifest, and DCP reads every item from it.

Invariant: a ``BufferReader`` is only built over buffers that ``verify_buffers``
passed, so every byte DCP reads matches the committed checksum.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Dict, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from raytrain_ext.checkpoint.manifest import Manifest, checksum_bytes

METADATA = ".metadata"


def verify_buffers(buffers: Dict[str, memoryview], manifest: Manifest,
                   where: str) -> Optional[str]:
    """Check every listed file's size and checksum; the first problem, or None."""
    for name, entry in sorted(manifest.files.items()):
        data = buffers.get(name)
        if data is None:
            return f"{where}/{name} is missing"
        if data.nbytes != entry.size:
            return (f"{where}/{name} has {data.nbytes} bytes, the manifest says {entry.size} "
                    "(truncated?)")
        actual = checksum_bytes(data)
        if actual != entry.xxh3_128:
            return f"{where}/{name} checksum {actual} != manifest {entry.xxh3_128} (corrupted)"
    return None


class _Buffers(FileSystem):
    """Opening a file yields its name; ``.metadata`` is unpickled from its buffer."""

    def __init__(self, buffers: Dict[str, memoryview]):
        super().__init__()
        self.buffers = buffers

    def create_stream(self, path, mode):
        name = Path(path).name
        if mode != "rb":
            raise io.UnsupportedOperation(f"memory checkpoint files are read-only ({name})")
        if name == METADATA:
            return contextlib.nullcontext(io.BytesIO(self.buffers[name]))
        return contextlib.nullcontext(name)


class BufferReader(dcp.FileSystemReader):
    """DCP's file reader over verified in-memory files (``path`` only names them)."""

    def __init__(self, buffers: Dict[str, memoryview], path: str):
        super().__init__(path)
        self.fs = _Buffers(buffers)
        self.buffers = buffers

    def _slice_file(self, file, sinfo):
        view = self.buffers[sinfo.relative_path]
        return io.BytesIO(view[sinfo.offset:sinfo.offset + sinfo.length])
