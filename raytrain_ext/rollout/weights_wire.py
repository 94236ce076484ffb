"""The policy's weights as they travel from the trainers to the engines: NumPy arrays.

Why: Ray serialises a torch tensor through torch's own pickling, which writes each
storage into a byte buffer and reads it back out on the other side.  Measured here (a
12 MB policy, 2 cores): the rollout service's hand-over of the weights to its engine took
17-65 ms per sync, on the path of every generation, and the trainers' push sat in their
step.  A NumPy array goes into the object store with one copy and is read from it in place
(Ray's zero-copy arrays): the hand-over took 0.1-12 ms.

How: each tensor travels as its bytes in a NumPy array of its own shape, with torch's
dtype by name; a dtype NumPy lacks (``bfloat16``, the float8 types) travels as the
integer array of the same width, its bits unchanged, and is viewed back on
arrival.

Invariant: ``from_wire(to_wire(state))`` equals ``state`` to the bit, on the CPU, for
every dtype; the arrays ``from_wire`` reads may be the object store's read-only memory,
so its tensors are only read (copied into a model), never written.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, Mapping

import numpy as np
import torch

# a dtype NumPy has no array of, by width: the integer type whose bits carry it
_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class WireTensor:
    """One tensor on the wire: torch's dtype by name, and its bytes as ``array``."""

    dtype: str
    array: np.ndarray


WireState = Dict[str, WireTensor]


def to_wire(state: Mapping[str, torch.Tensor]) -> WireState:
    """``state`` (any device) as CPU NumPy arrays, one copy from an accelerator."""
    return {name: _to_array(tensor) for name, tensor in state.items()}


def from_wire(wire: Mapping[str, WireTensor]) -> Dict[str, torch.Tensor]:
    """The tensors of ``wire``, over its arrays' memory (read them only)."""
    return {name: _from_array(t) for name, t in wire.items()}


def _to_array(tensor: torch.Tensor) -> WireTensor:
    t = tensor.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    try:
        return WireTensor(name, t.numpy())
    except TypeError:  # NumPy has no such dtype: its bits in an integer array
        return WireTensor(name, t.view(_CARRIER[t.element_size()]).numpy())


def _from_array(t: WireTensor) -> torch.Tensor:
    with warnings.catch_warnings():  # the object store's arrays are read-only; so are we
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(t.array)
    dtype = getattr(torch, t.dtype)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)
