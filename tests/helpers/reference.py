"""Uninterrupted reference runs, trained once per test session and shared by the tests.

A chaos test proves that a run which was killed, preempted, shrunk or resumed ends
where the uninterrupted run ends.  That run depends only on the training config,
not on Ray or on which test asks, so it is trained once (gloo processes, 2 unless told, no Ray)
and cached by its overrides.  ``test_worker_group`` asserts that the Trainer's
2-worker run on Ray and this 2-process run are bit-identical, which is what lets
Ray tests, multi-node tests and CLI tests compare against it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Dict, Tuple

from tests.helpers.dist import train_processes

_RUNS: Dict[Tuple[str, ...], dict] = {}


def uninterrupted(steps: int, *extra: str, world: int = 2) -> dict:
    """Rank 0's ``{"result", "params"}`` of the packaged default config trained for
    ``steps`` steps on ``world`` ranks (LR decaying over the same ``steps``), plus ``extra``."""
    overrides = (
        f"scaling.num_workers={world}",
        f"run.max_steps={steps}",
        f"optim.decay_steps={steps}",
        "checkpoint.enabled=false",
        "run.tensorboard=false",
        *extra,
    )
    if overrides not in _RUNS:
        with tempfile.TemporaryDirectory(prefix=f"raytrain-ext-reference-{steps}-") as tmp:
            out = Path(tmp)
            rank0 = train_processes(world, [f"run.output_dir={out}", *overrides], out)[0]
        _RUNS[overrides] = {"result": rank0["result"], "params": rank0["params"]}
    return _RUNS[overrides]
