"""Prepared chat and preference shards as samples: examples packed whole into windows in
record order (also across shard files), prompt and padding weights 0, preference rows
chosen-then-rejected."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from raytrain_ext.data.examples import PackedExamples, PreferencePairs, pack_windows

PAD = 0


def _write(path: Path, columns: dict) -> Path:
    table = pa.table({k: pa.array(v, pa.list_(pa.int32() if "mask" not in k else pa.int8()))
                      for k, v in columns.items()})  # fmt: skip
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def test_windows_hold_whole_examples_in_order():
    assert pack_windows(np.array([3, 2, 4, 6, 1]), 6).tolist() == [0, 2, 3, 4, 5]
    assert pack_windows(np.array([9, 1]), 6).tolist() == [0, 1, 2]  # too long: own window


def test_packed_examples_across_two_shards(tmp_path):
    first = _write(
        tmp_path / "a.arrow", {"tokens": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [0, 1]]}
    )
    second = _write(tmp_path / "b.arrow", {"tokens": [[6, 7, 8, 9]], "loss_mask": [[0, 0, 1, 1]]})
    data = PackedExamples([first, second], seq_len=5, pad_id=PAD, source="test")
    assert data.num_samples == 2  # [1 2 3 4 5 | pad] and [6 7 8 9 | pad pad]
    batch = data.batch(np.array([1, 0]))
    assert batch.inputs.tolist() == [[6, 7, 8, 9, PAD], [1, 2, 3, 4, 5]]
    assert batch.targets.tolist() == [[7, 8, 9, PAD, PAD], [2, 3, 4, 5, PAD]]
    assert batch.weights.tolist() == [[0, 1, 1, 0, 0], [1, 1, 0, 1, 0]]
    assert data.target_weights(np.array([1, 0])).tolist() == [2.0, 3.0]
    spanning = PackedExamples([first, second], seq_len=9, pad_id=PAD, source="test")
    assert spanning.num_samples == 1  # one window reads across the two files
    assert spanning.batch(np.array([0])).inputs.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]


def test_preference_rows_are_chosen_then_rejected(tmp_path):
    shard = _write(
        tmp_path / "p.arrow",
        {
            "chosen": [[1, 2, 3], [4, 5, 6, 7]],
            "chosen_mask": [[0, 1, 1], [0, 0, 1, 1]],
            "rejected": [[1, 2, 9], [4, 5, 8, 8, 8]],
            "rejected_mask": [[0, 1, 1], [0, 0, 1, 1, 1]],
        },
    )
    data = PreferencePairs([shard], seq_len=3, pad_id=PAD, source="test")
    batch = data.batch(np.array([1, 0]))
    assert batch.pairs == 2 and batch.samples == 2
    assert batch.inputs.tolist() == [[4, 5, 6], [1, 2, 3], [4, 5, 8], [1, 2, 9]]
    assert batch.weights.tolist() == [[0, 1, 1], [1, 1, 0], [0, 1, 1], [1, 1, 0]]
    assert data.target_weights(np.array([1, 0])).tolist() == [1.0, 1.0]
