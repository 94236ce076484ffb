"""The global sampler: exactly-once consumption and world-size independence."""

import numpy as np
import pytest

from raytrain_ext.data import GlobalSampler, rank_slice
from raytrain_ext.data.sampler import epoch_order

N, G = 103, 12  # a prime sample count, so batches straddle epoch boundaries


def consume(sampler, steps, world_sizes):
    """Run `steps` steps, resizing per `world_sizes[step]`; return per-step rank shares."""
    shares = []
    for step in range(steps):
        batch = sampler.next_global_batch()
        world = world_sizes[step]
        shares.append([rank_slice(batch, r, world) for r in range(world)])
    return shares


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_rank_slices_partition_the_global_batch(world):
    batch = np.arange(100, 100 + G)
    parts = [rank_slice(batch, r, world) for r in range(world)]
    assert np.array_equal(np.concatenate(parts), batch)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_global_batches_do_not_depend_on_world_size():
    reference = [GlobalSampler(N, G, seed=7).next_global_batch() for _ in range(1)]
    runs = {}
    for world in range(1, 6):
        sampler = GlobalSampler(N, G, seed=7)
        shares = consume(sampler, 30, [world] * 30)
        runs[world] = [np.concatenate(s) for s in shares]
    for world in range(2, 6):
        assert all(np.array_equal(a, b) for a, b in zip(runs[1], runs[world], strict=False))
    assert np.array_equal(runs[1][0], reference[0])


def test_every_sample_once_per_epoch_across_resizes_and_a_resume():
    sizes = [4] * 5 + [3] * 4 + [1] * 3 + [5] * 20
    sampler = GlobalSampler(N, G, seed=3)
    shares = consume(sampler, 10, sizes)
    # resume mid-run on a fresh sampler (as after a restart on another world size)
    resumed = GlobalSampler(N, G, seed=3)
    resumed.load_state_dict(sampler.state_dict())
    shares += consume(resumed, 22, sizes[10:])
    consumed = np.concatenate([np.concatenate(step) for step in shares])
    assert len(consumed) == 32 * G
    full_epochs = len(consumed) // N
    for e in range(full_epochs):
        epoch = consumed[e * N : (e + 1) * N]
        assert sorted(epoch.tolist()) == list(range(N)), f"epoch {e} is not a permutation"
    tail = consumed[full_epochs * N :]
    assert len(set(tail.tolist())) == len(tail)  # the partial epoch repeats nothing


def test_epoch_orders_are_seeded_permutations():
    a, b = epoch_order(N, 1, 0, True), epoch_order(N, 1, 1, True)
    assert sorted(a) == list(range(N)) and not np.array_equal(a, b)
    assert np.array_equal(a, epoch_order(N, 1, 0, True))
    assert np.array_equal(epoch_order(N, 1, 0, False), np.arange(N))


def test_state_dict_refuses_a_different_dataset():
    sampler = GlobalSampler(N, G, seed=3)
    with pytest.raises(ValueError, match="resume with the same data.path"):
        GlobalSampler(N + 1, G, seed=3).load_state_dict(sampler.state_dict())


def test_peek_names_the_next_batch_without_advancing():
    sampler = GlobalSampler(N, G, seed=7)
    for _ in range(20):  # crosses epoch boundaries (N is prime)
        before = sampler.state_dict()
        peeked = sampler.peek_global_batch()
        assert sampler.state_dict() == before
        assert np.array_equal(peeked, sampler.next_global_batch())
