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
    assert [s for s in range(8) if every_3.pushes_after(s)] == [0, 3, 6]
    assert [s for s in range(5) if on_policy.pushes_after(s)] == [0, 1, 2, 3, 4]
    assert not on_policy.off_policy and every_3.off_policy
    # a resumed group anchored at step 4 generates 5 and 6 with its own start's weights
    assert [every_3.required(s, anchor=4) for s in range(5, 9)] == [4, 4, 6, 6]
    with pytest.raises(ValueError, match="sync_every and iterations must be >= 1"):
        WeightsSchedule(0)


def test_with_num_iterations_each_generation_is_named_by_its_first_step():
    twice = WeightsSchedule(1, iterations=2)  # TRL's num_iterations=2
    assert twice.off_policy
    assert [twice.key(s) for s in range(1, 7)] == [1, 1, 3, 3, 5, 5]
    assert [twice.required(g) for g in (1, 3, 5)] == [0, 2, 4]  # on-policy when generated
    assert [s for s in range(6) if twice.pushes_after(s)] == [0, 2, 4]  # none in between
    # resumed after step 3, mid-generation, without its result: step 3's weights generate it
    assert twice.required(3, anchor=3) == 3 and twice.required(5, anchor=3) == 4
    overlap = WeightsSchedule(1, lag=1, iterations=2)
    assert [overlap.required(g) for g in (1, 3, 5)] == [0, 1, 3]
    assert [s for s in range(6) if overlap.pushes_after(s)] == [0, 1, 3, 5]


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
        (WeightsSchedule(3), 4, 0, 5, {3, 4}, (True, 0)),  # re-formed in place: 3's held
        (WeightsSchedule(3), 3, 0, 4, {3}, (True, 0)),  # at a sync point
        (WeightsSchedule(1), 4, 0, 6, {3, 4}, (True, 0)),  # 5 prefetched: 6 needs 5, pushed later
        (WeightsSchedule(1), 0, 0, 1, {0}, (True, 0)),  # the run's start
        (WeightsSchedule(3), 4, 0, 5, {4}, (False, 4)),  # a resumed run's new service: anchor
        (WeightsSchedule(3), 4, 5, 5, {3, 4}, (True, 0)),  # an anchor on a branch left behind
        (WeightsSchedule(3), 5, 4, 6, {4, 5}, (True, 4)),  # re-formed again after an anchor
        (WeightsSchedule(1, lag=1), 4, 0, 5, {2, 3, 4}, (True, 0)),  # overlap, in place
        (WeightsSchedule(1, lag=1), 4, 0, 6, {4}, (True, 0)),  # step 5 already generated
        (WeightsSchedule(1, lag=1), 4, 0, 5, {4}, (False, 4)),  # overlap, resumed
        (WeightsSchedule(1, iterations=2), 4, 0, 5, {3, 4}, (True, 0)),  # between generations
        (WeightsSchedule(1, iterations=2), 3, 0, 3, {2, 3}, (True, 0)),  # mid-generation
        (WeightsSchedule(1, iterations=2), 3, 0, 3, {3}, (False, 3)),  # mid-generation, resumed
    ],
)
def test_a_group_start_keeps_the_schedule_only_when_its_weights_are_held(
    schedule, start, anchor, next_step, held, expected
):
    assert schedule.start(start, anchor, next_step, held) == expected


def test_a_checkpoint_carries_the_generations_made_with_weights_older_than_its_own():
    assert WeightsSchedule().carried(5, last_step=12) == []  # on-policy: step 6 takes 5's
    assert WeightsSchedule(1, lag=1).carried(5, 12) == [6]  # the one made while 5 updated
    assert WeightsSchedule(1, lag=1).carried(12, 12) == []  # none past the run's end
    assert WeightsSchedule(iterations=2).carried(3, 12) == [3]  # steps 3 and 4 train on 3
    assert WeightsSchedule(iterations=2).carried(4, 12) == []
    assert WeightsSchedule(2).carried(3, 12) == [4]  # step 4 takes step 2's weights
    assert WeightsSchedule(2).carried(4, 12) == []  # a sync point: step 5 takes 4's
    behind = WeightsSchedule(2, lag=1, iterations=2)  # the versions 0 0 0 0 2 2
    assert behind.carried(3, 6) == [3, 5] and behind.carried(4, 6) == [5]
    for schedule in (WeightsSchedule(2), WeightsSchedule(3, 1), behind):
        for step in range(1, 12):  # what is not carried the resumed group's weights make
            carried = schedule.carried(step, 40)
            after = range(schedule.key(step + 1), 40, schedule.iterations)
            assert [g for g in after if schedule.required(g) < step] == carried
