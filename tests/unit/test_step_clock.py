"""The step clock: a step's phases add up to its time, whatever was measured inside what."""

import json
import time
from pathlib import Path

import pytest

from raytrain_ext.metrics.sinks import JsonlSink, median_phases
from raytrain_ext.train.step_clock import PHASES, StepClock


def test_laps_add_up_to_the_step_and_the_carried_reporting():
    clock = StepClock(carried_s=0.002)
    time.sleep(0.01)
    clock.lap("forward_backward")
    clock.move(0.004, "forward_backward", "data")
    time.sleep(0.005)
    clock.lap("optimizer")
    clock.stop()
    seconds, phases = clock.seconds, clock.phases()
    assert set(phases) == set(PHASES)
    assert sum(phases.values()) == pytest.approx(seconds, abs=1e-9)
    assert phases["data"] == pytest.approx(0.004)
    assert phases["forward_backward"] >= 0.01 - 0.004
    assert phases["bookkeeping"] >= 0.002  # the previous step's reporting
    assert clock.since_stop() >= 0.0


def test_the_summary_takes_each_phase_median():
    records = [{"phases_s": {"data": d, "bookkeeping": 1.0}} for d in (1.0, 5.0, 2.0)]
    assert median_phases(records + [{"step": 4}]) == {"data": 2.0, "bookkeeping": 1.0}
    assert median_phases([{"step": 1}]) == {}
    # a record written before a phase existed (a resumed run's earlier lines) counts it 0
    newer = [{"phases_s": {"data": 1.0, "weights_sync": w}} for w in (3.0, 5.0)]
    assert median_phases([{"phases_s": {"data": 1.0}}, *newer]) == {
        "data": 1.0,
        "weights_sync": 3.0,
    }


def test_every_record_is_one_json_line_appended_and_no_step_writes_no_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    idle = JsonlSink(path)
    idle.close()
    assert not path.exists()
    for steps in ((1, 2), (2, 3)):  # a resume appends after the earlier attempt's lines
        sink = JsonlSink(path)
        for step in steps:
            sink.write(step, {"step": step, "phases_s": {"data": 0.5}, "restored": Path("x")})
        sink.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 2, 3]
    assert records[0] == {"step": 1, "phases_s": {"data": 0.5}, "restored": "x"}


def test_tensorboard_opens_its_event_file_at_the_first_record(tmp_path):
    """Opening it imports tensorboardX and with it torch (over a second on the driver), so
    it happens at the first record, off the path to the first step; a run that made no step
    writes no event file, and every scalar given reaches the file."""
    from raytrain_ext.metrics.sinks import TensorBoardSink

    log_dir = tmp_path / "tensorboard"
    idle = TensorBoardSink(log_dir)
    idle.close()
    assert not log_dir.exists()
    sink = TensorBoardSink(log_dir)
    for step in (1, 2):
        sink.write(step, {"loss": 3.0 - step, "lr": 0.1})
    sink.close()
    (events,) = log_dir.glob("events.out.tfevents.*")
    data = events.read_bytes()
    assert data.count(b"train/loss") == 2 and data.count(b"train/lr") == 2
