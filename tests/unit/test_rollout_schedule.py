"""Which weights generate each GRPO step (raytrain_ext.rollout.schedule): the newest sync
point before it, or a trainer group's start off the schedule; a group re-formed between
sync points keeps the engines' weights when they are the schedule's, so it generates what
the uninterrupted run generated."""

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


@pytest.mark.parametrize(
    ("held", "start", "anchor", "expected"),
    [
        (3, 4, 0, (True, 0)),  # re-formed in place between sync points: keep step 3's
        (3, 3, 0, (True, 0)),  # at a sync point whose weights the engines have
        (-1, 4, 0, (False, 4)),  # a resumed run's new engines: anchor at the start
        (6, 4, 0, (False, 4)),  # set back past the engines' weights
        (4, 5, 4, (True, 4)),  # re-formed again after an anchor: it still holds
        (6, 4, 5, (False, 4)),  # an anchor on a branch the group has left counts for nothing
        (0, 2, 0, (True, 0)),
    ],
)
def test_a_group_start_keeps_the_engines_weights_only_when_they_are_the_schedules(
    held, start, anchor, expected
):
    assert WeightsSchedule(3).start(held, start, anchor) == expected
