"""Which live ranks hand their state to a re-formed group (``live_state._sources``): pure,
from the all-gathered offers (step, (degree, index)); -1 is a rank holding nothing."""

from raytrain_ext.config import load_config
from raytrain_ext.parallel.dims import shards_from_replicas, state_from_peers
from raytrain_ext.train.live_state import _sources

NONE = (-1, (0, 0))


def test_a_whole_state_comes_from_the_lowest_rank_holding_the_newest_step():
    assert _sources([(4, (1, 0)), NONE, (5, (1, 0)), (5, (1, 0))], 1) == (5, [2])
    assert _sources([NONE, NONE], 1) is None


def test_every_shard_must_be_held_at_the_chosen_step():
    # 2 shards: step 6 only has shard 0, so step 5 (both shards) is chosen
    offers = [(6, (2, 0)), (5, (2, 1)), (5, (2, 0)), NONE]
    assert _sources(offers, 2) == (5, [2, 1])
    assert _sources([(5, (2, 0)), (5, (2, 0)), NONE, NONE], 2) is None  # shard 1 lost


def test_shards_of_another_degree_are_not_used():
    """A shrink changes ``dp_shard``: the old shards do not fit, the checkpoint is used."""
    assert _sources([(5, (2, 0)), (5, (2, 1))], 1) is None
    assert _sources([(5, (1, 0)), (5, (1, 0))], 2) is None


def test_which_layouts_hand_their_state_over():
    hsdp = ["parallel.strategy=fsdp", "parallel.dp_replicate=2", "scaling.num_workers=4"]
    assert shards_from_replicas(load_config(None, hsdp))
    assert not state_from_peers(load_config(None, hsdp))
    assert not shards_from_replicas(load_config(None, [*hsdp, "elastic.state_from_peers=false"]))
    assert not shards_from_replicas(load_config(None, ["parallel.strategy=fsdp"]))  # no replica
    assert state_from_peers(load_config(None, []))  # DDP: the whole state
