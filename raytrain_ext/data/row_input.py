"""The readers behind ``get_dataset_shard``: one Ray actor per dataset of a ``TorchTrainer``
run, started by ``fit`` (:mod:`raytrain_ext.user_loop.dataset_shard` is the ranks' side;
:mod:`raytrain_ext.data.row_reader` the order and the rounds)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any, Dict, List, Tuple

from raytrain_ext.data.row_reader import Rounds, RowReader

READER_PREFIX = "raytrain_ext.rows."


def reader_name(run: str, dataset: str) -> str:
    return f"{READER_PREFIX}{run}.{dataset}"


class RowReaderActor:
    """A dataset's reader, as a Ray actor (threaded: ranks ask concurrently).

    It is given the dataset as ``[ref]``, a reference the driver holds for the whole
    ``fit``: a reader restarted on another node (its own lost) builds itself from it again,
    where a dataset passed by value lives only as long as its first creation task."""

    def __init__(self, dataset_ref: List[Any]):
        import logging

        import ray

        from raytrain_ext.data.stream_input import ray_epoch_batches

        logging.getLogger("ray.data").setLevel(logging.ERROR)
        self.reader = RowReader(ray_epoch_batches(ray.get(dataset_ref[0])))

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
    import ray

    refs = [ray.put(dataset) for dataset in datasets.values()]
    handles = [
        ray.remote(RowReaderActor)
        .options(
            name=reader_name(run, name),
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=-1,
            max_concurrency=8,
        )
        .remote([ref])
        for name, ref in zip(datasets, refs, strict=True)
    ]
    return handles, refs
