"""How a dataset's reader actor is started, whichever reader it is (the stream reader of
``Trainer(dataset=...)``, the row readers of ``get_dataset_shard``).

Invariant: a reader restarted on another node (its own lost) builds itself again from the
same dataset.  The dataset therefore goes into the object store under a reference that
the driver holds for the whole ``fit`` (it is returned for that): a dataset passed by value
lives only as long as the first creation task, and the restart would fail.  The reader
holds no CPU of its own, Ray restarts it without limit and retries the asks it was
serving, and it serves several ranks at once.
"""

from __future__ import annotations

from typing import Any, Tuple

READER_CONCURRENCY = 8  # ranks asking one reader at once


def start_reader(actor_class: type, name: str, dataset: Any, *args: Any) -> Tuple[Any, Any]:
    """``actor_class(dataset, *args)`` as a named, restartable Ray actor: (its handle, for
    ``fit`` to kill; the dataset's reference, for ``fit`` to hold until then)."""
    import ray

    ref = ray.put(dataset)
    handle = (
        ray.remote(actor_class)
        .options(
            name=name,
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=-1,
            max_concurrency=READER_CONCURRENCY,
        )
        .remote(ref, *args)
    )
    return handle, ref
