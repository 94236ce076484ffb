"""The global sample order that makes training exactly-once under resizing.

Invariants:
- The order of epoch ``e`` is a permutation of ``range(num_samples)`` that
  depends only on ``(seed, e)``; it never depends on the world size.
- Step ``s`` consumes the next ``global_batch_size`` positions of that order
  (crossing into the next epoch's order when an epoch runs out), so the global
  batch of a step is the same for any number of workers.
- A rank's share is a contiguous slice of the global batch; the slices of all
  ranks partition it exactly (sizes differ by at most one when the batch does
  not divide evenly), so every sample is consumed once.
- All ranks run identical samplers in lock-step: no communication is needed.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, Optional, Protocol

import numpy as np


class GlobalOrder(Protocol):
    """What the loop reads its steps' sample indices from: this module's
    :class:`GlobalSampler` over a dataset on disk, or a stream's
    (:class:`raytrain_ext.data.stream_client.StreamSampler`).  ``fingerprint``: a digest of
    the content consumed so far, where the indices alone do not name it (a stream); None
    for a dataset whose indices do."""

    fingerprint: Optional[str]

    def next_global_batch(self) -> np.ndarray: ...

    def peek_global_batch(self) -> np.ndarray: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


class GlobalSampler:
    """A ``Stateful`` cursor over per-epoch permutations of sample indices."""

    fingerprint: Optional[str] = None  # the indices name the samples (``GlobalOrder``)

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(
                "the dataset has no complete sample; use a longer corpus or a shorter model.seq_len"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.num_samples, self.seed, epoch, self.shuffle)

    def next_global_batch(self) -> np.ndarray:
        """Advance by one step and return its ``global_batch_size`` sample indices."""
        parts = []
        needed = self.global_batch_size
        while needed:
            order = self.epoch_order(self.epoch)
            take = min(needed, self.num_samples - self.cursor)
            parts.append(order[self.cursor : self.cursor + take])
            self.cursor += take
            needed -= take
            if self.cursor == self.num_samples:
                self.epoch, self.cursor = self.epoch + 1, 0
        return np.concatenate(parts)

    def peek_global_batch(self) -> np.ndarray:
        """The indices the next :meth:`next_global_batch` returns, without advancing."""
        epoch, cursor = self.epoch, self.cursor
        try:
            return self.next_global_batch()
        finally:
            self.epoch, self.cursor = epoch, cursor

    def state_dict(self) -> Dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume the global order; the world size may differ from the saver's."""
        if state.get("stream"):
            from raytrain_ext.errors import InputError

            raise InputError(
                "data.ray_dataset: the checkpoint was trained on a streamed dataset; resume it "
                "with Trainer(cfg, dataset=...) streamed (data.ray_dataset=stream or auto), or "
                "start a new run.name"
            )
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples with seed {state['seed']}, "
                f"but this run has {self.num_samples} samples with seed {self.seed}; resume with "
                "the same data.path, model.seq_len and data.seed"
            )
        self.shuffle = state["shuffle"]
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]


def rank_slice(global_batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's contiguous share; shares of ranks 0..world_size-1 partition the batch."""
    start, stop = rank_bounds(len(global_batch), rank, world_size)
    return global_batch[start:stop]


def rank_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, stop) of this rank's share of ``size`` samples (sizes differ by at most one)."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@lru_cache(maxsize=4)
def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    order = rng.permutation(num_samples).astype(np.int64)
    order.setflags(write=False)
    return order
