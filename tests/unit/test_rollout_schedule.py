"""Which weights generate each GRPO step (raytrain_ext.rollout.schedule): the newest sync
point at or before ``s - 1 - lag`` (``lag`` 1 with ``rollout.overlap``), or a trainer
group's start off the schedule; a group that starts keeps the schedule when the service
still holds the weights its next ungenerated step needs, so it generates what the
uninterrupted run generated."""

import pytest

from raytrain_ext.rollout.schedule import WeightsSchedule


def test_every_step_is_generated_with_the_newest_sync_point_before_it():
    on_policy, every_3 = WeightsSchedule(1), WeightsSchedule(3)
    assert [on_policy.required(s) for s in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [every_3.required(s) for s in range(1, 9)] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert [s for s in range(8) if every_3.is_sync_point(s)] == [0, 3, 6]
    assert not on_policy.off_policy and every_3.off_policy
    # a resumed group anchored at step 4 generates 5 and 6 with its own start's weights
    assert [every_3.required(s, anchor=4) for s in range(5, 9)] == [4, 4, 6, 6]
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        WeightsSchedule(0)


def test_overlap_generates_each_step_with_the_weights_from_before_the_previous_update():
    overlap = WeightsSchedule(1, lag=1)
    assert overlap.off_policy
    assert [overlap.required(s) for s in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [WeightsSchedule(2, lag=1).required(s) for s in range(1, 8)] == [0, 0, 0, 2, 2, 4, 4]
    # a resumed run's first step: the weights before its previous update are gone
    assert overlap.required(5, anchor=4) == 4 and overlap.required(6, anchor=4) == 4


@pytest.mark.parametrize(
    ("schedule", "start", "anchor", "next_step", "held", "expected"),
    [
        (WeightsSchedule(3), 4, 0, 5, {3, 4}, 0),  # re-formed in place: step 3's still held
        (WeightsSchedule(3), 3, 0, 4, {3}, 0),  # at a sync point
        (WeightsSchedule(3), 4, 0, 5, {4}, 4),  # a resumed run's new service: anchor
        (WeightsSchedule(3), 4, 5, 5, {3, 4}, 0),  # an anchor on a branch the group has left
        (WeightsSchedule(3), 5, 4, 6, {4, 5}, 4),  # re-formed again after an anchor
        (WeightsSchedule(1, lag=1), 4, 0, 5, {2, 3, 4}, 0),  # overlap, in place
        (WeightsSchedule(1, lag=1), 4, 0, 6, {4}, 0),  # step 5 already generated
        (WeightsSchedule(1, lag=1), 4, 0, 5, {4}, 4),  # overlap, resumed
    ],
)
def test_a_group_start_keeps_the_schedule_only_when_its_weights_are_held(
    schedule, start, anchor, next_step, held, expected
):
    assert schedule.start(start, anchor, next_step, held) == expected
