"""The reader behind ``get_dataset_shard`` without Ray: a world-size-independent order
of rows, equal shares at an epoch's end, a group of another size resuming at a position,
re-reads, and bounded memory."""

from typing import List

import pyarrow as pa
import pytest

from raytrain_ext.data.row_reader import RowReader


def dataset(rows: int, block_sizes=(5, 3, 7)):
    """Epoch batches of ``rows`` ids in uneven blocks (as Ray Data's blocks are); counts
    how many times an epoch was read."""
    opened: List[int] = []

    def epoch_batches(epoch: int):
        opened.append(epoch)
        start, i = 0, 0
        while start < rows:
            size = block_sizes[i % len(block_sizes)]
            yield pa.table({"id": list(range(start, min(rows, start + size)))})
            start, i = start + size, i + 1

    return epoch_batches, opened


def take_epoch(reader, epoch, start, world, batch, group="g", rounds=2):
    """Every rank's batches from ``(epoch, start)`` to the epoch's end: {rank: [ids...]},
    and the positions after each round."""
    got = {r: [] for r in range(world)}
    position, ends = start, []
    while True:
        per_rank = [
            reader.take(
                epoch, position, rank=r, world=world, batch_size=batch, rounds=rounds, group=group
            )
            for r in range(world)
        ]
        for r, taken in enumerate(per_rank):
            got[r] += [t.column("id").to_pylist() for t in taken.tables]
        assert len({len(t.tables) for t in per_rank}) == 1  # the same number of batches
        ends += per_rank[0].ends
        if per_rank[0].tables:
            position = per_rank[0].ends[-1]
        if per_rank[0].epoch_done or not per_rank[0].tables:
            return got, ends


def test_rounds_split_the_dataset_in_order_with_ray_trains_equal_shares():
    """23 rows, 2 ranks, batches of 4: two full rounds, then 7 rows left: 3 each, and the
    seventh is not handed out, as streaming_split(equal=True) leaves it."""
    epoch_batches, _ = dataset(23)
    got, ends = take_epoch(RowReader(epoch_batches), 0, 0, world=2, batch=4)
    assert got[0] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18]]
    assert got[1] == [[4, 5, 6, 7], [12, 13, 14, 15], [19, 20, 21]]
    assert ends == [8, 16, 22]


def test_a_group_of_another_size_resumes_at_the_position_and_every_row_is_taken_once():
    epoch_batches, _ = dataset(60)
    reader = RowReader(epoch_batches)
    three = [
        reader.take(0, 0, rank=r, world=3, batch_size=4, rounds=2, group="a") for r in range(3)
    ]
    position = three[0].ends[-1]  # 24 rows taken by a group of 3
    rest, _ = take_epoch(reader, 0, position, world=2, batch=4, group="b")
    seen = [i for t in three for table in t.tables for i in table.column("id").to_pylist()]
    seen += [i for batches in rest.values() for batch in batches for i in batch]
    assert sorted(seen) == list(range(60))  # 60 = 24 + 4 rounds of 8 + 2 x 2: none dropped


def test_the_next_epoch_repeats_the_order_and_a_rewind_reads_the_epoch_again():
    epoch_batches, opened = dataset(30)
    reader = RowReader(epoch_batches)
    first, _ = take_epoch(reader, 0, 0, world=2, batch=3)
    second, _ = take_epoch(reader, 1, 0, world=2, batch=3)
    assert first == second and opened == [0, 1]
    assert reader.stats.epoch_rows == {0: 30, 1: 30}
    again, _ = take_epoch(reader, 1, 12, world=2, batch=3, group="rewound")
    assert again[0] == first[0][2:] and again[1] == first[1][2:]
    assert reader.stats.rereads == 1 and opened == [0, 1, 1]
    assert reader.stats.rows_skipped > 0  # rows before the position: read, not kept


def test_rows_every_rank_is_past_are_let_go():
    epoch_batches, _ = dataset(1000, block_sizes=(10,))
    reader = RowReader(epoch_batches)
    take_epoch(reader, 0, 0, world=2, batch=8, rounds=1)
    assert reader.stats.rows_handed_out == 1000
    assert reader.held_rows() <= 2 * 8 + 10  # one round and a block, not the epoch


def test_a_resume_at_a_later_epoch_does_not_read_the_epochs_before_it():
    epoch_batches, opened = dataset(20)
    got, _ = take_epoch(RowReader(epoch_batches), 3, 10, world=1, batch=5)
    assert got[0] == [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19]] and opened == [3]


def test_an_empty_dataset_gives_no_batch_and_bad_asks_are_refused():
    epoch_batches, _ = dataset(0)
    reader = RowReader(epoch_batches)
    taken = reader.take(0, 0, rank=0, world=2, batch_size=4, rounds=1, group="g")
    assert taken.tables == [] and taken.epoch_done
    with pytest.raises(ValueError, match="rank 2 of 2"):
        reader.take(0, 0, rank=2, world=2, batch_size=4, rounds=1, group="g")


def test_an_ask_stops_at_its_byte_budget_but_gives_one_round_at_least():
    epoch_batches, _ = dataset(100)
    reader = RowReader(epoch_batches)
    ask = dict(rank=0, world=1, batch_size=4, rounds=10, group="g")
    assert len(reader.take(0, 0, max_bytes=1, **ask).tables) == 1
    assert len(reader.take(0, 4, **ask).tables) == 10
