"""Which training input a rank opens: the data's (``data.training_input``: files, a prepared
directory, a stream) or, for ``data.format: prompts``, the run's rollouts
(``rollout.step_input``, imported only then: it brings transformers)."""

from __future__ import annotations

from typing import Tuple

from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.training_input import TrainingInput, open_training_input


def open_run_input(cfg, part: Tuple[int, int]) -> TrainingInput:
    """``part``: this rank's (dp rank, dp size)."""
    if cfg.data.format == DataFormat.prompts:
        from raytrain_ext.rollout.step_input import open_rollout_input

        return open_rollout_input(cfg)
    return open_training_input(cfg, part)
