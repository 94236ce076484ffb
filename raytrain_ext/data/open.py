"""From the ``data`` config to a dataset of samples: the one place that decides how.

- ``builtin:corpus``, token files and ``s3://`` token prefixes (``data.format: tokens``)
  are read as today (:mod:`raytrain_ext.data.tokens`).
- A prepared directory (``index.json``, written by ``raytrain-ext data prepare``) is
  read in the format its index records.
- Raw records (``data.format`` text, chat or preference on JSONL, Parquet, Arrow or a
  ``datasets`` directory) are prepared once, in this process, into the run's cache
  ``<run dir>/data-cache/<key>`` and then read from there.  The key covers the source
  files (names, sizes, modification times), the tokenizer file and the format, so a
  changed input is prepared again.  Concurrent openers on one node (the driver's
  preflight, the ranks) take a file lock; the first prepares, the others read.

Every dataset has ``num_samples``, ``batch(indices) -> Batch``, ``target_weights`` and
``max_token``; sample ``i`` depends only on the data and ``model.seq_len``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

import numpy as np

from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.examples import PackedExamples, PreferencePairs
from raytrain_ext.data.tokens import TokenDataset, open_token_dataset, read_token_file
from raytrain_ext.models.sources import model_source
from raytrain_ext.prepare.prepared_index import PreparedIndex, read_index, require_index

CACHE_DIR = "data-cache"


def open_dataset(cfg, path: Optional[str] = None):
    """The dataset ``path`` (default ``data.path``) names, read in ``data.format``."""
    path = path or cfg.data.path
    prepared = prepared_directory(cfg, path)
    if prepared is None:
        return open_token_dataset(
            path,
            cfg.model.seq_len,
            s3_endpoint_url=cfg.data.s3_endpoint_url,
            s3_region=cfg.data.s3_region,
        )
    return open_prepared(prepared, cfg.model.seq_len, cfg.data.document_mask)


def open_prepared(directory: Path, seq_len: int, document_mask: bool = False):
    """A prepared directory's samples, by the format its index records; ``document_mask``:
    text windows carry per-document positions (see :class:`Batch`)."""
    index = require_index(directory)
    files = [directory / shard.file for shard in index.shards]
    source = str(directory)
    if index.format == DataFormat.text:
        arrays = [read_token_file(f) for f in files]
        tokens = np.concatenate(arrays) if len(arrays) != 1 else arrays[0]
        eos = index.tokenizer.eos_id if document_mask else None
        return TokenDataset(tokens, seq_len, source=source, document_eos=eos)
    if index.format == DataFormat.chat:
        return PackedExamples(files, seq_len, index.tokenizer.pad_id, source)
    return PreferencePairs(files, seq_len, index.tokenizer.pad_id, source)


def prepared_directory(cfg, path: str) -> Optional[Path]:
    """The prepared directory to read ``path`` from; None for plain token data."""
    if path == "builtin:corpus":
        return None
    if not path.startswith("s3://") and read_index(Path(path)) is not None:
        return Path(path)
    if cfg.data.format == DataFormat.tokens:
        return None
    return prepare_cached(cfg, path)


def prepared_index(cfg, path: str) -> Optional[PreparedIndex]:
    directory = prepared_directory(cfg, path)
    return None if directory is None else read_index(directory)


def tokenizer_spec(cfg) -> Optional[str]:
    """``data.tokenizer``, else the model source's own (``models.sources``: the tokenizer
    beside a Hugging Face model's weights)."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    return model_source(cfg.model).default_tokenizer(cfg.model)


def prepare_cached(cfg, path: str) -> Path:
    """Raw records prepared into the run's cache (once per node; see the module doc)."""
    from raytrain_ext.errors import InputError
    from raytrain_ext.prepare.pipeline import prepare_dataset

    spec = tokenizer_spec(cfg)
    if spec is None:
        raise InputError(
            f"data.tokenizer: data.format={cfg.data.format} reads raw records from {path} and "
            "needs a tokenizer. Set data.tokenizer to a Hugging Face tokenizer directory or a "
            "tokenizer.json (or prepare the data with `raytrain-ext data prepare`)."
        )
    directory = cache_directory(cfg, path, spec)
    with _locked(directory.with_name(directory.name + ".lock")):
        if read_index(directory) is None:
            prepare_dataset(
                path,
                spec,
                directory,
                str(cfg.data.format),
                text_column=cfg.data.text_column,
                s3_endpoint_url=cfg.data.s3_endpoint_url,
                s3_region=cfg.data.s3_region,
                eos_token=cfg.data.eos_token,
            )
    return directory


def cache_directory(cfg, path: str, tokenizer: str) -> Path:
    key = {
        "source": path,
        "files": _fingerprint(path),
        "tokenizer": _fingerprint(tokenizer),
        "format": str(cfg.data.format),
        "text_column": cfg.data.text_column,
    }
    if cfg.data.eos_token is not None:  # (absent otherwise: earlier caches keep their key)
        key["eos_token"] = cfg.data.eos_token
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.run.output_dir) / cfg.run.name / CACHE_DIR / digest


def tokenizer_files_in_key(tokenizer: str) -> bool:
    """Whether :func:`cache_directory`'s key covers the files of ``tokenizer`` (a local file
    or directory, by name, size and modification time): then an entry was prepared with
    exactly these files, and other files make another entry.  A model id in the Hugging
    Face cache is keyed by its name alone, so a newer download reuses the entry."""
    return not tokenizer.startswith("s3://") and bool(_fingerprint(tokenizer))


def _fingerprint(path: str) -> List[List]:
    """(name, size, mtime) of a local file or of every file below a directory."""
    if path.startswith("s3://"):
        return [[path]]
    local = Path(path)
    files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files if p.exists()]


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
