"""Records to samples as a stream: the packing of a prepared directory, one batch at a time.

The same records give the same samples whether prepared offline (``data prepare``, then
:func:`raytrain_ext.data.open.open_prepared`) or streamed through this packer, because both
render records with :func:`raytrain_ext.prepare.render.render_records` and cut them the same
way:

- ``tokens`` (a ``tokens`` column of ids or of id lists) and ``text`` (documents, each
  followed by the EOS id): one token stream; sample ``i`` is tokens ``[i*L, i*L + L + 1)``
  (:class:`~raytrain_ext.data.tokens.TokenDataset`'s windows), the tail shorter than a
  window is dropped at the end of an epoch;
- ``chat``: examples packed whole, greedily, in record order, into ``L + 1`` windows
  (:func:`~raytrain_ext.data.examples.pack_windows`), the last window flushed at the end;
- ``preference``: one record is one sample of two rows (chosen, rejected).

A sample is ``rows`` ``[R, L + 1]`` int64 token ids (R = 2 for preference, else 1), ``mask``
``[R, L + 1]`` float32 target weights (None for token windows) and its summed target
weight (what :meth:`target_weights` of the prepared datasets returns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.examples import window
from raytrain_ext.errors import InputError
from raytrain_ext.prepare.render import render_records
from raytrain_ext.prepare.text_sources import missing_columns, required_columns


@dataclass
class Sample:
    """One sample of the stream (see the module doc)."""

    rows: np.ndarray
    mask: Optional[np.ndarray]
    weight: float


@dataclass(frozen=True)
class Tokenizing:
    """What rendering raw records needs (None for ``data.format=tokens``)."""

    tok: Any  # the transformers tokenizer
    eos_id: int
    pad_id: int


class SamplePacker:
    """Feeds record batches in, hands complete samples out; ``end_epoch`` flushes what the
    prepared layout keeps of an epoch's tail (a chat window) and drops the rest."""

    def __init__(
        self,
        fmt: DataFormat,
        seq_len: int,
        tokenizing: Optional[Tokenizing] = None,
        text_column: str = "text",
        document_eos: Optional[int] = None,
    ):
        if fmt != DataFormat.tokens and tokenizing is None:
            raise InputError(
                f"data.tokenizer: a streamed dataset with data.format={fmt} needs a tokenizer; "
                "set data.tokenizer."
            )
        self.fmt, self.size, self.tokenizing = fmt, seq_len + 1, tokenizing
        self.text_column, self.document_eos = text_column, document_eos
        self.records = 0  # records fed in this epoch (for messages)
        self._stream: np.ndarray = np.zeros(0, dtype=np.int64)  # token formats: the uncut tail
        self._window: List[Tuple[np.ndarray, np.ndarray]] = []  # chat: the open window
        self._used = 0

    def add(self, table: pa.Table) -> List[Sample]:
        """The samples ``table``'s records complete (in order)."""
        first, self.records = self.records, self.records + table.num_rows
        if self.fmt == DataFormat.tokens:
            return self._token_windows(_int64(token_id_array(table)))
        rendered = self._render(table, first)
        if self.fmt == DataFormat.text:
            return self._token_windows(_int64(_flat_int_array(rendered.column("tokens"))))
        if self.fmt == DataFormat.chat:
            return self._pack_examples(rendered)
        return self._pairs(rendered)

    def end_epoch(self) -> List[Sample]:
        """The epoch's last samples (a chat window still open); the packer starts afresh."""
        last = [self._close_window()] if self._window else []
        self._stream = np.zeros(0, dtype=np.int64)
        self.records = 0
        return last

    def _render(self, table: pa.Table, first: int) -> pa.Table:
        assert self.tokenizing is not None  # checked in __init__
        wanted = required_columns(str(self.fmt), self.text_column, table.column_names)
        if wanted is None:
            raise InputError(
                missing_columns(str(self.fmt), self.text_column, "the dataset", table.column_names)
            )
        columns = {name: table.column(name).to_pylist() for name in wanted}
        t = self.tokenizing
        return render_records(
            str(self.fmt), t.tok, t.eos_id, columns, first, lambda i: f"the dataset's record {i}"
        ).table

    def _token_windows(self, tokens: np.ndarray) -> List[Sample]:
        stream = np.concatenate([self._stream, tokens.astype(np.int64, copy=False)])
        step, count = self.size - 1, max(0, (len(stream) - 1) // (self.size - 1))
        samples = [
            self._token_sample(stream[i * step : i * step + self.size]) for i in range(count)
        ]
        self._stream = stream[count * step :].copy()
        return samples

    def _token_sample(self, window_ids: np.ndarray) -> Sample:
        rows = window_ids.reshape(1, -1).copy()
        if self.document_eos is None:
            return Sample(rows, None, float(self.size - 1))
        return Sample(rows, None, float((rows[0, :-1] != self.document_eos).sum()))

    def _pack_examples(self, rendered: pa.Table) -> List[Sample]:
        samples = []
        tokens, masks = _lists(rendered.column("tokens")), _lists(rendered.column("loss_mask"))
        for ids, mask in zip(tokens, masks, strict=True):
            length = min(len(ids), self.size)
            if self._used and self._used + length > self.size:
                samples.append(self._close_window())
            self._window.append((ids, mask))
            self._used += length
        return samples

    def _close_window(self) -> Sample:
        ids = np.concatenate([p[0] for p in self._window])
        mask = np.concatenate([p[1] for p in self._window]).astype(np.float32)
        self._window, self._used = [], 0
        pad = self.tokenizing.pad_id if self.tokenizing else 0
        rows, weights = window(ids, mask, self.size, pad)
        return Sample(rows.reshape(1, -1), weights.reshape(1, -1), float(weights[1:].sum()))

    def _pairs(self, rendered: pa.Table) -> List[Sample]:
        assert self.tokenizing is not None
        pad = self.tokenizing.pad_id
        columns = [_lists(rendered.column(n)) for n in ("chosen", "chosen_mask")]
        columns += [_lists(rendered.column(n)) for n in ("rejected", "rejected_mask")]
        samples = []
        for chosen, chosen_mask, rejected, rejected_mask in zip(*columns, strict=True):
            a = window(chosen, chosen_mask.astype(np.float32), self.size, pad)
            b = window(rejected, rejected_mask.astype(np.float32), self.size, pad)
            samples.append(Sample(np.stack([a[0], b[0]]), np.stack([a[1], b[1]]), 1.0))
        return samples


def token_id_array(table: pa.Table) -> pa.Array:
    """The ``tokens`` column's ids as one flat integer Arrow array (its own int type), or
    InputError naming the column and the fix (the stream and the materialised view)."""
    if "tokens" not in table.column_names:
        raise InputError(
            f"Trainer(dataset=...): data.format=tokens needs a 'tokens' column of token id "
            f"lists; the dataset has {table.column_names}. Set data.format to text, chat or "
            "preference for raw records."
        )
    return _flat_int_array(table.column("tokens"))


def _flat_int_array(column: pa.ChunkedArray) -> pa.Array:
    array = column.combine_chunks()
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        array = array.flatten()
    if not pa.types.is_integer(array.type):
        raise InputError(
            f"Trainer(dataset=...): the 'tokens' column must hold integer ids, not {array.type}"
        )
    return array


def _int64(array: pa.Array) -> np.ndarray:
    return np.asarray(array.to_numpy(zero_copy_only=False), dtype=np.int64)


def _lists(column: pa.ChunkedArray) -> Sequence[np.ndarray]:
    array = column.combine_chunks()
    values = np.asarray(array.values.to_numpy(zero_copy_only=False))
    offsets = np.asarray(array.offsets.to_numpy(zero_copy_only=False))
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(array))]
