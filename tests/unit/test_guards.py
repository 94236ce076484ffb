"""In-run guards as pure decisions: straggler detection and the NaN/Inf policies (the same
decisions in the real loop: multiprocess/test_guards_in_training.py)."""

import math

import pytest

from raytrain_ext.train.guards import StragglerDetector, nonfinite_decision


def test_straggler_is_flagged_after_window_consecutive_slow_steps():
    detector = StragglerDetector(factor=1.5, window=3)
    assert detector.observe([0.10, 0.20]) == []
    assert detector.observe([0.10, 0.21]) == []
    assert detector.observe([0.11, 0.20]) == [1]  # third slow step in a row
    assert detector.observe([0.10, 0.10]) == []  # a normal step clears the flag
    assert detector.streaks == {0: 0, 1: 0}


def test_straggler_compares_with_peers_median_and_ignores_jitter():
    detector = StragglerDetector(factor=1.5, window=1)
    # against the median of all four (0.105) rank 3 would be 1.9x; against its peers' 0.10 it is 2x
    assert detector.observe([0.10, 0.10, 0.11, 0.20]) == [3]
    # 3x slower but only 2 ms more: millisecond steps jitter, that is not a straggler
    assert detector.observe([0.001, 0.001, 0.001, 0.003]) == []
    assert StragglerDetector(1.5, 1).observe([5.0]) == []  # alone: nobody to compare with


@pytest.mark.parametrize(
    "policy,so_far,rollback_possible,expected",
    [
        ("skip_step", 0, True, "skip"),
        ("rollback", 0, True, "rollback"),
        ("rollback", 0, False, "skip"),
        ("fail", 0, True, "fail"),
        ("skip_step", 3, True, "fail"),  # over guards.max_nan_steps=3
    ],
)
def test_nonfinite_decision(policy, so_far, rollback_possible, expected):
    decision = nonfinite_decision(policy, float("nan"), 1.0, so_far, 3, rollback_possible)
    assert decision.action == expected
    assert "loss nan" in decision.reason
    if so_far == 3:
        assert "4 non-finite steps exceed guards.max_nan_steps=3" in decision.reason
    assert nonfinite_decision(policy, 2.5, 0.7, 0, 3, True).action == "ok"
    assert (
        nonfinite_decision(policy, 2.5, math.inf, so_far, 3, rollback_possible).action == expected
    )
