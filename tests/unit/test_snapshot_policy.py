"""The per-step snapshot's default (``checkpoint.snapshot_policy``): on for own-shard
layouts, judged, and stopped when it stalls more than its limit of the steps' time."""

import pytest

from raytrain_ext.checkpoint.snapshot_policy import (
    JUDGED_EVERY,
    PROBE_SKIP,
    STALL_LIMIT,
    SnapshotPolicy,
)
from raytrain_ext.config import load_config
from raytrain_ext.parallel.dims import holds_own_shards


def probe(policy: SnapshotPolicy, stalls, step_s: float, others: float = 0.0):
    """One snapshot per stall of ``stalls`` (after the uncounted first ones), in steps of
    ``step_s``; each verdict's agreement takes the maximum of this rank's share and
    ``others`` (the other ranks'); (the values it was asked to agree on, the lines said)."""
    asked = []

    def agree(value: float) -> float:
        asked.append(value)
        return max(value, others)

    said = [policy.observe(9.0, 10.0, agree) for _ in range(PROBE_SKIP)]  # buffers allocated
    said += [policy.observe(stall, step_s, agree) for stall in stalls]
    return asked, [s for s in said if s]


@pytest.mark.parametrize(
    "strategy, extra, own",
    [
        ("fsdp", [], True),
        ("fsdp", ["parallel.tp=2"], True),
        ("ddp", ["parallel.pp=2"], True),
        ("ddp", [], False),
        ("fsdp", ["parallel.dp_replicate=2"], False),
        ("zero", [], False),
    ],
)
def test_the_default_follows_whether_a_rank_holds_shards_no_peer_holds(strategy, extra, own):
    cfg = load_config(None, [f"parallel.strategy={strategy}", *extra])
    assert cfg.checkpoint.snapshot_every_step is None
    assert holds_own_shards(cfg.parallel) is own
    policy = SnapshotPolicy(cfg.checkpoint.snapshot_every_step, own)
    assert policy.on is own and policy.judged is own


def test_a_cheap_snapshot_is_kept_after_one_agreement_every_judged_window():
    policy = SnapshotPolicy(None, own_shards=True)
    asked, said = probe(policy, [0.01] * (2 * JUDGED_EVERY + 1), step_s=0.5)
    assert asked == [pytest.approx(0.02)] * 2  # one all-reduce per window, the first ones aside
    assert policy.on and policy.judged and policy.verdict == pytest.approx(0.02)
    assert len(said) == 1 and "kept" in said[0] and "2.0% of the steps' time" in said[0]


def test_a_long_wait_counts_amortised_over_the_steps_it_is_spread_over():
    """A regular save's persist waited for once (3 s) after cheap snapshots: in the 20th
    of 20 steps of 0.5 s it is over the limit; in the 200th of 200 it is not."""
    policy = SnapshotPolicy(None, own_shards=True)
    probe(policy, [0.01] * (JUDGED_EVERY - 1) + [3.0], step_s=0.5)
    assert not policy.on
    policy = SnapshotPolicy(None, own_shards=True)
    probe(policy, [0.001] * (10 * JUDGED_EVERY - 1) + [3.0], step_s=0.5)
    assert policy.on and policy.verdict == pytest.approx((3.0 + 0.199) / 100)


def test_a_costly_snapshot_on_any_rank_stops_them_on_every_rank_naming_the_key():
    policy = SnapshotPolicy(None, own_shards=True)
    asked, said = probe(policy, [0.01] * (3 * JUDGED_EVERY), step_s=0.5, others=2 * STALL_LIMIT)
    assert not policy.on and not policy.judged and len(asked) == 1  # no verdict after a stop
    assert policy.verdict == pytest.approx(2 * STALL_LIMIT)
    assert len(said) == 1 and "stopped" in said[0]
    assert "checkpoint.snapshot_every_step=true" in said[0]


@pytest.mark.parametrize("setting", [True, False])
def test_an_explicit_setting_is_obeyed_unjudged(setting):
    policy = SnapshotPolicy(setting, own_shards=not setting)
    asked, said = probe(policy, [1.0] * (2 * JUDGED_EVERY), step_s=1.0)
    assert policy.on is setting and asked == [] and said == []
