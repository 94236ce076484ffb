"""Elastic policies are pure: decisions as data, checked without Ray."""

import pytest

from raytrain_ext.elastic.policy import (
    Action,
    Budget,
    Decision,
    ScalingPolicy,
    recovery_decision,
    workers_that_fit,
)


def test_workers_that_fit_counts_whole_bundles_per_node():
    free = [{"CPU": 3.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 0.5}]
    assert workers_that_fit(free, {"CPU": 1, "GPU": 1}) == 3
    assert workers_that_fit(free, {"CPU": 2}) == 5
    assert workers_that_fit(free, {"CPU": 1, "GPU": 0}) == 11  # zero requests are ignored
    assert workers_that_fit([], {"CPU": 1}) == 0


def test_scaling_policy_uses_what_fits_within_bounds():
    policy = ScalingPolicy(min_workers=2, max_workers=4)
    assert policy.decide(8) == Decision("restart", "8 workers fit; using 4 (min 2, max 4)", 4)
    assert policy.decide(3).world_size == 3
    fail = policy.decide(1)
    assert fail.action is Action.FAIL and "fewer than scaling.min_workers=2" in fail.reason


def failures(limit):
    return Budget(limit, "elastic.max_failures")


def test_failure_budget():
    assert failures(0).allows(1) is False
    assert failures(2).allows(2) and not failures(2).allows(3)
    assert failures(-1).allows(10**6)
    scaling = ScalingPolicy(1, 2)
    assert recovery_decision(1, 2, failures(1), scaling).world_size == 2
    out = recovery_decision(2, 2, failures(1), scaling)
    assert out.action is Action.FAIL and out.reason == "failure 2 exceeds elastic.max_failures=1"


def test_grow_policy_waits_for_stable_capacity_and_the_cooldown():
    from raytrain_ext.elastic.policy import GrowPolicy

    grow = GrowPolicy(max_workers=4, cooldown_s=60.0, stable_s=10.0)
    assert grow.observe(100.0, 2, 2, last_reform_at=0.0) is None  # capacity first seen
    assert grow.observe(105.0, 2, 2, last_reform_at=0.0) is None  # not stable for 10 s yet
    assert grow.observe(110.0, 2, 5, last_reform_at=0.0) == 4  # stable; capped at max_workers
    assert grow.observe(111.0, 4, 1, last_reform_at=0.0) is None  # already at max


def test_grow_policy_ignores_a_flapping_node_and_respects_the_cooldown():
    from raytrain_ext.elastic.policy import GrowPolicy

    grow = GrowPolicy(max_workers=2, cooldown_s=60.0, stable_s=10.0)
    for t in range(0, 100, 8):  # the node appears for 6 s, vanishes for 2 s, again and again
        assert grow.observe(float(t), 1, 1, last_reform_at=0.0) is None
        assert grow.observe(t + 6.0, 1, 1, last_reform_at=0.0) is None
        assert grow.observe(t + 7.0, 1, 0, last_reform_at=0.0) is None
    assert grow.observe(200.0, 1, 1, last_reform_at=195.0) is None
    assert grow.observe(211.0, 1, 1, last_reform_at=195.0) is None  # stable, but cooling down
    assert grow.observe(255.0, 1, 1, last_reform_at=195.0) == 2


def test_preemption_budget_is_separate_from_failures():
    preemptions = Budget(2, "elastic.max_preemptions")
    assert Budget(-1, "elastic.max_preemptions").allows(1000)
    assert preemptions.allows(2) and not preemptions.allows(3)
    assert preemptions.spent(3, "preemption") == "preemption 3 exceeds elastic.max_preemptions=2"
    assert not failures(0).allows(1)  # a run with no failure budget can still be preempted


def test_node_probe_counts_nodes_proven_alive_without_pinging_them():
    """After a failure, the nodes whose ranks answered the controller's poll are alive; the
    capacity check counts them at once instead of waiting for a ping task to start there."""
    from raytrain_ext.ray_group.cluster import NodeProbe

    probe = NodeProbe(known_alive={"node-a"})
    probe.add(["node-a"])  # already known: no ping task is submitted (no Ray needed)
    assert probe.answered(timeout_s=0) == {"node-a"}


def test_failure_origin_is_the_dead_rank_not_the_peers_that_echo_it():
    import ray

    from raytrain_ext.checkpoint.peer_loss_latch import PeerLossLatch
    from raytrain_ext.errors.text import is_peer_loss, peer_loss_marker
    from raytrain_ext.ray_group.survivors import origin_of

    echo = RuntimeError(
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:39856"
    )
    dead = ray.exceptions.ActorDiedError()
    assert is_peer_loss(echo) and not is_peer_loss(ValueError("bad batch"))
    # an update refused because the save it waited for met the dead peer is an echo too
    latch = PeerLossLatch()
    with pytest.raises(RuntimeError), latch.watch():
        raise echo
    with pytest.raises(RuntimeError) as refused:
        latch.raise_if_tripped()
    assert peer_loss_marker(echo) == "Connection closed by peer"
    assert is_peer_loss(refused.value) and origin_of({0: refused.value, 2: dead}) == 2
    assert origin_of({0: echo}) is None  # only an echo so far: the origin has yet to report
    assert origin_of({0: echo, 2: dead}) == 2
    assert origin_of({0: echo, 1: ValueError("bad batch")}) == 1  # a rank's own error
    assert origin_of({3: dead, 1: ValueError("bad batch")}) == 3  # a dead process first
