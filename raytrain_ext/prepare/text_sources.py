"""The user's records (JSON lines, Parquet, Arrow, a ``datasets`` save), read by range.

``data.path`` is a file, a directory of files (every ``.jsonl``/``.json``/``.parquet``/
``.arrow``/``.feather``/``.ipc`` file below it, in sorted path order), a directory
written by ``datasets.Dataset.save_to_disk`` (its Arrow streams in ``state.json``
order), an ``s3://`` URI of any of these, or an in-memory ``pyarrow.Table``.

Invariants:
- record ``r`` is the same record on every machine and every run: files in sorted
  order, records in file order, blank JSON lines skipped;
- :meth:`RecordSource.read` of ``[start, stop)`` needs nothing but the picklable source
  (counts, row-group sizes, byte offsets of every ``stride``-th JSON line), so workers
  read their own ranges without rescanning the data;
- a file's kind is told by its first bytes, not its name, and a name that claims another
  kind is refused (a ``.parquet`` file that is really JSON);
- the fingerprint changes when the data does: a sha256 of each file's content (local
  files, and remote files read whole to be counted) or of its size and modification time
  (remote Parquet and Arrow files, counted from their metadata).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_ext.errors import InputError
from raytrain_ext.storage.s3_errors import DATA_KEYS, describe_s3_error, missing_message
from raytrain_ext.storage.s3_fs import s3_filesystem

PATH_KEY = "data.path"
COLUMN_KEY = "data.text_column (--text-column)"
FORMAT_KEY = "data.format (--format)"
FORMATS = ("text", "chat", "preference")
JSON_SUFFIXES: Tuple[str, ...] = (".jsonl", ".json")
PARQUET_SUFFIXES: Tuple[str, ...] = (".parquet",)
ARROW_SUFFIXES: Tuple[str, ...] = (".arrow", ".feather", ".ipc")
DATA_SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES
DATASETS_STATE = "state.json"
DATASETS_DICT = "dataset_dict.json"
METADATA_NAMES = (DATASETS_STATE, "dataset_info.json", DATASETS_DICT)
JSONL, PARQUET, ARROW_FILE, ARROW_STREAM = "jsonl", "parquet", "arrow-file", "arrow-stream"
KIND_NAMES = {
    PARQUET: "Parquet",
    ARROW_FILE: "an Arrow IPC file",
    ARROW_STREAM: "an Arrow IPC stream",
    JSONL: "neither Parquet nor Arrow",
}
CHUNK = 1 << 22
Columns = Dict[str, List[Any]]


@dataclass(frozen=True)
class SourceFile:
    """One file of a source and what reading a range of it needs."""

    path: str  # for the filesystem: an absolute local path, or bucket/key on S3
    name: str  # relative to the source root: part of the fingerprint
    shown: str  # in messages: the local path or the s3:// URI
    kind: str
    records: int
    columns: Tuple[str, ...]
    digest: str
    blocks: Tuple[int, ...] = ()  # records per row group (Parquet) or record batch (Arrow)
    offsets: Tuple[int, ...] = ()  # JSON lines: byte offset of records 0, stride, 2*stride...
    stride: int = 1


class RecordSource:
    """An ordered, counted list of records that reads any range on any machine."""

    def __init__(
        self,
        name: Optional[str],
        files: Sequence[SourceFile] = (),
        table: Optional[pa.Table] = None,
        s3: Optional[Tuple[Optional[str], Optional[str]]] = None,
    ):
        """``name``: the path or URI as the index records it; None for ``table``."""
        self.files = tuple(files)
        self.table = table
        self.s3 = s3  # (endpoint, region) when the files are on S3
        self._fs: Optional[pafs.FileSystem] = None
        counts = [f.records for f in self.files] if table is None else [table.num_rows]
        self.starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
        self.records = self.starts[-1]
        if table is not None:
            self.fingerprint = table_sha256(table)
        else:
            listed = [[f.name, f.kind, f.records, f.digest] for f in self.files]
            self.fingerprint = hashlib.sha256(json.dumps(listed).encode()).hexdigest()
        self.name = name or f"pyarrow.Table:{self.fingerprint[:16]}"

    def __getstate__(self):
        return {**self.__dict__, "_fs": None}

    def filesystem(self) -> pafs.FileSystem:
        if self._fs is None:
            self._fs = s3_filesystem(*self.s3) if self.s3 else pafs.LocalFileSystem(use_mmap=True)
        return self._fs

    def read(self, start: int, stop: int, columns: Sequence[str]) -> Columns:
        """Records ``[start, stop)`` as one list per column."""
        if self.table is not None:
            return self.table.slice(start, stop - start).select(list(columns)).to_pydict()
        out: Columns = {c: [] for c in columns}
        for i, f in enumerate(self.files):
            lo, hi = max(start, self.starts[i]), min(stop, self.starts[i + 1])
            if lo < hi:
                part = read_file_range(self.filesystem(), f, lo - self.starts[i], hi - lo, columns)
                for c in columns:
                    out[c].extend(part[c])
        return out

    def where(self, record: int) -> str:
        """``FILE record j`` for messages about global record ``record``."""
        if self.table is None:
            for i, f in enumerate(self.files):
                if record < self.starts[i + 1]:
                    return f"{f.shown} record {record - self.starts[i]}"
        return f"{self.name} record {record}"


def table_sha256(table: pa.Table) -> str:
    """sha256 of the table's content (schema metadata and chunking left out)."""
    plain = table.replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, plain.schema) as writer:
        writer.write_table(plain)
    return hashlib.sha256(sink.getvalue()).hexdigest()


