"""The reader of a streamed dataset: records in, each step's global batch out.

One reader per run (a Ray actor, :mod:`raytrain_ext.data.stream_input`) iterates the
dataset and cuts its samples into global batches that every rank asks for by step number;
it lives apart from the worker group, so a rank's failure, a re-form, a shrink or a grow
leaves it (and what it has read) in place.

Invariants:
- **A world-size-independent order.** Epoch ``e`` is the dataset's rows in its own order
  (Ray Data's ``preserve_order``), packed into samples (:mod:`.stream_samples`), then, with
  ``shuffle_window`` W > 0, passed through a W-sample shuffle buffer drawn by
  ``PCG64([seed, e])``.  Step ``s`` is samples ``[s*G, (s+1)*G)`` of the epochs back to
  back (G = ``data.global_batch_size``): it never depends on who asks, or how many.
- **A fingerprint of the position.** ``digest[s]`` = SHA-256 of ``digest[s-1]`` and step
  ``s``'s token ids and weights.  A rank's state carries the digest of the last step it
  consumed; a reader that produces another value for it (after a restart, a resume, a
  lost reader) was fed other rows: the dataset is not deterministic, and that is refused.
- **Bounded memory.** Held: the steps a rank asked for at once (its ``ahead_steps``) and
  one before them (a re-formed group resumes at most one step behind its newest), the
  open shuffle buffer, and what Ray Data reads ahead.  Asked for a step before what it holds, the
  reader reads the dataset again from the start to it (hashing, not keeping, what it
  passes): Ray Data cannot start mid-dataset, and this keeps the order exact.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, Generator, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from raytrain_ext.data.sampler import rank_bounds
from raytrain_ext.data.stream_samples import Sample, SamplePacker
from raytrain_ext.errors import InputError

GENESIS = hashlib.sha256(b"raytrain-ext stream v1").hexdigest()
KEEP_BEHIND = 1

EpochBatches = Callable[[int], Iterable[pa.Table]]  # epoch -> that epoch's record batches


@dataclass
class StepBatch:
    """Step ``step``'s global batch, or one rank's part of it: ``rows`` ``[n, R, seq_len + 1]``
    int32 ids of the step's samples ``first .. first + n - 1``, ``mask`` (float32, same
    shape, or None), ``weights`` ``[G]`` of every sample of the step (the loss is normalised
    over the global batch); ``digest_before`` and ``digest`` fingerprint the stream up to
    the step before and up to this one."""

    step: int
    rows: np.ndarray
    mask: Optional[np.ndarray]
    weights: np.ndarray
    epoch: int
    digest_before: str
    digest: str
    document_eos: Optional[int] = None  # text under data.document_mask: the EOS id
    first: int = 0  # the step's sample ``rows[0]`` is

    def part(self, rank: int, size: int) -> "StepBatch":
        """Rank ``rank``'s contiguous share of the step (``rank_slice``'s), of ``size``."""
        start, stop = rank_bounds(len(self.weights), rank, size)
        mask = None if self.mask is None else self.mask[start:stop]
        return replace(self, rows=self.rows[start:stop], mask=mask, first=start)


def check_position(batch: StepBatch, expected_before: Optional[str]) -> None:
    """Raise InputError when the stream before ``batch`` is not what the run consumed
    (``expected_before``: the run state's fingerprint; None: nothing to compare with)."""
    if expected_before is None or expected_before == batch.digest_before:
        return
    raise InputError(
        f"Trainer(dataset=...): the dataset gave other rows than when this run read them "
        f"(the stream's fingerprint before step {batch.step + 1} is "
        f"{batch.digest_before[:16]}, the run's state says {expected_before[:16]}). A "
        "streamed dataset must be deterministic: the same rows in the same order on every "
        "execution (no unseeded random_shuffle, no changing files). Make it so, or start a "
        "new run.name."
    )


@dataclass
class ReaderStats:
    """What the reader did: for the run's record and the bench."""

    steps_produced: int = 0
    rereads: int = 0  # times it read the dataset again from the start
    skipped_steps: int = 0  # steps hashed, not kept, while reading to a position
    skip_s: float = 0.0
    produce_s: float = 0.0


class StreamReader:
    """Steps of the global order, asked for by number (see the module doc).  Thread-safe:
    ranks ask concurrently; one of them produces, the others find the step held."""

    def __init__(
        self,
        epoch_batches: EpochBatches,
        make_packer: Callable[[], SamplePacker],
        global_batch_size: int,
        vocab_size: int,
        seed: int = 0,
        shuffle_window: int = 0,
        document_eos: Optional[int] = None,
        allow_repeat: bool = False,
    ):
        self._epoch_batches, self._make_packer = epoch_batches, make_packer
        self.global_batch_size, self.vocab_size = global_batch_size, vocab_size
        self.seed, self.shuffle_window = seed, shuffle_window
        self.document_eos, self.allow_repeat = document_eos, allow_repeat
        self._lock = threading.Lock()
        self._failed: Optional[BaseException] = None
        self._held: Dict[int, StepBatch] = {}
        self.stats = ReaderStats()
        self._restart()

    def take(
        self, first: int, count: int = 1, part: Optional[Tuple[int, int]] = None
    ) -> List[StepBatch]:
        """Steps ``first .. first + count - 1`` (0-based), produced now unless held, whole or
        ``part`` = (rank, size)'s share; the steps more than ``KEEP_BEHIND`` before ``first``
        are let go."""
        with self._lock:
            if self._failed is not None:  # the dataset raised: every ask gets that error
                raise self._failed
            if first not in self._held and first < self._next_step:  # before the held ones
                self._samples.close()  # ends the current pass's Ray Data execution
                self._restart()
                self.stats.rereads += 1
            self._produce_to(first + count - 1, keep_from=first - KEEP_BEHIND)
            for old in [s for s in self._held if s < first - KEEP_BEHIND]:
                del self._held[old]
            batches = [self._held[s] for s in range(first, first + count)]
        return batches if part is None else [b.part(*part) for b in batches]

    def warm(self) -> None:
        """Read the first step ahead of any ask (nothing when asks came first)."""
        with self._lock:
            if self._next_step == 0 and self._failed is None:
                self._produce_to(0, keep_from=0)

    def close(self) -> None:
        """Stop reading (Ray Data's iteration ends with the sample stream)."""
        with self._lock:
            self._samples.close()
            self._held.clear()

    def held_steps(self) -> List[int]:
        with self._lock:
            return sorted(self._held)

    def _restart(self) -> None:
        """Back to the start of epoch 0 (nothing produced yet)."""
        self._next_step, self._digest, self._epoch = 0, GENESIS, 0
        self._samples: Generator[Sample, None, None] = self._sample_stream()
        self._held.clear()

    def _produce_to(self, last: int, keep_from: int) -> None:
        """Read on to step ``last``; what lies before ``keep_from`` is hashed, not kept."""
        started, skipping = time.perf_counter(), self._next_step < keep_from
        while self._next_step <= last:
            try:
                batch = self._next_batch(keep=self._next_step >= keep_from)
            except InputError as e:  # the data itself is wrong: every later ask gets it
                self._failed = e
                raise
            except Exception:  # a read failed (S3, a task): the next ask reads again
                self._restart()
                raise
            if batch is not None:
                self._held[batch.step] = batch
            else:
                self.stats.skipped_steps += 1
        elapsed = time.perf_counter() - started
        if skipping:
            self.stats.skip_s += elapsed
        else:
            self.stats.produce_s += elapsed

    def _next_batch(self, keep: bool) -> Optional[StepBatch]:
        """The next step's samples, fingerprinted; returned only when ``keep``."""
        samples = [next(self._samples) for _ in range(self.global_batch_size)]
        rows = np.stack([s.rows for s in samples]).astype(np.int32)
        masks = [s.mask for s in samples]
        mask = None if masks[0] is None else np.stack(masks).astype(np.float32)
        weights = np.array([s.weight for s in samples], dtype=np.float64)
        h = hashlib.sha256(self._digest.encode())
        h.update(rows.tobytes())
        h.update(weights.tobytes())
        if mask is not None:
            h.update(mask.tobytes())
        before, self._digest = self._digest, h.hexdigest()
        step, self._next_step = self._next_step, self._next_step + 1
        self.stats.steps_produced += 1
        if not keep:
            return None
        return StepBatch(
            step, rows, mask, weights, self._epoch, before, self._digest, self.document_eos
        )

    def _sample_stream(self) -> Generator[Sample, None, None]:
        """Every epoch's samples, back to back, each through its shuffle buffer."""
        epoch = 0
        while True:
            self._epoch = epoch
            count = 0
            for sample in self._shuffled(self._epoch_samples(epoch), epoch):
                count += 1
                yield sample
            if count == 0:
                raise InputError(
                    "Trainer(dataset=...): the dataset yields no complete sample (no rows, or "
                    "fewer tokens than model.seq_len + 1); give it more rows or shorten "
                    "model.seq_len."
                )
            if count < self.global_batch_size and not self.allow_repeat:
                raise InputError(
                    f"Trainer(dataset=...): the dataset yields {count} samples, fewer than one "
                    f"global batch (data.global_batch_size={self.global_batch_size}), so every "
                    "step would repeat samples; give it more rows, lower "
                    "data.global_batch_size, or set data.allow_repeat=true."
                )
            epoch += 1

    def _epoch_samples(self, epoch: int) -> Iterator[Sample]:
        packer = self._make_packer()
        for table in self._epoch_batches(epoch):
            for sample in packer.add(table):
                yield self._checked(sample)
        for sample in packer.end_epoch():
            yield self._checked(sample)

    def _checked(self, sample: Sample) -> Sample:
        top = int(sample.rows.max())
        if top >= self.vocab_size or int(sample.rows.min()) < 0:
            raise InputError(
                f"Trainer(dataset=...): the dataset holds token id {top}, but model.vocab_size "
                f"is {self.vocab_size}; raise model.vocab_size (ids must be in [0, vocab_size))."
            )
        return sample

    def _shuffled(self, samples: Iterator[Sample], epoch: int) -> Iterator[Sample]:
        """``samples`` through a seeded buffer of ``shuffle_window`` (0: in order)."""
        if self.shuffle_window <= 1:
            yield from samples
            return
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        buffer: List[Sample] = []
        for sample in samples:
            buffer.append(sample)
            if len(buffer) == self.shuffle_window:
                yield _pop_random(buffer, rng)
        while buffer:
            yield _pop_random(buffer, rng)


def _pop_random(buffer: List[Sample], rng: np.random.Generator) -> Sample:
    j = int(rng.integers(len(buffer)))
    buffer[j], buffer[-1] = buffer[-1], buffer[j]
    return buffer.pop()
