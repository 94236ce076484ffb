"""Python's cyclic garbage collector paused where a burst of allocations makes it cost.

Why: a full collection walks every object the process tracks, and the collector runs one
each time enough new objects have survived.  In a process that has imported torch that
walk takes 0.1-0.25 s, and a burst of allocations triggers several: a restore's DCP
metadata and plans (0.22-0.29 s of a 0.6 s restore of 292 MB, ``checkpoint.restore``), a
rank's imports of torch, DCP and the loop (six full collections, 0.5-0.8 s of 2.0-2.3 s
here, ``worker.process_pool``).

Invariant: reference counting still frees every object that is not in a cycle; what a
paused burst leaves in cycles is freed by the first collection after it, or, after
``gc.freeze()``, kept for the process's life (the imports leave about 8,000 such
objects, 7 MiB).  Torch-free, so a module the driver imports can use it.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collection_paused() -> Iterator[None]:
    """The collector off inside the block, and back on after it only when it was on
    before (a caller that had turned it off keeps it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
