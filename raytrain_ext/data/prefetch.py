"""Micro-batches assembled on a background thread ahead of the step that runs them.

Reading a batch (memory-mapped rows cut, padded and copied into one array) is Python
and numpy work; the forward and backward are torch kernels that release the GIL, so one
thread can assemble the next micro-batches while the current one computes.

Invariants:
- A cache keyed by the sample indices, never a guess that training depends on: ``take``
  returns the batch assembled for exactly these indices, or assembles it now.  The same
  indices give the same batch (the datasets are read-only), so a prefetched batch and a
  synchronous one are identical and prefetching cannot change the data order, the
  ledger or the numerics.
- Bounded: each ``ahead`` call drops what it no longer names, so at most the batches of
  two steps are held.
- The sampler is never advanced here; the loop names the upcoming indices from a copy of
  its position (:meth:`GlobalSampler.peek_global_batch`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Sequence

import numpy as np

from raytrain_ext.data.batch import Batch


class BatchPrefetcher:
    """``ahead`` names the micro-batches coming next; ``take`` hands one over."""

    def __init__(self, assemble: Callable[[np.ndarray], Batch], enabled: bool = True):
        self._assemble = assemble
        self._pending: Dict[bytes, Future] = {}
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
            if enabled
            else None
        )

    def ahead(self, upcoming: Sequence[np.ndarray]) -> None:
        """Start assembling ``upcoming`` in order; drop pending batches it does not name."""
        if self._pool is None:
            return
        keep = {_key(indices): indices for indices in upcoming}
        for key in [k for k in self._pending if k not in keep]:
            self._pending.pop(key).cancel()
        for key, indices in keep.items():
            if key not in self._pending:
                self._pending[key] = self._pool.submit(self._assemble, indices)

    def take(self, indices: np.ndarray) -> Batch:
        """The batch of ``indices``: prefetched (waiting for it if it is still being
        assembled) or assembled now.  An error in assembling it is raised here."""
        future = self._pending.pop(_key(indices), None)  # never a cancelled one
        if future is None:
            return self._assemble(indices)
        return future.result()

    def close(self) -> None:
        """Stop the thread; pending batches are dropped (nothing in them is state)."""
        if self._pool is not None:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _key(indices: np.ndarray) -> bytes:
    return np.ascontiguousarray(indices, dtype=np.int64).tobytes()
