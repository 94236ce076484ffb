"""One shard of a preparation, and what an output directory already holds.

Shard ``k`` is source records ``[k*R, (k+1)*R)`` rendered by render.py and written as an
uncompressed Arrow IPC file with a single record batch, so its bytes depend only on
those records and the tokenizer.  Next to it, ``shard-NNNNN.json`` (the sidecar) records
what it was made from: the source fingerprint, the tokenizer sha256, the format, the
text column and the record range, plus its :class:`ShardInfo`.

Invariants:
- both files are written to a temporary name and renamed, the shard first, so a sidecar
  is only ever next to a complete shard, and a shard without one is redone;
- a shard whose sidecar names this preparation is finished: it is never rewritten;
- a directory holding anything else (another preparation's sidecar or index, a file that
  is not ours) is refused, never cleaned: the user's files are not deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pyarrow as pa

from raytrain_ext.errors import InputError
from raytrain_ext.prepare.prepared_index import (
    INDEX_NAME,
    PreparedIndex,
    ShardInfo,
    TokenizerInfo,
    read_index,
    shard_name,
)
from raytrain_ext.prepare.render import render_records
from raytrain_ext.prepare.text_sources import RecordSource

OURS = re.compile(
    r"^(index\.json|shard-\d{5,}\.(arrow|json)|\.(index\.json|shard-\d{5,}\.\w+)\..*tmp)$"
)
OUR_TEMPORARY = re.compile(r"^\.(shard-\d{5,}\.(arrow|json)\.\d+|index\.json)\.tmp$")
SIDECAR_KIND = "raytrain_ext.prepared-shard"


def sidecar_name(shard: int) -> str:
    return f"shard-{shard:05d}.json"


@dataclass
class PrepareJob:
    """Everything a worker needs to write any shard (picklable)."""

    source: RecordSource
    columns: Tuple[str, ...]
    tok: Any  # the transformers tokenizer
    tokenizer: TokenizerInfo
    fmt: str
    text_column: str
    records_per_shard: int
    out_dir: str

    @property
    def num_shards(self) -> int:
        return -(-self.source.records // self.records_per_shard)

    def shard_range(self, shard: int) -> Tuple[int, int]:
        start = shard * self.records_per_shard
        return start, min(start + self.records_per_shard, self.source.records)

    def shard_key(self, shard: int) -> Dict[str, Any]:
        """What a shard is made from: equal keys, equal bytes."""
        start, stop = self.shard_range(shard)
        return {
            "source": self.source.fingerprint,
            "tokenizer": self.tokenizer.sha256,
            "format": self.fmt,
            "text_column": self.text_column,
            "records": [start, stop],
        }

    def index(self, shards: List[ShardInfo]) -> PreparedIndex:
        return PreparedIndex(
            format=self.fmt,
            tokenizer=self.tokenizer,
            source=self.source.name,
            records_per_shard=self.records_per_shard,
            shards=shards,
        )


def write_shard(job: PrepareJob, shard: int) -> ShardInfo:
    """Read, render and write shard ``shard`` and then its sidecar; its ShardInfo."""
    start, stop = job.shard_range(shard)
    columns = job.source.read(start, stop, job.columns)
    rendered = render_records(
        job.fmt, job.tok, job.tokenizer.eos_id, columns, start, job.source.where
    )
    out = Path(job.out_dir)
    data = _ipc_file_bytes(rendered.table)
    _write_atomically(out / shard_name(shard), data)
    info = ShardInfo(
        file=shard_name(shard),
        records=stop - start,
        tokens=rendered.tokens,
        sha256=hashlib.sha256(data).hexdigest(),
    )
    sidecar = {
        "kind": SIDECAR_KIND,
        "key": job.shard_key(shard),
        "shard": asdict(info),
        "bytes": len(data),
    }
    _write_atomically(out / sidecar_name(shard), _json_bytes(sidecar))
    return info


def _ipc_file_bytes(table: pa.Table) -> bytes:
    """The table as an uncompressed Arrow IPC file holding one record batch."""
    sink = pa.BufferOutputStream()
    batch = table.combine_chunks().to_batches()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for b in batch:
            writer.write_batch(b)
    return sink.getvalue().to_pybytes()


def _json_bytes(value: Dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def finished_shard(job: PrepareJob, shard: int) -> Optional[ShardInfo]:
    """The ShardInfo of a shard this preparation already wrote, else None."""
    out = Path(job.out_dir)
    sidecar = _read_sidecar(out / sidecar_name(shard))
    data = out / shard_name(shard)
    if sidecar is None or sidecar["key"] != job.shard_key(shard) or not data.is_file():
        return None
    if data.stat().st_size != sidecar["bytes"]:
        return None
    return ShardInfo(**sidecar["shard"])


def _read_sidecar(path: Path) -> Optional[Dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return raw if isinstance(raw, dict) and raw.get("kind") == SIDECAR_KIND else None


def claim_out_dir(job: PrepareJob) -> Optional[PreparedIndex]:
    """Create or check the output directory: its finished index when it matches ``job``
    exactly, None when shards remain to write; InputError when it holds something else.
    Temporary files of an interrupted run of ours are removed."""
    out = Path(job.out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out: {out} is a file; give a directory for the prepared data.")
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if not OURS.match(n)]
    if foreign:
        raise InputError(
            f"--out: {out} already holds files that are not prepared data "
            f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}). Give an empty "
            "or new directory (nothing in it is deleted)."
        )
    _refuse_other_preparation(job, out, names)
    for name in names:
        if OUR_TEMPORARY.match(name):
            (out / name).unlink(missing_ok=True)
    existing = _existing_index(out)
    if existing is None:
        return None
    shards = [s for k in range(job.num_shards) if (s := finished_shard(job, k)) is not None]
    if len(shards) == job.num_shards and job.index(shards).to_json() == existing.to_json():
        return existing
    return None


def _refuse_other_preparation(job: PrepareJob, out: Path, names: List[str]) -> None:
    for name in names:
        if not re.match(r"^shard-\d{5,}\.json$", name):
            continue
        sidecar = _read_sidecar(out / name)
        shard = int(name[len("shard-") : -len(".json")])
        key = job.shard_key(shard) if shard < job.num_shards else None
        if sidecar is None or sidecar["key"] != key:
            raise InputError(
                f"--out: {out} holds another preparation ({name}: "
                f"{_differences(sidecar, key)}). Give another output directory, or delete "
                "that one to prepare it again."
            )
    index = _existing_index(out) if INDEX_NAME in names else None
    if index is not None and (
        index.format != job.fmt
        or index.tokenizer.sha256 != job.tokenizer.sha256
        or index.records_per_shard != job.records_per_shard
        or len(index.shards) != job.num_shards
    ):
        raise InputError(
            f"--out: {out} holds data prepared as format {index.format} with tokenizer "
            f"{index.tokenizer.sha256[:12]} and {index.records_per_shard} records per shard "
            f"({len(index.shards)} shards); this preparation is format {job.fmt}, tokenizer "
            f"{job.tokenizer.sha256[:12]}, {job.records_per_shard} per shard "
            f"({job.num_shards} shards). Give another output directory, or delete that one."
        )


def _existing_index(out: Path) -> Optional[PreparedIndex]:
    try:
        return read_index(out)
    except (ValueError, KeyError, TypeError) as e:  # another version, or a damaged file
        raise InputError(
            f"--out: {out / INDEX_NAME} cannot be used ({e}). Give another output directory, "
            "or delete that one to prepare it again."
        ) from None


def _differences(sidecar: Optional[Dict[str, Any]], key: Optional[Dict[str, Any]]) -> str:
    """What differs between a sidecar's key and this preparation's, in words."""
    if sidecar is None:
        return "not a shard record of this version"
    if key is None:
        return "a shard beyond this preparation's last: the source has fewer records"
    theirs = sidecar["key"]
    names = {"source": "source data", "records": "record range (--records-per-shard)"}
    return "; ".join(
        f"{names.get(field, field)} {_shown(theirs.get(field))} there, {_shown(key[field])} here"
        for field in key
        if theirs.get(field) != key[field]
    )


def _shown(value: Any) -> str:
    return value[:12] if isinstance(value, str) and len(value) == 64 else str(value)
