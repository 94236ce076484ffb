"""Where the time from ``fit`` to the end of the first step goes.

Why: a start that regresses should name its phase, as a step does (``train.step_clock``).
A run's start is a chain of moments, each written down where it happens: the driver
(checks done, Ray connected), the worker group (placed, formed), rank 0's process
(started, its imports done, its loop built) and rank 0's first step.  Each phase is the
time from the previous moment to its own.

Invariant: the phases add up to ``time_to_first_step_s`` exactly.  A moment that is
missing (a group formed in place before its first step), or that falls before the
previous one (a stocked process started before it was placed; a worker's clock on
another node), counts as the previous moment, so its phase is 0.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

# (phase, the moment that ends it), in order
START_PHASES = (
    ("preflight", "ray_connecting_at"),  # input checks, the run directory's attempt
    ("ray_start", "ray_connected_at"),  # ray.init: a local Ray's own start, or a connection
    ("placement", "placed_at"),  # memory tier, controller, the gang's placement group
    ("worker_process", "process_started_at"),  # the raylet starts rank 0's process
    ("worker_init", "init_started_at"),  # interpreter, import ray, the actor's creation
    ("imports", "imports_done_at"),  # torch and the loop (the setup hook's imports)
    ("rendezvous", "formed_at"),  # ranks assigned, rank 0's store, the process group
    ("build", "built_at"),  # fit dispatched: config, data, model, wrapper, restore
    ("first_step", "first_step_at"),  # the first step itself
)


def start_phases(started_at: float, marks: Mapping[str, float]) -> Dict[str, float]:
    """Seconds per phase of :data:`START_PHASES`, from ``started_at`` (``fit``'s start) to
    ``marks["first_step_at"]``."""
    return phase_chain(started_at, marks, START_PHASES)


def phase_chain(
    started_at: float, marks: Mapping[str, float], order: Sequence[Tuple[str, str]]
) -> Dict[str, float]:
    """Seconds per phase of ``order`` ((phase, the moment that ends it), ...), each from
    the previous moment (``started_at`` first) to its own; a moment missing, or before
    the previous one, counts as the previous one (its phase is 0).  The phases add up to
    the last moment minus ``started_at``."""
    phases: Dict[str, float] = {}
    previous = started_at
    for name, mark in order:
        at = max(marks.get(mark, previous), previous)
        phases[name] = at - previous
        previous = at
    return phases
