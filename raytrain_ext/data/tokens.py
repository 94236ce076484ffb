"""Token files read with pyarrow: one flat ``tokens`` column, cut into samples.

Sample ``i`` is ``tokens[i*L : i*L + L + 1]`` (inputs and shifted targets) for
``L = model.seq_len``, so the sample count depends only on the data and the
sequence length.  Local Arrow IPC files are memory-mapped (no copy, shared by
the workers of a node through the page cache); Parquet and ``s3://`` sources
are read into memory once per worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_ext.data.arrow_numpy import int_values
from raytrain_ext.data.batch import Batch

if TYPE_CHECKING:
    import torch
from raytrain_ext.data.corpus import builtin_corpus_path
from raytrain_ext.storage.s3_fs import s3_filesystem

TOKEN_COLUMN = "tokens"
SUFFIXES = (".arrow", ".feather", ".ipc", ".parquet")


class TokenDataset:
    """Random access to fixed-length samples of a token stream."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        source: str = "<memory>",
        document_eos: Optional[int] = None,
    ):
        self.tokens = tokens
        self.seq_len = seq_len
        self.source = source
        self.document_eos = document_eos  # set: document masking at this EOS id
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"{source} holds {len(tokens)} tokens, fewer than one sample of "
                f"model.seq_len+1={seq_len + 1}; use more data or a shorter seq_len"
            )

    def batch(self, indices: np.ndarray) -> Batch:
        """Inputs and targets (int64, shape [len(indices), seq_len]); every target counts."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        offsets: np.ndarray = np.arange(self.seq_len + 1, dtype=np.int64)
        return windows_to_batch(self.tokens[starts[:, None] + offsets], indices, self.document_eos)

    def target_weights(self, indices: np.ndarray) -> np.ndarray:
        """Each sample's summed target weight: ``seq_len`` (every target counts 1), less
        the targets after an EOS under document masking."""
        if self.document_eos is None:
            return np.full(len(indices), float(self.seq_len))
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        inputs = self.tokens[starts[:, None] + np.arange(self.seq_len, dtype=np.int64)]
        return (inputs != self.document_eos).sum(axis=1).astype(np.float64)

    def max_token(self, prefix: int = 1 << 26) -> int:
        """Largest token id in the first ``prefix`` tokens (a cheap sanity check on huge data)."""
        return int(self.tokens[:prefix].max())


def windows_to_batch(windows: np.ndarray, indices, document_eos: Optional[int]) -> Batch:
    """``[rows, seq_len + 1]`` token windows -> inputs and shifted targets (int64); under
    document masking (``document_eos``) the positions and weights of :func:`document_positions`."""
    import torch  # here: the driver's data checks read token files without torch

    rows = torch.from_numpy(windows.astype(np.int64))
    batch = Batch(rows[:, :-1], rows[:, 1:], indices=np.asarray(indices))
    if document_eos is not None:
        batch.positions, batch.weights = document_positions(batch.inputs, document_eos)
    return batch


def document_positions(inputs: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's position within its document (0 at a row's start and after each EOS)
    and the target weights (0 for the target after an EOS: it is another document's)."""
    import torch

    is_eos = inputs == eos
    begins = torch.zeros_like(is_eos)
    begins[:, 0] = True
    begins[:, 1:] = is_eos[:, :-1]
    index = torch.arange(inputs.shape[1]).expand_as(inputs)
    last_begin = torch.where(begins, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_begin, (~is_eos).to(torch.float32)


def open_token_dataset(
    path: str,
    seq_len: int,
    *,
    s3_endpoint_url: Optional[str] = None,
    s3_region: Optional[str] = None,
) -> TokenDataset:
    """Open ``builtin:corpus``, a local file or directory, or an ``s3://`` URI."""
    if path == "builtin:corpus":
        return TokenDataset(_read_local(builtin_corpus_path()), seq_len, source=path)
    if path.startswith("s3://"):
        fs = s3_filesystem(s3_endpoint_url, s3_region)
        return TokenDataset(_read_remote(fs, path[len("s3://") :]), seq_len, source=path)
    local = Path(path)
    if not local.exists():
        raise FileNotFoundError(
            f"data.path: {path} does not exist; point it at an Arrow IPC or "
            "Parquet file (or a directory of them) with a 'tokens' column"
        )
    files = local_token_files(local)
    if not files:
        raise FileNotFoundError(f"data.path: {path} holds no {'/'.join(SUFFIXES)} files")
    arrays = [_read_local(f) for f in files]
    tokens = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return TokenDataset(tokens, seq_len, source=path)


def read_token_file(path: Path) -> np.ndarray:
    """The ``tokens`` column of one local Arrow IPC (memory-mapped) or Parquet file."""
    return _read_local(path)


def _read_local(path: Path) -> np.ndarray:
    if path.suffix == ".parquet":
        return _column(_read_parquet(pq.ParquetFile(path, memory_map=True), str(path)), str(path))
    table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    return _column(table, str(path))


def local_token_files(path: Path) -> List[Path]:
    """The file itself, or every token file below the directory, sorted."""
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def remote_token_files(fs: pafs.FileSystem, path: str) -> List[str]:
    """``bucket/prefix`` (no scheme): the file itself, or every token file below the prefix,
    sorted; [] when nothing is there."""
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        selector = pafs.FileSelector(path, recursive=True)
        return sorted(i.path for i in fs.get_file_info(selector) if i.path.endswith(SUFFIXES))
    return [path] if info.type == pafs.FileType.File else []


def _read_remote(fs: pafs.FileSystem, path: str) -> np.ndarray:
    names = remote_token_files(fs, path)
    if not names:
        raise FileNotFoundError(
            f"data.path: s3://{path} does not exist or holds no {'/'.join(SUFFIXES)} files"
        )
    arrays: List[np.ndarray] = []
    for name in names:
        with fs.open_input_file(name) as f:
            if name.endswith(".parquet"):
                table = _read_parquet(pq.ParquetFile(f), f"s3://{name}")
            else:
                table = pa.ipc.open_file(f).read_all()
        arrays.append(_column(table, f"s3://{name}"))
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _read_parquet(parquet: pq.ParquetFile, source: str) -> pa.Table:
    """Read only the token column, after checking that it exists."""
    if TOKEN_COLUMN not in parquet.schema_arrow.names:
        raise ValueError(
            f"{source} has no '{TOKEN_COLUMN}' column (columns: {parquet.schema_arrow.names})"
        )
    return parquet.read(columns=[TOKEN_COLUMN])


def _column(table: pa.Table, source: str) -> np.ndarray:
    if TOKEN_COLUMN not in table.column_names:
        raise ValueError(f"{source} has no '{TOKEN_COLUMN}' column (columns: {table.column_names})")
    column = table.column(TOKEN_COLUMN)
    if not pa.types.is_integer(column.type):
        raise ValueError(f"{source}: column '{TOKEN_COLUMN}' must hold integers, not {column.type}")
    chunk = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return int_values(chunk)
