"""Pretrained weights checked on the driver: a damaged ``.safetensors`` file is named
before Ray starts, instead of a worker failing with ``SafetensorError: Error while
deserializing header`` and no file name.

Only each file's header is read (8 bytes of length, then that much JSON): cheap for any
model size.  A file is damaged when its header cannot be read or parsed, or when a
tensor's data ends past the end of the file (a truncated download or copy); an index
(``model.safetensors.index.json``) that names a missing file is damaged too.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import List, Optional

from raytrain_ext.errors import ConfigError

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header


def check_safetensors(directory: Path) -> None:
    """Raise :class:`ConfigError` naming ``model.hf.path``, the file and what is wrong."""
    files = sorted(directory.glob("*.safetensors"))
    for name in _indexed_files(directory):
        if not (directory / name).is_file():
            _damaged(directory / INDEX, f"it names {name}, which is missing")
    for path in files:
        problem = header_problem(path)
        if problem is not None:
            _damaged(path, problem)


def header_problem(path: Path) -> Optional[str]:
    """What is wrong with one file's header, or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"it has {size} bytes, fewer than the 8 of a header's length"
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            return f"its header claims {length} bytes but the file has {size}"
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        return "its header is not JSON"
    data_size = size - 8 - length
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        end = entry.get("data_offsets", [0, 0])[1] if isinstance(entry, dict) else 0
        if end > data_size:
            return (
                f"truncated: tensor {key!r} ends at data byte {end} but the file holds "
                f"{data_size} bytes of data"
            )
    return None


def _indexed_files(directory: Path) -> List[str]:
    index = directory / INDEX
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError):
        _damaged(index, "it is not JSON with a weight_map")
    return sorted(set(weight_map.values()))


def _damaged(path: Path, problem: str) -> None:
    raise ConfigError(
        f"model.hf.path: {path} is damaged ({problem}). Download or copy it again, or set "
        "model.hf.pretrained=false to start from a random initialisation."
    )
