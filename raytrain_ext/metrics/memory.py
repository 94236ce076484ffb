"""A rank's peak memory, reported with each step (``peak_memory_gb``)."""

from __future__ import annotations

import resource

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated on a GPU; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
