"""The batch prefetcher: a cache keyed by indices that never changes what a step reads."""

import threading

import numpy as np
import pytest

from raytrain_ext.data.prefetch import BatchPrefetcher
from raytrain_ext.data.tokens import TokenDataset

SEQ = 8


def dataset():
    return TokenDataset(np.arange(1000, dtype=np.int32) % 97, SEQ)


def test_prefetched_batches_equal_synchronous_ones_and_run_on_the_thread():
    data, threads = dataset(), []

    def assemble(indices):
        threads.append(threading.current_thread().name)
        return data.batch(indices)

    prefetch = BatchPrefetcher(assemble)
    chunks = [np.array([3, 9]), np.array([40, 2]), np.array([7])]
    prefetch.ahead(chunks)
    for chunk in chunks:
        got, want = prefetch.take(chunk), data.batch(chunk)
        assert np.array_equal(got.inputs, want.inputs)
        assert np.array_equal(got.targets, want.targets)
        assert np.array_equal(got.indices, chunk)
    assert len(threads) == 3 and all(t.startswith("batch-prefetch") for t in threads)
    prefetch.close()


def test_unnamed_batches_are_dropped_and_unknown_ones_assembled_now():
    data, calls = dataset(), []

    def assemble(indices):
        calls.append(tuple(indices.tolist()))
        return data.batch(indices)

    prefetch = BatchPrefetcher(assemble)
    prefetch.ahead([np.array([1, 2])])
    prefetch.ahead([np.array([5, 6])])  # the step took another way: [1, 2] is dropped
    assert np.array_equal(prefetch.take(np.array([9])).indices, [9])  # never named
    assert np.array_equal(prefetch.take(np.array([5, 6])).indices, [5, 6])
    assert np.array_equal(prefetch.take(np.array([1, 2])).indices, [1, 2])  # assembled again
    assert (9,) in calls and calls.count((1, 2)) in (1, 2)
    prefetch.close()
    assert np.array_equal(prefetch.take(np.array([4])).indices, [4])  # closed: synchronous


def test_an_error_in_the_thread_is_raised_by_take():
    def assemble(indices):
        raise IndexError(f"sample {int(indices[0])} is out of range")

    prefetch = BatchPrefetcher(assemble)
    prefetch.ahead([np.array([12345])])
    with pytest.raises(IndexError, match="sample 12345"):
        prefetch.take(np.array([12345]))
    prefetch.close()


def test_disabled_prefetch_assembles_in_the_caller():
    data, threads = dataset(), []

    def assemble(indices):
        threads.append(threading.current_thread())
        return data.batch(indices)

    prefetch = BatchPrefetcher(assemble, enabled=False)
    prefetch.ahead([np.array([1])])
    assert threads == []
    prefetch.take(np.array([1]))
    assert threads == [threading.current_thread()]
