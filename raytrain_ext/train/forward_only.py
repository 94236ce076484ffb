"""Forward passes outside training (evaluation, DPO's reference pass), in lock-step.

Sharded layouts (FSDP, TP, ZeRO-3) gather parameters inside every forward, so every
rank must run the same number of forwards even when its share of the samples is one
shorter than a peer's: :func:`lockstep_chunks` pads the short ranks with a repeat of a
real micro-batch whose result is discarded.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Tuple

import numpy as np
import torch

from raytrain_ext.data.sampler import rank_slice


def lockstep_chunks(count: int, ctx, micro_batch: int) -> Iterator[Tuple[np.ndarray, bool]]:
    """``(positions, real)`` micro-batches of this rank's share of ``range(count)``; the
    same number on every rank (``real`` False: a padding forward, discard its result)."""
    positions = rank_slice(np.arange(count), ctx.dp_rank, ctx.dp_size)
    chunks = math.ceil(math.ceil(count / ctx.dp_size) / micro_batch)
    for c in range(chunks):
        chunk = positions[c * micro_batch : (c + 1) * micro_batch]
        if len(chunk):
            yield chunk, True
        else:
            yield np.zeros(1, dtype=np.int64), False


@contextlib.contextmanager
def inference(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd, restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
