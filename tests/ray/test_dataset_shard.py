"""get_dataset_shard's iterator against a real reader actor on a single-node Ray: Ray
Data's batch formats and collate functions, drop_last, iter_rows, the position moving
through an epoch and to the next (a loop left early ends its epoch, as under Ray Train),
two ranks splitting each round, and arguments refused by name."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from raytrain_ext.data.row_input import reader_name, start_row_readers
from raytrain_ext.user_loop.dataset_shard import DatasetShard

pytestmark = pytest.mark.slow


@pytest.fixture
def reader(ray_local):
    import ray

    handles, refs = start_row_readers("shard-test", {"train": ray.data.range(22)})
    yield reader_name("shard-test", "train")
    for handle in handles:
        ray.kill(handle, no_restart=True)
    del refs


def shard(name, rank=0, world=1, position=(0, 0)):
    return DatasetShard("train", name, rank=rank, world=world, group="g", position=position)


def test_batch_formats_collate_and_rows(reader):
    one = shard(reader)
    batches = list(one.iter_batches(batch_size=8))
    assert [list(b["id"]) for b in batches] == [
        list(range(8)),
        list(range(8, 16)),
        list(range(16, 22)),
    ]
    assert one.position == (1, 0)  # the epoch ended: the next call starts the next one
    kinds = {
        "numpy": dict,
        "pandas": pd.DataFrame,
        "pyarrow": pa.Table,
    }
    for fmt, kind in kinds.items():
        assert all(isinstance(b, kind) for b in one.iter_batches(batch_size=8, batch_format=fmt))
    assert one.position == (4, 0)
    torch_batches = list(one.iter_torch_batches(batch_size=8, drop_last=True))
    assert [b["id"].tolist() for b in torch_batches] == [list(range(8)), list(range(8, 16))]
    summed = list(one.iter_torch_batches(batch_size=11, collate_fn=lambda b: int(np.sum(b["id"]))))
    assert summed == [sum(range(11)), sum(range(11, 22))]
    assert [r["id"] for r in one.iter_rows()] == list(range(22))


def test_two_ranks_split_each_round_and_leaving_early_ends_the_epoch(reader):
    ranks = [shard(reader, rank=r, world=2) for r in range(2)]
    taken = [[b["id"].tolist() for b in s.iter_torch_batches(batch_size=4)] for s in ranks]
    assert taken[0] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18]]
    assert taken[1] == [[4, 5, 6, 7], [12, 13, 14, 15], [19, 20, 21]]
    mid = shard(reader, position=(3, 10))  # resumed mid-epoch
    first = next(iter(mid.iter_batches(batch_size=4)))
    assert list(first["id"]) == [10, 11, 12, 13] and mid.position == (4, 0)  # left early


def test_what_would_tie_the_order_to_the_world_size_is_refused_by_name(reader):
    one = shard(reader)
    with pytest.raises(ValueError, match="local_shuffle_buffer_size.*random_shuffle"):
        next(iter(one.iter_batches(local_shuffle_buffer_size=100)))
    with pytest.raises(ValueError, match="batch_size=None"):
        next(iter(one.iter_batches(batch_size=None)))
    with pytest.raises(ValueError, match="batch_format='arrow'"):
        next(iter(one.iter_batches(batch_format="arrow")))
    assert one.position == (0, 0)  # nothing was taken
