"""Hang detection, stepped with a fake clock."""

from raytrain_ext.elastic.watchdog import HangWatchdog


def test_no_verdict_while_starting_or_progressing():
    dog = HangWatchdog(factor=10, floor_s=5)
    dog.observe(0, 0, "setup", now=0.0)
    assert dog.check(now=100.0) is None  # no step yet: startup is not a hang
    for t in range(1, 20):
        dog.record_step_time(0.1)
        dog.observe(0, t, "compute", now=float(t))
        dog.observe(1, t, "exchange", now=float(t))
        assert dog.check(now=t + 0.5) is None


def test_the_rank_outside_the_collective_is_named():
    dog = HangWatchdog(factor=10, floor_s=2)
    for rank in range(3):
        dog.observe(rank, 7, "exchange", now=10.0)
    dog.record_step_time(1.0)
    dog.observe(1, 7, "hung", now=10.5)  # same step: the clock of progress does not move
    assert dog.deadline_s() == 10.0  # 10 x median 1.0 s beats the 2 s floor
    assert dog.check(now=19.0) is None
    verdict = dog.check(now=21.0)
    assert verdict.ranks == [1] and verdict.stalled_s == 11.0 and verdict.deadline_s == 10.0


def test_all_ranks_named_when_all_wait_in_the_collective():
    dog = HangWatchdog(factor=5, floor_s=3)
    dog.observe(0, 4, "exchange", now=0.0)
    dog.observe(1, 4, "exchange", now=0.0)
    assert dog.check(now=3.5).ranks == [0, 1]


def test_a_rank_waiting_on_the_stream_reader_is_not_hung():
    dog = HangWatchdog(factor=5, floor_s=3)
    for rank in range(2):
        dog.observe(rank, 7, "exchange", now=10.0)
    dog.record_step_time(1.0)
    dog.observe(1, 7, "data", now=10.5)  # its reader reads the dataset again to the position
    assert dog.check(now=100.0) is None
    dog.observe(1, 7, "compute", now=101.0)  # back from the reader, stuck in its step
    assert dog.check(now=101.0).ranks == [1]
