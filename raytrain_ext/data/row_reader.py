"""The reader of a user loop's dataset: rows in, each rank's share of each round out.

One reader per dataset of a ``TorchTrainer`` run (a Ray actor,
:mod:`raytrain_ext.user_loop.dataset_shard`) iterates the dataset and hands every rank of
the group its rows by position; it lives apart from the worker group, so a re-form, a
shrink or a grow leaves it (and what it has read) in place.

Invariants:
- **A world-size-independent order.** Epoch ``e`` is the dataset's rows in its own order
  (Ray Data's ``preserve_order``); a position is (epoch, rows of that epoch consumed by
  the whole group).  From position ``p``, a group of ``W`` ranks iterating batches of
  ``B`` rows takes one *round* of ``W*B`` rows, rank ``r`` rows ``[p + r*B, p + (r+1)*B)``.
  Who consumed a row before a position never matters: a group of any size resumes there.
- **Equal shares, as Ray Train's ``streaming_split(equal=True)``.** At the epoch's end,
  with ``R < W*B`` rows left, each rank gets ``R // W`` of them (one last, shorter batch;
  none when ``R < W``) and the last ``R % W`` rows are not handed out: every rank makes
  the same number of batches, so its collectives stay matched.
- **Bounded memory.** Held: the rows from the lowest position any rank of the current
  group last asked for, to the read head.  Asked for a position before what it holds (a
  group resuming from an older checkpoint, a restarted reader), it reads the epoch again
  from its start (Ray Data cannot start mid-dataset) and keeps rows from there.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import pyarrow as pa

EpochBatches = Callable[[int], Iterable[pa.Table]]  # epoch -> that epoch's record batches
Position = Tuple[int, int]  # (epoch, rows of it the group consumed)


@dataclass
class Rounds:
    """Rank ``rank``'s rows of consecutive rounds from ``start``: ``tables[i]`` is its share
    of round ``i``, which ends at ``ends[i]`` (the position after it); ``epoch_done``: no
    round follows the last one in this epoch (the next position is ``(epoch + 1, 0)``)."""

    epoch: int
    start: int
    tables: List[pa.Table]
    ends: List[int]
    epoch_done: bool


@dataclass
class RowReaderStats:
    rows_read: int = 0
    rereads: int = 0  # times it read an epoch again from its start
    rows_skipped: int = 0  # rows read, not kept, while reading to a position
    rows_handed_out: int = 0
    read_s: float = 0.0
    epoch_rows: Dict[int, int] = field(default_factory=dict)  # rows of each epoch read


class RowReader:
    """Rows of the global order, asked for by position (see the module doc).  Thread-safe:
    ranks ask concurrently; one reads, the others find the rows held."""

    def __init__(self, epoch_batches: EpochBatches):
        self._epoch_batches = epoch_batches
        self._lock = threading.Lock()
        self.stats = RowReaderStats()
        self._group: Optional[str] = None
        self._marks: Dict[int, Position] = {}  # each rank's last asked position
        self._world = 1
        self._start_epoch(0)

    def take(
        self,
        epoch: int,
        start: int,
        *,
        rank: int,
        world: int,
        batch_size: int,
        rounds: int,
        group: str,
        max_bytes: Optional[int] = None,
    ) -> Rounds:
        """Rank ``rank``'s share of up to ``rounds`` rounds of ``world * batch_size`` rows
        from ``(epoch, start)``, for the group ``group`` (a new id resets who asked what);
        fewer once the share holds ``max_bytes`` (one round at least)."""
        if world < 1 or not 0 <= rank < world or batch_size < 1 or rounds < 1:
            raise ValueError(f"rank {rank} of {world}, batch {batch_size}, {rounds} rounds")
        with self._lock:
            self._note_ask(group, rank, world, (epoch, start))
            if (epoch, start) < self._base():  # not held any more: read the epoch again
                self._start_epoch(epoch)
                self.stats.rereads += 1
            tables: List[pa.Table] = []
            ends: List[int] = []
            done, position, size = False, start, 0
            while len(tables) < rounds and (max_bytes is None or size < max_bytes):
                share = self._round(epoch, position, rank, world, batch_size)
                if share is None:
                    done = True
                    break
                table, position = share
                tables.append(table)
                ends.append(position)
                size += table.nbytes
                self.stats.rows_handed_out += table.num_rows
            if not done and self._epoch_end(epoch) is not None:  # say so with the last round
                done = self._round_bounds(epoch, position, world, batch_size) is None
            self._release()
        return Rounds(epoch, start, tables, ends, done)

    def held_rows(self) -> int:
        with self._lock:
            return sum(t.num_rows for _, _, t in self._chunks)

    def _note_ask(self, group: str, rank: int, world: int, at: Position) -> None:
        if group != self._group:
            self._group, self._marks = group, {}
        self._marks[rank] = at
        self._world = world

    def _round(
        self, epoch: int, position: int, rank: int, world: int, batch_size: int
    ) -> Optional[Tuple[pa.Table, int]]:
        """This rank's share of the round at ``position`` and the position after it; None
        when the epoch has no round left there."""
        self._read_to(epoch, position + world * batch_size)
        bounds = self._round_bounds(epoch, position, world, batch_size)
        if bounds is None:
            return None
        share, end = bounds
        return self._rows(epoch, position + rank * share, share), end

    def _round_bounds(
        self, epoch: int, position: int, world: int, batch_size: int
    ) -> Optional[Tuple[int, int]]:
        """(rows per rank, position after) of the round at ``position`` (read to it)."""
        total = self._epoch_end(epoch)
        left = None if total is None else total - position
        if left is None or left >= world * batch_size:
            return batch_size, position + world * batch_size
        share = left // world
        return None if share == 0 else (share, position + world * share)

    def _epoch_end(self, epoch: int) -> Optional[int]:
        """The rows of ``epoch``, once read to its end (the dataset is deterministic: the
        count holds for every pass)."""
        return self.stats.epoch_rows.get(epoch)

    def _rows(self, epoch: int, first: int, count: int) -> pa.Table:
        pieces = []
        for e, offset, table in self._chunks:
            if e != epoch or offset + table.num_rows <= first or offset >= first + count:
                continue
            lo = max(first, offset) - offset
            hi = min(first + count, offset + table.num_rows) - offset
            pieces.append(table.slice(lo, hi - lo))
        return pa.concat_tables(pieces, promote_options="default").combine_chunks()

    # -- reading ------------------------------------------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` from its start; nothing held."""
        self._chunks: List[Tuple[int, int, pa.Table]] = []
        self._open(epoch)

    def _open(self, epoch: int) -> None:
        """The read head at the start of ``epoch`` (what is held stays)."""
        self._epoch, self._read, self._ended = epoch, 0, False
        self._batches: Iterator[pa.Table] = iter(self._epoch_batches(epoch))

    def _base(self) -> Position:
        """The first position held (the read head when nothing is)."""
        if self._chunks:
            epoch, offset, _ = self._chunks[0]
            return epoch, offset
        return self._epoch, self._read

    def _read_to(self, epoch: int, stop: int) -> None:
        """Read on until epoch ``epoch`` is read to row ``stop`` or to its end; a later
        epoch starts once the one being read has ended."""
        started = time.perf_counter()
        keep_from = min(self._marks.values(), default=(epoch, 0))
        if epoch > self._epoch and keep_from >= (epoch, 0):  # no rank wants the rows between
            self._start_epoch(epoch)
        while (self._epoch, self._read) < (epoch, stop):
            if self._ended:  # on to the next epoch, if asked
                if self._epoch == epoch:
                    break
                self._open(self._epoch + 1)
                continue
            table = next(self._batches, None)
            if table is None:
                self._ended = True
                self.stats.epoch_rows[self._epoch] = self._read
                continue
            offset, self._read = self._read, self._read + table.num_rows
            self.stats.rows_read += table.num_rows
            if (self._epoch, self._read) <= keep_from:
                self.stats.rows_skipped += table.num_rows
            elif table.num_rows:
                self._chunks.append((self._epoch, offset, table))
        self.stats.read_s += time.perf_counter() - started

    def _release(self) -> None:
        """Let go of the rows before every rank's last asked position (all of the group's
        ranks must have asked: one that has not may still need them)."""
        if len(self._marks) < self._world:
            return
        low = min(self._marks.values())
        while self._chunks:
            epoch, offset, table = self._chunks[0]
            if (epoch, offset + table.num_rows) > low:
                break
            self._chunks.pop(0)
