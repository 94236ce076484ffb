"""A rank's training input: the dataset, its evaluation split and the global order over it,
from ``data.path`` (files, a prepared directory), from the run's stream
(``Trainer(cfg, dataset=...)`` streamed, :mod:`raytrain_ext.data.stream_client`); GRPO's
comes from the run's rollout service (:mod:`raytrain_ext.rollout.step_input`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from raytrain_ext.data.eval_split import EvalSplit, split_eval
from raytrain_ext.data.open import open_dataset
from raytrain_ext.data.sampler import GlobalOrder, GlobalSampler
from raytrain_ext.data.stream_client import open_stream
from raytrain_ext.data.stream_input import is_stream


@dataclass
class TrainingInput:
    dataset: Any  # batch(indices), target_weights(indices), max_token(), num_samples
    eval_split: EvalSplit
    order: GlobalOrder
    rollout: Optional[Any] = None  # GRPO: the dataset, a RolloutInput (the policy's way out)


def open_training_input(cfg, part: Tuple[int, int]) -> TrainingInput:
    """``part``: this rank's (dp rank, dp size); a stream sends each rank only its share."""
    if is_stream(cfg.data.path):  # the reader checks ids against the vocabulary itself
        dataset, order = open_stream(cfg, part)
        return TrainingInput(dataset, split_eval(cfg, dataset), order)
    dataset = open_dataset(cfg)
    max_token = dataset.max_token()
    if max_token >= cfg.model.vocab_size:
        raise ValueError(
            f"data.path {cfg.data.path} holds token id {max_token}, but "
            f"model.vocab_size is {cfg.model.vocab_size}; raise model.vocab_size"
        )
    split = split_eval(cfg, dataset)
    d = cfg.data
    order = GlobalSampler(split.train_samples, d.global_batch_size, d.seed, d.shuffle)
    return TrainingInput(dataset, split, order)