def open_source(
    path: Union[str, pa.Table],
    *,
    s3_endpoint_url: Optional[str] = None,
    s3_region: Optional[str] = None,
    stride: int = 1024,
) -> RecordSource:
    """List, identify and count ``path``'s records; InputError naming data.path if unreadable."""
    if isinstance(path, pa.Table):
        return RecordSource(None, table=path)
    if path.startswith("s3://"):
        fs = s3_filesystem(s3_endpoint_url, s3_region)
        root, name = path[len("s3://") :].rstrip("/"), path.rstrip("/")
        try:
            files = _scan_all(fs, root, "s3://", stride, s3_endpoint_url)
        except OSError as e:
            raise InputError(describe_s3_error(e, DATA_KEYS, path, s3_endpoint_url)) from None
        return RecordSource(name, files, s3=(s3_endpoint_url, s3_region))
    root = str(Path(path).expanduser().resolve())
    return RecordSource(root, _scan_all(pafs.LocalFileSystem(use_mmap=True), root, "", stride))


def _scan_all(
    fs: pafs.FileSystem, root: str, scheme: str, stride: int, endpoint: Optional[str] = None
) -> List[SourceFile]:
    listed = _list_files(fs, root, scheme, endpoint)
    return [_scan_file(fs, p, _relative(p, root), scheme + p, stride) for p in listed]


def _relative(path: str, root: str) -> str:
    return path[len(root) :].lstrip("/") or Path(path).name


def _list_files(fs: pafs.FileSystem, root: str, scheme: str, endpoint: Optional[str]) -> List[str]:
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound and scheme:
        bucket_missing = fs.get_file_info(root.partition("/")[0]).type == pafs.FileType.NotFound
        raise InputError(missing_message(DATA_KEYS, scheme + root, endpoint, bucket_missing))
    if info.type == pafs.FileType.NotFound:
        raise InputError(
            f"{PATH_KEY}: {scheme}{root} does not exist. Point it at a JSON lines, Parquet or "
            "Arrow file, a directory of them, or a datasets save_to_disk directory."
        )
    if info.type == pafs.FileType.File:
        return [root]
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(root))}
    if DATASETS_DICT in names:
        splits = json.loads(_read_small(fs, f"{root}/{DATASETS_DICT}")).get("splits", [])
        raise InputError(
            f"{PATH_KEY}: {scheme}{root} is a saved DatasetDict; point data.path at one of "
            f"its splits: {', '.join(f'{scheme}{root}/{s}' for s in splits)}."
        )
    if DATASETS_STATE in names:
        state = json.loads(_read_small(fs, f"{root}/{DATASETS_STATE}"))
        return [f"{root}/{entry['filename']}" for entry in state["_data_files"]]
    found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    files = sorted(
        i.path
        for i in found
        if i.type == pafs.FileType.File
        and i.path.endswith(DATA_SUFFIXES)
        and i.base_name not in METADATA_NAMES
        and not any(part.startswith((".", "_")) for part in _relative(i.path, root).split("/"))
    )
    if not files:
        raise InputError(
            f"{PATH_KEY}: directory {scheme}{root} holds no {'/'.join(DATA_SUFFIXES)} files. "
            "Point it at the data files or the directory that holds them."
        )
    return files


