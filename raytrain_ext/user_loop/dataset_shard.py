"""``get_dataset_shard``: a rank's rows of ``TorchTrainer(datasets=...)``, exactly once.

``TorchTrainer.fit`` starts one reader actor per dataset (:mod:`raytrain_ext.data.row_input`:
named after the run and the dataset, no CPU of its own, restarted by Ray wherever it can
be), which reads the dataset in its own order (:mod:`raytrain_ext.data.row_reader`); each rank's
:class:`DatasetShard` asks it for its share of each round of batches.  The shard's
position (epoch, rows the group consumed) rides on every ``report`` and is committed with
each checkpoint, so:

- a re-formed group of any size resumes each dataset where the checkpoint it resumes from
  left it: the rows after that checkpoint are read again with the steps redone from it,
  and no row is lost or taken twice by the steps that stand;
- a restarted run (``fit`` again) resumes mid-epoch the same way;
- a group's ranks agree on the position at every report (``report`` refuses otherwise).

Each ``iter_*`` call iterates the rest of the current epoch, then moves the shard to the
next one; leaving the loop early ends the epoch there (as a new ``iter_batches`` call of
Ray Train's split starts a new epoch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

import pyarrow as pa

from raytrain_ext.data.row_reader import Position, Rounds

if TYPE_CHECKING:
    import torch

BATCH_FORMATS = ("default", "numpy", "pandas", "pyarrow")
ROUNDS_PER_ASK = 16  # batches fetched per round trip to the reader (per prefetch_batches)
ASK_BYTES = 32 * 2**20  # ... unless they hold more than this


class DatasetShard:
    """Rank ``rank``'s side of one dataset for one group: Ray Data's ``DataIterator``
    surface (``iter_batches``, ``iter_torch_batches``, ``iter_rows``) over the run's
    reader, from ``position``."""

    def __init__(
        self,
        name: str,
        reader: str,
        *,
        rank: int,
        world: int,
        group: str,
        position: Position = (0, 0),
        timeout_s: float = 600.0,
    ):
        self.name, self._reader_name = name, reader
        self.rank, self.world, self.group = rank, world, group
        self.position: Position = tuple(position)  # type: ignore[assignment]
        self.timeout_s = timeout_s
        self._reader: Any = None

    def iter_batches(
        self,
        *,
        prefetch_batches: int = 1,
        batch_size: Optional[int] = 256,
        batch_format: Optional[str] = "default",
        drop_last: bool = False,
        local_shuffle_buffer_size: Optional[int] = None,
        local_shuffle_seed: Optional[int] = None,
    ) -> Iterator[Any]:
        """The rest of this epoch's batches, each ``batch_size`` rows (the last one may be
        shorter, unless ``drop_last``), as ``batch_format`` (``default``: numpy)."""
        _refuse_local_shuffle(local_shuffle_buffer_size, local_shuffle_seed)
        if batch_format not in BATCH_FORMATS:
            raise ValueError(
                f"iter_batches(batch_format={batch_format!r}): one of {', '.join(BATCH_FORMATS)}"
            )
        convert = _formatter("numpy" if batch_format == "default" else batch_format)
        for table in self._tables(batch_size, prefetch_batches, drop_last):
            yield convert(table)

    def iter_torch_batches(
        self,
        *,
        prefetch_batches: int = 1,
        batch_size: Optional[int] = 256,
        dtypes: Any = None,
        device: Any = "auto",
        collate_fn: Optional[Callable[[Any], Any]] = None,
        drop_last: bool = False,
        local_shuffle_buffer_size: Optional[int] = None,
        local_shuffle_seed: Optional[int] = None,
        pin_memory: bool = False,
    ) -> Iterator[Any]:
        """As ``iter_batches``, each batch made torch tensors by Ray Data's own collate
        functions (``DefaultCollateFn``, or the given ``collate_fn``) and moved to
        ``device`` (``auto``: this rank's, ``get_device()``)."""
        import torch

        from raytrain_ext.user_loop.torch_utils import get_device

        _refuse_local_shuffle(local_shuffle_buffer_size, local_shuffle_seed)
        collate = _collate(collate_fn, dtypes)
        target = get_device() if device == "auto" else torch.device(device)
        for table in self._tables(batch_size, prefetch_batches, drop_last):
            yield _to_device(collate(table), target, pin_memory)

    def iter_rows(self) -> Iterator[Dict[str, Any]]:
        """The rest of this epoch's rows of this rank, one dict each."""
        for table in self._tables(256, 1, False):
            yield from table.to_pylist()

    def _tables(self, batch_size: Optional[int], prefetch: int, drop_last: bool):
        """This rank's share of each round left in the epoch; the position moves past a
        round as its table is handed out, and to the next epoch at the end (or when the
        caller leaves early)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"get_dataset_shard({self.name!r}): batch_size={batch_size!r}; give a positive "
                "number of rows (each rank's batch: the group takes world_size of them a round)"
            )
        epoch, start = self.position
        # one round trip for several batches (bounded in bytes), the next one in flight
        ask = dict(batch_size=batch_size, rounds=ROUNDS_PER_ASK * max(1, prefetch))
        ask["max_bytes"] = ASK_BYTES
        pending = self._ask(epoch, start, ask)
        try:
            while True:
                rounds = self._get(pending)
                if rounds.tables and not rounds.epoch_done:  # the next while this one trains
                    pending = self._ask(epoch, rounds.ends[-1], ask)
                for table, end in zip(rounds.tables, rounds.ends, strict=True):
                    if drop_last and table.num_rows < batch_size:
                        return
                    self.position = (epoch, end)
                    yield table
                if rounds.epoch_done or not rounds.tables:
                    return
        finally:
            self.position = (epoch + 1, 0)

    def _ask(self, epoch: int, start: int, ask: Dict[str, Any]) -> Any:
        if self._reader is None:
            import ray

            self._reader = ray.get_actor(self._reader_name)
        return self._reader.take.remote(
            epoch, start, rank=self.rank, world=self.world, group=self.group, **ask
        )

    def _get(self, pending: Any) -> Rounds:
        import ray

        try:
            return ray.get(pending, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"get_dataset_shard({self.name!r}): its reader gave no rows within "
                f"{self.timeout_s:g} s (parallel.timeout_s; its node lost for good, or the "
                "dataset's reads starved of CPUs: leave them a CPU)"
            ) from None

    def stats(self) -> str:
        return f"{self.name}: rank {self.rank} of {self.world}, at epoch/row {self.position}"


def _refuse_local_shuffle(buffer_size: Optional[int], seed: Optional[int]) -> None:
    if buffer_size is not None or seed is not None:
        raise ValueError(
            "get_dataset_shard: local_shuffle_buffer_size / local_shuffle_seed are not "
            "supported by raytrain_ext.train (a rank's local buffer would tie the order to "
            "the world size); shuffle the dataset itself with a seed "
            "(ds.random_shuffle(seed=...) or ds.randomize_block_order(seed=...))"
        )


def _formatter(batch_format: str) -> Callable[[pa.Table], Any]:
    from ray.data.block import BlockAccessor

    return lambda table: BlockAccessor.for_block(table).to_batch_format(batch_format)


def _collate(collate_fn: Optional[Callable[[Any], Any]], dtypes: Any) -> Callable[[pa.Table], Any]:
    """Ray Data's choice of input format for each kind of ``collate_fn``."""
    from ray.data.collate_fn import (
        ArrowBatchCollateFn,
        DefaultCollateFn,
        PandasBatchCollateFn,
    )

    if collate_fn is None:
        return DefaultCollateFn(dtypes=dtypes, combine_chunks=True)
    if isinstance(collate_fn, ArrowBatchCollateFn):
        return collate_fn
    if not callable(collate_fn):
        raise ValueError(f"iter_torch_batches(collate_fn=...): not callable: {collate_fn!r}")
    fmt = "pandas" if isinstance(collate_fn, PandasBatchCollateFn) else "numpy"
    convert = _formatter(fmt)
    return lambda table: collate_fn(convert(table))


def _to_device(batch: Any, device: "torch.device", pin: bool) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        if pin and device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=pin)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, pin) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device, pin) for v in batch)
    return batch


def shard_positions(shards: Dict[str, DatasetShard]) -> Dict[str, List[int]]:
    """Every dataset's position, as the commit record keeps it (JSON)."""
    return {name: list(shard.position) for name, shard in sorted(shards.items())}


def positions_of(record: Optional[Dict[str, Any]]) -> Dict[str, Tuple[int, int]]:
    """The positions a commit record holds (none: every dataset from its start)."""
    return {name: (int(e), int(r)) for name, (e, r) in (record or {}).items()}
