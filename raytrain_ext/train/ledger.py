"""Digests that let two runs be compared exactly.

``SampleLedger`` chains a SHA-256 over the sorted global sample indices that
the ranks actually consumed at each step, so two runs with equal digests
consumed the same samples at the same steps, whatever their world sizes.
``params_sha256`` hashes the full parameters in a canonical (sorted-name) order.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, Mapping

import numpy as np
import torch


class SampleLedger:
    """A ``Stateful`` hash chain over per-step consumed sample indices."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256(b"raytrain-ext samples v1").hexdigest()
        self.samples = 0
        self.steps = 0

    def record(self, step: int, consumed: np.ndarray) -> None:
        indices = np.sort(np.asarray(consumed, dtype=np.int64))
        h = hashlib.sha256(self.digest.encode())
        h.update(np.int64(step).tobytes())
        h.update(indices.tobytes())
        self.digest = h.hexdigest()
        self.samples += len(indices)
        self.steps += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"digest": self.digest, "samples": self.samples, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.digest, self.samples, self.steps = state["digest"], state["samples"], state["steps"]


def params_sha256(params: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of full fp32 parameters, by sorted name, including names and shapes."""
    h = hashlib.sha256()
    for name in sorted(params):
        tensor = params[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(tensor.shape)};".encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()
