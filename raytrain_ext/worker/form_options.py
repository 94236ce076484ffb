"""How a worker group forms, shared by the group and the controller's port to it.

Its own module so that the controller's seam (``elastic.group_port``) names it without
importing Ray or torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FormOptions:
    """How a group forms: ``backend`` ("auto": NCCL on GPUs, gloo otherwise), the timeout
    of its rendezvous and collectives, and how long placing its gang may take."""

    backend: str
    timeout_s: float
    placement_timeout_s: float
