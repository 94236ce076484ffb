"""The readers behind ``get_dataset_shard``: one Ray actor per dataset of a ``TorchTrainer``
run, started by ``fit`` (:mod:`raytrain_ext.user_loop.dataset_shard` is the ranks' side;
:mod:`raytrain_ext.data.row_reader` the order and the rounds)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, Dict, Tuple

from raytrain_ext.data.reader_actor import start_reader
from raytrain_ext.data.row_reader import Rounds, RowReader

READER_PREFIX = "raytrain_ext.rows."


def reader_name(run: str, dataset: str) -> str:
    return f"{READER_PREFIX}{run}.{dataset}"


class RowReaderActor:
    """A dataset's reader, as a Ray actor (threaded: ranks ask concurrently).

    Started by :func:`raytrain_ext.data.reader_actor.start_reader`: a reader restarted on
    another node builds itself from the same dataset."""

    def __init__(self, dataset: Any):
        import logging

        from raytrain_ext.data.stream_input import ray_epoch_batches

        logging.getLogger("ray.data").setLevel(logging.ERROR)
        self.reader = RowReader(ray_epoch_batches(dataset))

    def take(self, epoch: int, start: int, **ask: Any) -> Rounds:
        return self.reader.take(epoch, start, **ask)

    def stats(self) -> Dict[str, Any]:
        """What it did, and where it runs (a test kills it there)."""
        import ray

        return {
            **asdict(self.reader.stats),
            "held_rows": self.reader.held_rows(),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }


def start_row_readers(run: str, datasets: Dict[str, Any]) -> Tuple[list, list]:
    """One reader per dataset of this ``fit``: (their handles, for ``fit`` to kill; the
    datasets' references, which ``fit`` holds until then)."""
    started = [
        start_reader(RowReaderActor, reader_name(run, name), dataset)
        for name, dataset in datasets.items()
    ]
    return [handle for handle, _ in started], [ref for _, ref in started]
