"""Elastic policies are pure: decisions as data, checked without Ray."""

from raytrain_ext.elastic.policy import (
    Decision,
    FailurePolicy,
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
    assert fail.action == "fail" and "fewer than scaling.min_workers=2" in fail.reason


def test_failure_budget():
    assert FailurePolicy(0).allows(1) is False
    assert FailurePolicy(2).allows(2) and not FailurePolicy(2).allows(3)
    assert FailurePolicy(-1).allows(10**6)
    scaling = ScalingPolicy(1, 2)
    assert recovery_decision(1, 2, FailurePolicy(1), scaling).world_size == 2
    out = recovery_decision(2, 2, FailurePolicy(1), scaling)
    assert out.action == "fail" and "exceeds elastic.max_failures=1" in out.reason
