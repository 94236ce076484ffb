"""The held-out split of a run's data: which samples evaluation reads, and how many
leading samples remain for training (``train.evaluation`` evaluates on it).

Apart from the evaluation itself because the driver counts the training samples
(``inputs.text_data_check``) before Ray starts, without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from raytrain_ext.data.open import open_dataset


@dataclass
class EvalSplit:
    """What to evaluate on, and how many leading samples remain for training."""

    dataset: Optional[Any]
    indices: np.ndarray
    train_samples: int


def held_out_samples(cfg, num_samples: int) -> int:
    """How many of the last samples ``eval.fraction`` holds out of training (0 with
    ``data.eval_path``, which evaluates on its own data)."""
    if cfg.data.eval_path or cfg.eval.fraction == 0:
        return 0
    return max(1, int(num_samples * cfg.eval.fraction))


def split_eval(cfg, dataset) -> EvalSplit:
    e, n = cfg.eval, dataset.num_samples
    if cfg.data.eval_path:
        held_out = open_dataset(cfg, cfg.data.eval_path)
        return EvalSplit(held_out, _capped(np.arange(held_out.num_samples), e.max_samples), n)
    k = held_out_samples(cfg, n)
    if k:
        return EvalSplit(dataset, _capped(np.arange(n - k, n), e.max_samples), n - k)
    return EvalSplit(None, np.zeros(0, dtype=np.int64), n)


def _capped(indices: np.ndarray, cap: Optional[int]) -> np.ndarray:
    return indices if cap is None else indices[:cap]