def _read_small(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def _scan_file(fs: pafs.FileSystem, path: str, name: str, shown: str, stride: int) -> SourceFile:
    with fs.open_input_file(path) as f:
        size = f.size()
        head = f.read(8)
        f.seek(0)
        kind = _kind(head, size, shown)
        if kind == JSONL:
            records, offsets, columns, digest = _scan_jsonl(f, stride, shown)
            return SourceFile(
                path, name, shown, kind, records, columns, digest, (), offsets, stride
            )
        blocks, columns = _scan_arrow(f, kind, shown)
        if kind == ARROW_STREAM or isinstance(fs, pafs.LocalFileSystem):
            f.seek(0)
            digest = _content_sha256(f)
        else:
            info = fs.get_file_info(path)
            digest = f"{info.size}:{info.mtime_ns}"
    return SourceFile(path, name, shown, kind, sum(blocks), columns, digest, tuple(blocks))


def _kind(head: bytes, size: int, shown: str) -> str:
    """What the first bytes say; an InputError when the file's name claims otherwise."""
    if head[:4] == b"PAR1":
        kind, expected = PARQUET, PARQUET_SUFFIXES
    elif head[:6] == b"ARROW1":
        kind, expected = ARROW_FILE, ARROW_SUFFIXES
    elif head[:4] == b"\xff\xff\xff\xff":
        kind, expected = ARROW_STREAM, ARROW_SUFFIXES
    else:
        kind, expected = JSONL, JSON_SUFFIXES
    if size == 0 and not shown.endswith(JSON_SUFFIXES):
        raise InputError(f"{PATH_KEY}: {shown} is empty. Remove it or write the data again.")
    if not shown.endswith(DATA_SUFFIXES):
        raise InputError(
            f"{PATH_KEY}: {shown} is not named like data ({'/'.join(DATA_SUFFIXES)}). Rename "
            "it to the suffix of its format (JSON lines: .jsonl)."
        )
    if not shown.endswith(expected):
        raise InputError(
            f"{PATH_KEY}: {shown} is named like {Path(shown).suffix} data but is "
            f"{KIND_NAMES[kind]} (it starts with {head!r}). Rename it to match its content "
            f"({'/'.join(expected)}) or write it again in the format its name says."
        )
    return kind


def _scan_jsonl(f, stride: int, shown: str) -> Tuple[int, Tuple[int, ...], Tuple[str, ...], str]:
    """Count non-blank lines, note every ``stride``-th one's byte offset, hash the bytes."""
    digest, offsets, records, pos, tail = hashlib.sha256(), [], 0, 0, b""
    first: Optional[bytes] = None
    while True:
        chunk = f.read(CHUNK)
        digest.update(chunk)
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop() if chunk else b""
        for line in lines:
            if line.strip():
                if records % stride == 0:
                    offsets.append(pos)
                first = line if first is None else first
                records += 1
            pos += len(line) + 1
        if not chunk:
            break
    columns = tuple(_parse_line(first, shown, 0)) if first is not None else ()
    return records, tuple(offsets), columns, digest.hexdigest()


def _parse_line(line: bytes, shown: str, record: int) -> Dict[str, Any]:
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(
            f"{PATH_KEY}: {shown} record {record} is not a JSON line ({e}; it starts with "
            f"{line[:40]!r}). JSON data takes one object per line, e.g. "
            '{"text": "..."}; convert a JSON array with jq -c ".[]".'
        ) from None
    if not isinstance(value, dict):
        raise InputError(
            f"{PATH_KEY}: {shown} record {record} is a JSON {type(value).__name__}, not an "
            'object. Write one object per line, e.g. {"text": "..."}.'
        )
    return value


def _scan_arrow(f, kind: str, shown: str) -> Tuple[List[int], Tuple[str, ...]]:
    try:
        if kind == PARQUET:
            meta = pq.ParquetFile(f).metadata
            rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            return rows, tuple(meta.schema.to_arrow_schema().names)
        if kind == ARROW_FILE:
            reader = pa.ipc.open_file(f)
            rows = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
            return rows, tuple(reader.schema.names)
        stream = pa.ipc.open_stream(f)
        return [batch.num_rows for batch in stream], tuple(stream.schema.names)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(
            f"{PATH_KEY}: {shown} is a damaged {kind} file ({e}). Rewrite it."
        ) from None


def _content_sha256(f) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def read_file_range(
    fs: pafs.FileSystem, f: SourceFile, start: int, count: int, columns: Sequence[str]
) -> Columns:
    """Records ``[start, start + count)`` of one file, one list per column."""
    with fs.open_input_file(f.path) as handle:
        if f.kind == JSONL:
            rows = _jsonl_records(handle, f, start, count)
            return {c: [row.get(c) for row in rows] for c in columns}
        return _arrow_records(handle, f, start, count, columns)


def _jsonl_records(handle, f: SourceFile, start: int, count: int) -> List[Dict[str, Any]]:
    base = start - start % f.stride
    handle.seek(f.offsets[start // f.stride])
    rows: List[Dict[str, Any]] = []
    for record, line in enumerate(_nonblank_lines(handle), base):
        if record >= start:
            rows.append(_parse_line(line, f.shown, record))
            if len(rows) == count:
                break
    return rows


def _nonblank_lines(handle) -> Iterator[bytes]:
    tail = b""
    while chunk := handle.read(CHUNK):
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        yield from (line for line in lines if line.strip())
    if tail.strip():
        yield tail


def _arrow_records(
    handle, f: SourceFile, start: int, count: int, columns: Sequence[str]
) -> Columns:
    first, lo = 0, 0  # first block that holds `start`, and its first record
    while lo + f.blocks[first] <= start:
        lo += f.blocks[first]
        first += 1
    last, hi = first, lo + f.blocks[first]
    while hi < start + count:
        last += 1
        hi += f.blocks[last]
    if f.kind == PARQUET:
        table = pq.ParquetFile(handle).read_row_groups(range(first, last + 1), columns=columns)
    elif f.kind == ARROW_FILE:
        reader = pa.ipc.open_file(handle)
        batches = [reader.get_batch(i) for i in range(first, last + 1)]
        table = pa.Table.from_batches(batches, reader.schema).select(list(columns))
    else:
        stream = pa.ipc.open_stream(handle)
        batches = []
        for i, batch in enumerate(stream):
            if i > last:
                break
            if i >= first:
                batches.append(batch)
        table = pa.Table.from_batches(batches, stream.schema).select(list(columns))
    return table.slice(start - lo, count).to_pydict()


def required_columns(
    fmt: str, text_column: str, available: Sequence[str]
) -> Optional[Tuple[str, ...]]:
    """The columns a format reads from records with ``available`` columns; None if absent."""
    if fmt == "text":
        wanted: Tuple[str, ...] = (text_column,)
    elif fmt == "chat":
        wanted = ("messages",) if "messages" in available else ("prompt", "response")
    else:
        wanted = ("prompt", "chosen", "rejected")
    return wanted if all(c in available for c in wanted) else None


def check_source(
    path: Union[str, pa.Table],
    fmt: str,
    text_column: str = "text",
    *,
    s3_endpoint_url: Optional[str] = None,
    s3_region: Optional[str] = None,
    stride: int = 1024,
) -> Tuple[RecordSource, Tuple[str, ...]]:
    """Open ``path`` and check it can make ``fmt`` data: the source and the columns to read.

    Raises InputError naming the key, the file and the fix: a missing path, a file that is
    not what its name says, a missing column, no records at all."""
    if fmt not in FORMATS:
        raise InputError(f"{FORMAT_KEY}: {fmt!r} is not one of {', '.join(FORMATS)}.")
    source = open_source(path, s3_endpoint_url=s3_endpoint_url, s3_region=s3_region, stride=stride)
    if source.records == 0:
        raise InputError(
            f"{PATH_KEY}: {source.name} holds no records (0 rows). Point it at the data."
        )
    if source.table is not None:
        parts = [(source.name, tuple(source.table.column_names))]
    else:
        parts = [(f.shown, f.columns) for f in source.files if f.records]
    wanted = required_columns(fmt, text_column, parts[0][1])
    if wanted is None:
        raise InputError(missing_columns(fmt, text_column, *parts[0]))
    for shown, columns in parts:
        if not all(c in columns for c in wanted):
            raise InputError(missing_columns(fmt, text_column, shown, columns))
    return source, wanted


def missing_columns(fmt: str, text_column: str, shown: str, columns: Sequence[str]) -> str:
    listed = ", ".join(columns) or "none"
    if fmt == "text":
        return (
            f"{COLUMN_KEY}: {shown} has no '{text_column}' column (columns: {listed}). Set "
            "data.text_column (--text-column) to the column that holds the documents."
        )
    if fmt == "chat":
        return (
            f"{PATH_KEY}: {shown} has neither a 'messages' column nor 'prompt' and 'response' "
            f"columns (columns: {listed}). Chat data (data.format=chat) takes a list of "
            "{role, content} messages per record, or a prompt and a response."
        )
    missing = [f"'{c}'" for c in ("prompt", "chosen", "rejected") if c not in columns]
    plural = "s" if len(missing) > 1 else ""
    return (
        f"{PATH_KEY}: {shown} has no {', '.join(missing)} column{plural} (columns: {listed}). "
        "Preference data "
        "(data.format=preference) takes 'prompt', 'chosen' and 'rejected' text per record."
    )
