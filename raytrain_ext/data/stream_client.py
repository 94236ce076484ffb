"""A rank's side of a streamed dataset: the sampler and the dataset the loop reads.

The loop reads a stream through the same two interfaces as a dataset on disk:
:class:`StreamSampler` (``next_global_batch``, ``peek_global_batch``, ``Stateful``) and
:class:`StreamedDataset` (``batch``, ``target_weights``).  A sample's index is its position
in the stream (step ``s`` holds ``s*G .. s*G + G - 1``), so the ledger's digest is the
same for any world size, and a rank's slice of a step is its usual ``rank_slice``.

Invariants:
- The sampler's state is the step it is at and the fingerprint of the stream before it
  (:mod:`raytrain_ext.data.stream_reader`): checkpointed and handed over like any state,
  so a resumed, re-formed or restarted run continues at the same sample, and a dataset
  that changed under it is refused (:func:`check_position`).
- Steps are fetched from the reader ``data.stream_ahead_steps`` at a time (one round trip
  for several steps) and kept until the rank is past them; a lost reader is restarted by
  Ray and the call retried (the actor's ``max_task_retries``) within ``stream_timeout_s``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from raytrain_ext.data.batch import Batch
from raytrain_ext.data.stream_input import reader_name
from raytrain_ext.data.stream_reader import GENESIS, StepBatch, check_position
from raytrain_ext.errors import InputError


class StreamClient:
    """Steps of the run's reader, fetched ``ahead_steps`` at a time and cached (thread-safe:
    the loop and its prefetch thread ask)."""

    def __init__(
        self, path: str, timeout_s: float, ahead_steps: int = 16, part: Tuple[int, int] = (0, 1)
    ):
        """``part``: (dp rank, dp size): only this rank's share of each step travels."""
        self.name, self.timeout_s, self.ahead_steps = reader_name(path), timeout_s, ahead_steps
        self.part = part
        self._actor: Any = None
        self._cache: "OrderedDict[int, StepBatch]" = OrderedDict()
        self._lock = threading.Lock()
        self.fetch_s = 0.0

    def step(self, step: int) -> StepBatch:
        with self._lock:
            if step in self._cache:
                return self._cache[step]
        started = time.perf_counter()
        batches = self._fetch(step)
        with self._lock:
            self.fetch_s += time.perf_counter() - started
            for batch in batches:
                self._cache[batch.step] = batch
            while len(self._cache) > self.ahead_steps + 2:
                self._cache.popitem(last=False)
        return batches[0]

    def _fetch(self, step: int) -> List[StepBatch]:
        import ray

        if self._actor is None:
            self._actor = _find_actor(self.name, self.timeout_s)
        try:
            ask = self._actor.take.remote(step, self.ahead_steps, self.part)
            return ray.get(ask, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the stream reader {self.name} gave no step {step + 1} within "
                f"data.stream_timeout_s={self.timeout_s:g} s (its node lost for good, or the "
                "dataset's reads starved of CPUs); raise data.stream_timeout_s or leave the "
                "reads a CPU."
            ) from None


def _find_actor(name: str, timeout_s: float):
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(name)
        except ValueError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no stream reader named {name}: data.path names a reader that Trainer.fit "
                    "starts for Trainer(cfg, dataset=...); it cannot be given by hand."
                ) from None
            time.sleep(0.1)


class StreamSampler:
    """A ``Stateful`` cursor over the stream's steps (see the module doc)."""

    def __init__(self, client: StreamClient, global_batch_size: int):
        self.client, self.global_batch_size = client, global_batch_size
        self.step = 0
        self.fingerprint: Optional[str] = GENESIS  # of the stream before ``step``

    def next_global_batch(self) -> np.ndarray:
        """Advance by one step (fetching it, checking the position) and return its sample
        indices."""
        batch = self.client.step(self.step)
        check_position(batch, self.fingerprint)
        indices = self.peek_global_batch()
        self.step, self.fingerprint = self.step + 1, batch.digest
        return indices

    def peek_global_batch(self) -> np.ndarray:
        g = self.global_batch_size
        return np.arange(self.step * g, (self.step + 1) * g, dtype=np.int64)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "stream": True,
            "global_batch_size": self.global_batch_size,
            "step": self.step,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state.get("stream"):
            raise InputError(
                "data.ray_dataset: the checkpoint was trained on data.path or a materialised "
                "dataset, not on a stream; resume it with data.ray_dataset=materialise (or the "
                "same data.path), or start a new run.name"
            )
        if state["global_batch_size"] != self.global_batch_size:
            raise InputError(
                f"the checkpoint streamed global batches of {state['global_batch_size']} "
                f"samples, this run asks for data.global_batch_size={self.global_batch_size}; "
                "a stream resumes only with the same global batch size"
            )
        self.step, self.fingerprint = state["step"], state["fingerprint"]


class StreamedDataset:
    """Batches of the stream's samples by index (the loop's dataset interface)."""

    num_samples = 0  # unknown: a stream has no length; eval.fraction is refused for it

    def __init__(self, client: StreamClient, global_batch_size: int, path: str):
        self.client, self.global_batch_size, self.source = client, global_batch_size, path

    def _rows(self, indices: np.ndarray):
        """(the step, the rows of ``indices`` in its part); the indices lie in this rank's
        part of one step."""
        indices = np.asarray(indices, dtype=np.int64)
        step = int(indices[0]) // self.global_batch_size
        batch = self.client.step(step)
        return batch, indices - step * self.global_batch_size - batch.first

    def batch(self, indices: np.ndarray) -> Batch:
        from raytrain_ext.data.examples import rows_to_batch
        from raytrain_ext.data.tokens import windows_to_batch

        step, local = self._rows(indices)
        rows = step.rows[local]
        if rows.shape[1] == 2:  # preference: the chosen rows, then the rejected ones
            tokens = np.concatenate([rows[:, 0], rows[:, 1]]).astype(np.int64)
            assert step.mask is not None
            mask = np.concatenate([step.mask[local, 0], step.mask[local, 1]])
            return rows_to_batch(tokens, mask, indices, pairs=len(indices))
        if step.mask is not None:
            return rows_to_batch(rows[:, 0].astype(np.int64), step.mask[local, 0], indices)
        return windows_to_batch(rows[:, 0], indices, step.document_eos)

    def target_weights(self, indices: np.ndarray) -> np.ndarray:
        """The weights of any samples of one step (the loop asks for the whole step's)."""
        indices = np.asarray(indices, dtype=np.int64)
        step = int(indices[0]) // self.global_batch_size
        return self.client.step(step).weights[indices - step * self.global_batch_size]

    def max_token(self) -> int:
        return -1  # the reader checks every sample against model.vocab_size


def open_stream(cfg, part: Tuple[int, int] = (0, 1)):
    """(dataset, sampler) of the run's stream, for the data-parallel rank ``part`` = (dp rank,
    dp size)."""
    d = cfg.data
    client = StreamClient(d.path, d.stream_timeout_s, d.stream_ahead_steps, part)
    g = cfg.data.global_batch_size
    return StreamedDataset(client, g, d.path), StreamSampler(client, g)
