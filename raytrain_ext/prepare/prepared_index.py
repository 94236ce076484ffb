"""The index of a prepared dataset directory: what ``data prepare`` wrote and with what.

A prepared directory holds ``index.json`` and shard files ``shard-00000.arrow``,
``shard-00001.arrow``, ... (uncompressed Arrow IPC, memory-mappable).  The
shards in index order are the dataset: record ``r`` of the source lands in
shard ``r // records_per_shard``, so the layout depends only on the source,
the tokenizer and ``records_per_shard``, never on how many workers prepared it.

Shard columns by ``format``:
- ``text``: ``tokens`` (int32), every document's ids followed by the EOS id, one
  flat stream (the training side cuts it into ``seq_len + 1`` windows);
- ``chat``: one row per example: ``tokens`` (list<int32>) and ``loss_mask``
  (list<int8>, 1 on response tokens: the target at position ``t`` predicts
  ``tokens[t + 1]`` and counts with weight ``loss_mask[t + 1]``);
- ``preference``: one row per record: ``chosen``, ``rejected`` (list<int32>, prompt
  then response, EOS last) and ``chosen_mask``, ``rejected_mask`` (list<int8>, 1 on
  response tokens, same alignment as ``loss_mask``).

``index.json`` is written last (atomically), so a directory without it is an
unfinished preparation, and it holds no timestamps or worker counts: two
preparations of the same input with the same tokenizer are byte-identical.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

INDEX_NAME = "index.json"
INDEX_KIND = "raytrain_ext.prepared"
INDEX_VERSION = 1


def shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.arrow"


@dataclass
class TokenizerInfo:
    """Which tokenizer produced the ids: training refuses another one by ``sha256``."""

    sha256: str
    eos_id: int
    pad_id: int
    vocab_size: int
    source: str


@dataclass
class ShardInfo:
    file: str
    records: int
    tokens: int
    sha256: str


@dataclass
class PreparedIndex:
    format: str
    tokenizer: TokenizerInfo
    source: str
    records_per_shard: int
    shards: List[ShardInfo] = field(default_factory=list)
    kind: str = INDEX_KIND
    version: int = INDEX_VERSION

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "PreparedIndex":
        return cls(
            format=raw["format"],
            tokenizer=TokenizerInfo(**raw["tokenizer"]),
            source=raw["source"],
            records_per_shard=raw["records_per_shard"],
            shards=[ShardInfo(**s) for s in raw["shards"]],
            kind=raw["kind"],
            version=raw["version"],
        )


def write_index(directory: Path, index: PreparedIndex) -> None:
    """Write ``index.json`` atomically (temporary file, then rename)."""
    tmp = directory / f".{INDEX_NAME}.tmp"
    tmp.write_text(index.to_json())
    os.replace(tmp, directory / INDEX_NAME)


def require_index(directory: Path) -> PreparedIndex:
    """The index of a directory a check has found prepared; a clear error when it is not."""
    index = read_index(directory)
    if index is None:
        raise ValueError(
            f"{directory} is not a prepared directory (no {INDEX_NAME} of raytrain-ext's); "
            "prepare the data with `raytrain-ext data prepare`"
        )
    return index


def read_index(directory: Path) -> Optional[PreparedIndex]:
    """The index of a prepared directory; None when ``directory`` is not one."""
    path = Path(directory) / INDEX_NAME
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if raw.get("kind") != INDEX_KIND:
        return None
    if raw.get("version") != INDEX_VERSION:
        raise ValueError(
            f"{path}: prepared-data version {raw.get('version')} is not {INDEX_VERSION}; "
            "prepare the data again with this version of raytrain-ext"
        )
    return PreparedIndex.from_dict(raw)
