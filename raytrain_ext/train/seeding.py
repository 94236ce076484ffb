"""Where a rank's random numbers come from: seeded from the run's seed, the step and the
rank, never carried as generator state, so a rank that takes over a step (a replacement
process, state handed over by peers) draws exactly what the lost rank would have drawn."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch


def seed_everything(seed: int, device: Optional[torch.device] = None) -> None:
    """Seed Python's, numpy's and torch's generators: the CPU one, and CUDA's when the
    rank computes there.  Not ``torch.manual_seed``: where CUDA is not initialised it
    captures the caller's stack on every call to queue CUDA's seeding for later (0.08 ms
    a step here, seen in the step's profile), which a CPU run never runs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.random.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` for ``step``: a function of where training stands, so a
    rank that takes over a step (a replacement process, state handed over by peers)
    draws exactly what the lost rank would have drawn, with no RNG state carried."""
    return (seed * 1_000_003 + step) * 10_007 + rank
