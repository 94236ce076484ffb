"""Prepared chat and preference data as samples of the global order.

Both read the shards of a prepared directory (:mod:`raytrain_ext.prepare.prepared_index`)
memory-mapped; a list column stays in place as Arrow's values + offsets, so opening a
dataset copies nothing but the offsets.

- :class:`PackedExamples` (``chat``): examples are packed whole, in record order, into
  windows of ``seq_len + 1`` tokens (a new window starts when the next example does
  not fit; an example longer than a window is truncated to it).  Sample ``i`` is
  window ``i``: the layout depends only on the data and ``seq_len``, never on the
  world size.  Padding and prompt tokens weigh 0, so no loss crosses an example (the
  target after an example's EOS is the next example's first prompt token, weight 0).
- :class:`PreferencePairs` (``preference``): sample ``i`` is record ``i``; its chosen
  and rejected sequences are truncated or padded to ``seq_len + 1``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pyarrow as pa

from raytrain_ext.data.arrow_numpy import int_values
from raytrain_ext.data.batch import Batch


class RaggedColumn:
    """One list column over several shard files: row ``i`` as a zero-copy numpy view."""

    def __init__(self, chunks: Sequence[pa.ListArray]):
        self._values = [int_values(c.values) for c in chunks]
        self._offsets = [int_values(c.offsets) for c in chunks]
        counts = [len(o) - 1 for o in self._offsets]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._chunk_of: np.ndarray = np.repeat(np.arange(len(counts)), counts)  # row -> its chunk
        self.lengths = np.concatenate([np.diff(o) for o in self._offsets]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._first[-1])

    def row(self, i: int) -> np.ndarray:
        return self.rows(i, i + 1)

    def rows(self, first: int, stop: int) -> np.ndarray:
        """Rows ``first..stop-1`` back to back: a zero-copy view when they lie in one chunk
        (consecutive rows are contiguous in Arrow's values), else one concatenation."""
        chunk = int(self._chunk_of[first])
        local, end = first - self._first[chunk], stop - self._first[chunk]
        offsets = self._offsets[chunk]
        if end < len(offsets):
            return self._values[chunk][offsets[local] : offsets[end]]
        split = int(self._first[chunk + 1])
        return np.concatenate([self.rows(first, split), self.rows(split, stop)])


def read_list_columns(files: Sequence[Path], names: Sequence[str]) -> List[RaggedColumn]:
    """The named list columns of every shard file, memory-mapped, in file order."""
    chunks: Dict[str, List[pa.Array]] = {name: [] for name in names}
    for path in files:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        for name in names:
            if name not in table.column_names:
                raise ValueError(f"{path} has no '{name}' column (columns: {table.column_names})")
            chunks[name].extend(table.column(name).chunks)
    return [RaggedColumn(chunks[name]) for name in names]


def window(
    tokens: np.ndarray, mask: np.ndarray, size: int, pad_id: int
) -> Tuple[np.ndarray, np.ndarray]:
    """``tokens``/``mask`` cut or padded (pad id, weight 0) to exactly ``size``."""
    out_tokens: np.ndarray = np.full(size, pad_id, dtype=np.int64)
    out_mask: np.ndarray = np.zeros(size, dtype=np.float32)
    n = min(size, len(tokens))
    out_tokens[:n] = tokens[:n]
    out_mask[:n] = mask[:n]
    return out_tokens, out_mask


def fill_rows(
    pieces: Sequence[Tuple[np.ndarray, np.ndarray]], size: int, pad_id: int
) -> Tuple[np.ndarray, np.ndarray]:
    """``(tokens, mask)`` pieces written into one ``[rows, size]`` pair of arrays, each cut
    or padded (pad id, weight 0) to ``size``: one allocation per batch, not per row."""
    tokens: np.ndarray = np.full((len(pieces), size), pad_id, dtype=np.int64)
    mask: np.ndarray = np.zeros((len(pieces), size), dtype=np.float32)
    for r, (t, m) in enumerate(pieces):
        n = min(size, len(t))
        tokens[r, :n] = t[:n]
        mask[r, :n] = m[:n]
    return tokens, mask


def rows_to_batch(tokens: np.ndarray, mask: np.ndarray, indices, pairs: int = 0) -> Batch:
    """``[rows, seq_len + 1]`` tokens and masks -> inputs, shifted targets, target weights."""
    import torch  # here: the driver's data checks open these without torch

    t, m = torch.from_numpy(tokens), torch.from_numpy(mask)
    return Batch(t[:, :-1], t[:, 1:], m[:, 1:].contiguous(), pairs=pairs, indices=indices)


class PackedExamples:
    """``chat`` examples packed whole into ``seq_len + 1`` windows (see the module doc)."""

    def __init__(self, files: Sequence[Path], seq_len: int, pad_id: int, source: str):
        self.tokens, self.mask = read_list_columns(files, ("tokens", "loss_mask"))
        self.seq_len, self.pad_id, self.source = seq_len, pad_id, source
        self.windows = pack_windows(self.tokens.lengths, seq_len + 1)
        self.num_samples = len(self.windows) - 1
        if self.num_samples < 1:
            raise ValueError(f"{source} holds no example; prepare it again with records")
        self._weights = np.array([self._window(i)[1][1:].sum() for i in range(self.num_samples)])

    def _pieces(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        """Window ``i``'s examples back to back (views), before cutting or padding."""
        first, stop = int(self.windows[i]), int(self.windows[i + 1])
        return self.tokens.rows(first, stop), self.mask.rows(first, stop)

    def _window(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        return window(*self._pieces(i), self.seq_len + 1, self.pad_id)

    def batch(self, indices: np.ndarray) -> Batch:
        pieces = [self._pieces(int(i)) for i in indices]
        tokens, mask = fill_rows(pieces, self.seq_len + 1, self.pad_id)
        return rows_to_batch(tokens, mask, indices)

    def target_weights(self, indices: np.ndarray) -> np.ndarray:
        """Each sample's summed target weight (its response tokens)."""
        return self._weights[np.asarray(indices, dtype=np.int64)]

    def max_token(self) -> int:
        return max(int(v.max()) for v in self.tokens._values if len(v))


def pack_windows(lengths: np.ndarray, size: int) -> np.ndarray:
    """Window boundaries over examples: window ``w`` holds examples
    ``bounds[w]..bounds[w+1]-1``; greedy, in order, an example never split."""
    bounds, used = [0], 0
    for j, length in enumerate(np.minimum(lengths, size).tolist()):
        if used and used + length > size:
            bounds.append(j)
            used = 0
        used += length
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


class PreferencePairs:
    """``preference`` records; a batch is the chosen rows, then the rejected rows."""

    COLUMNS = ("chosen", "chosen_mask", "rejected", "rejected_mask")

    def __init__(self, files: Sequence[Path], seq_len: int, pad_id: int, source: str):
        self.chosen, self.chosen_mask, self.rejected, self.rejected_mask = read_list_columns(
            files, self.COLUMNS
        )
        self.seq_len, self.pad_id, self.source = seq_len, pad_id, source
        self.num_samples = len(self.chosen)
        if self.num_samples < 1:
            raise ValueError(f"{source} holds no preference record")

    def batch(self, indices: np.ndarray) -> Batch:
        order = [int(i) for i in indices]
        pieces = [(self.chosen.row(i), self.chosen_mask.row(i)) for i in order]
        pieces += [(self.rejected.row(i), self.rejected_mask.row(i)) for i in order]
        tokens, mask = fill_rows(pieces, self.seq_len + 1, self.pad_id)
        return rows_to_batch(tokens, mask, indices, pairs=len(indices))

    def target_weights(self, indices: np.ndarray) -> np.ndarray:
        """One unit per record (the DPO loss is a mean over pairs)."""
        return np.ones(len(indices))

    def max_token(self) -> int:
        return max(
            int(v.max()) for col in (self.chosen, self.rejected) for v in col._values if len(v)
        )
