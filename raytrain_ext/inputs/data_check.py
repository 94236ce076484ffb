"""The token data a run names, checked on the driver before Ray starts.

What workers would otherwise find minutes later, deep in a remote traceback: a path that
does not exist, a file that is not Arrow IPC or Parquet (told by its magic bytes, not its
name), no integer ``tokens`` column, token ids outside ``0..model.vocab_size-1``, fewer
samples than one global batch.  Local Arrow files are memory-mapped, so the id range is
a scan at memory speed; Parquet row-group statistics are used when present.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_ext.data.tokens import (
    SUFFIXES,
    TOKEN_COLUMN,
    local_token_files,
    remote_token_files,
)
from raytrain_ext.errors import InputError
from raytrain_ext.storage.s3_errors import DATA_KEYS, describe_s3_error, missing_message
from raytrain_ext.storage.s3_fs import s3_filesystem

RECORD_PEEK_BYTES = 1 << 16  # enough for a first JSON line of any sensible record
FIX_FORMAT = (
    f"data.path takes pre-tokenized ids: Arrow IPC or Parquet files with an integer "
    f"'{TOKEN_COLUMN}' column (see raytrain_ext.data.corpus.write_token_file)"
)


@dataclass
class TokenStats:
    """What the checks need from one file: its token count and id range."""

    tokens: int
    low: Optional[int]
    high: Optional[int]


def check_token_data(cfg) -> None:
    """Raise :class:`InputError` naming the key, the file and the fix; return when usable."""
    d, m = cfg.data, cfg.model
    if d.path == "builtin:corpus":
        return
    files, opener = _list_files(d)
    prefix = "s3://" if d.path.startswith("s3://") else ""
    stats = [_file_stats(name, opener, prefix + name) for name in files]
    tokens = sum(s.tokens for s in stats)
    lows = [s.low for s in stats if s.low is not None]
    highs = [s.high for s in stats if s.high is not None]
    if lows and min(lows) < 0:
        raise InputError(
            f"data.path: {d.path} holds token id {min(lows)}; ids must be >= 0. "
            "Re-tokenize the data."
        )
    if highs and max(highs) >= m.vocab_size:
        raise InputError(
            f"data.path: {d.path} holds token id {max(highs)}, but "
            f"model.vocab_size={m.vocab_size} (ids 0..{m.vocab_size - 1}). Set "
            f"model.vocab_size >= {max(highs) + 1}, or use data of this vocabulary."
        )
    samples = max(0, (tokens - 1) // m.seq_len)
    if samples < 1:
        raise InputError(
            f"data.path: {d.path} holds {tokens} tokens, fewer than one sample of "
            f"model.seq_len+1={m.seq_len + 1}. Use more data or a smaller "
            "model.seq_len."
        )
    if samples < d.global_batch_size and not d.allow_repeat:
        raise InputError(
            f"data.global_batch_size: {d.global_batch_size} is more than the {samples} samples "
            f"in data.path {d.path} ({tokens} tokens / model.seq_len={m.seq_len}), so every "
            "step would repeat samples within its batch. Use more data, lower "
            "data.global_batch_size, or set data.allow_repeat=true if that is intended."
        )


def _list_files(d) -> Tuple[List[str], Callable[[str], pa.NativeFile]]:
    if d.path.startswith("s3://"):
        return _list_s3(d)
    root = Path(d.path)
    if not root.exists():
        raise InputError(
            f"data.path: {root} does not exist. Point data.path at Arrow IPC or "
            f"Parquet token data (an integer '{TOKEN_COLUMN}' column), or use "
            "builtin:corpus."
        )
    files = [str(p) for p in local_token_files(root)]
    if not files:
        records = sorted(p for p in root.glob("*.json*") if p.is_file())
        hint = json_records_hint(_head(records[0]), str(records[0])) if records else None
        if hint:
            raise InputError(hint)
        raise InputError(
            f"data.path: directory {root} holds no {'/'.join(SUFFIXES)} files. {FIX_FORMAT}."
        )
    return files, lambda name: pa.memory_map(name, "r")


def _list_s3(d) -> Tuple[List[str], Callable[[str], pa.NativeFile]]:
    endpoint = d.s3_endpoint_url
    bare = d.path[len("s3://") :].rstrip("/")
    try:
        fs = s3_filesystem(endpoint, d.s3_region, connect_timeout=5, request_timeout=20)
        files = remote_token_files(fs, bare)
        if not files and fs.get_file_info(bare).type == pafs.FileType.NotFound:
            no_bucket = fs.get_file_info(bare.partition("/")[0]).type == pafs.FileType.NotFound
            raise InputError(missing_message(DATA_KEYS, d.path, endpoint, no_bucket))
    except OSError as e:
        raise InputError(describe_s3_error(e, DATA_KEYS, d.path, endpoint)) from None
    if not files:
        raise InputError(f"data.path: {d.path} holds no {'/'.join(SUFFIXES)} files. {FIX_FORMAT}.")

    def opener(name: str) -> pa.NativeFile:
        try:
            return fs.open_input_file(name)
        except OSError as e:
            raise InputError(describe_s3_error(e, DATA_KEYS, f"s3://{name}", endpoint)) from None

    return files, opener


def _file_stats(name: str, opener: Callable[[str], pa.NativeFile], shown: str) -> TokenStats:
    with opener(name) as f:
        head = f.read(RECORD_PEEK_BYTES)  # the magic bytes, or the first JSON record
        magic = head[:6]
        f.seek(0)
        if magic[:4] == b"PAR1":
            return _parquet_stats(pq.ParquetFile(f), shown)
        if magic == b"ARROW1":
            try:
                table = pa.ipc.open_file(f).read_all()
            except pa.ArrowInvalid as e:
                raise InputError(
                    f"data.path: {shown} is a damaged Arrow IPC file ({e}). Rewrite it."
                ) from None
            return _column_stats(table, shown)
    if magic[:4] == b"\xff\xff\xff\xff":
        raise InputError(
            f"data.path: {shown} is an Arrow IPC stream (the format "
            "datasets.save_to_disk writes), which cannot be memory-mapped by "
            "sample. Rewrite it as an Arrow IPC file (pyarrow.ipc.new_file) or "
            "as Parquet."
        )
    records_hint = json_records_hint(head, shown)
    if records_hint:
        raise InputError(records_hint)
    raise InputError(
        f"data.path: {shown} is neither an Arrow IPC file nor a Parquet file "
        f"(it starts with {bytes(magic)!r}). {FIX_FORMAT}."
    )


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(RECORD_PEEK_BYTES)


def json_records_hint(head: bytes, shown: str) -> Optional[str]:
    """When ``head`` (a file's first bytes) starts JSON lines, the error that names the
    keys that read records, with the ``data.format`` the first record's keys suggest."""
    line = head.lstrip().split(b"\n", 1)[0]
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    keys = sorted(record)
    return (
        f"data.path: {shown} holds JSON records (keys: {', '.join(keys)}), not the token ids "
        f"data.format=tokens reads. Read records with {_guess_format(record)} and "
        "data.tokenizer=<a tokenizer directory or tokenizer.json> (for model.source=hf, "
        "the model's own by default), or tokenize them once with `raytrain-ext data "
        "prepare` and train on its output."
    )


def _guess_format(record: dict) -> str:
    """The ``data.format`` (and text column) a record's keys suggest."""
    keys = set(record)
    if {"prompt", "chosen", "rejected"} <= keys:
        return "data.format=preference"
    if "messages" in keys or {"prompt", "response"} <= keys:
        return "data.format=chat"
    if "text" in keys:
        return "data.format=text"
    strings = sorted(k for k, v in record.items() if isinstance(v, str))
    column = f"data.text_column={strings[0]}" if strings else "data.text_column=<its text key>"
    return f"data.format=text {column}"


def _parquet_stats(parquet: pq.ParquetFile, shown: str) -> TokenStats:
    names = parquet.schema_arrow.names
    if TOKEN_COLUMN not in names:
        raise InputError(_missing_column(shown, names))
    _check_type(parquet.schema_arrow.field(TOKEN_COLUMN).type, shown)
    column = names.index(TOKEN_COLUMN)
    meta = parquet.metadata
    ranges = [meta.row_group(i).column(column).statistics for i in range(meta.num_row_groups)]
    if meta.num_row_groups and all(s is not None and s.has_min_max for s in ranges):
        return TokenStats(meta.num_rows, min(s.min for s in ranges), max(s.max for s in ranges))
    return _column_stats(parquet.read(columns=[TOKEN_COLUMN]), shown)


def _column_stats(table: pa.Table, shown: str) -> TokenStats:
    if TOKEN_COLUMN not in table.column_names:
        raise InputError(_missing_column(shown, table.column_names))
    column = table.column(TOKEN_COLUMN)
    _check_type(column.type, shown)
    if len(column) == 0:
        return TokenStats(0, None, None)
    bounds = pc.min_max(column)
    return TokenStats(len(column), bounds["min"].as_py(), bounds["max"].as_py())


def _check_type(dtype: pa.DataType, shown: str) -> None:
    if not pa.types.is_integer(dtype):
        raise InputError(
            f"data.path: column '{TOKEN_COLUMN}' of {shown} holds {dtype}, not "
            f"integer token ids. {FIX_FORMAT}."
        )


def _missing_column(shown: str, names: List[str]) -> str:
    listed = ", ".join(names) or "none"
    return f"data.path: {shown} has no '{TOKEN_COLUMN}' column (columns: {listed}). {FIX_FORMAT}."
