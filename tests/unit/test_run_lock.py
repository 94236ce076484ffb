"""One writer per run directory (``raytrain_ext.run_lock``), and a finished run not restarted."""

import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from raytrain_ext.run_dir import RunAlreadyFinished, RunDirectory, refuse_finished_run
from raytrain_ext.run_lock import RunInUse, RunLock

HOLD = (
    "import sys, time; from raytrain_ext.run_lock import RunLock; "
    "lock = RunLock(sys.argv[1]); lock.acquire(); lock.record(7); print('held', flush=True); "
    "time.sleep(60)"
)


def test_a_second_writer_is_refused_naming_the_holder_until_it_releases(tmp_path):
    first = RunDirectory(tmp_path / "r")
    attempt = first.begin("a: 1\n")
    with pytest.raises(RunInUse, match=rf"run r is already training in {tmp_path}/r \(attempt 1: "):
        RunDirectory(tmp_path / "r").begin("a: 1\n")
    assert sorted(p.name for p in (tmp_path / "r" / "attempts").iterdir()) == ["001"]
    first.finish(attempt, {"loss_history": [1.0]})
    second = RunDirectory(tmp_path / "r")
    assert second.begin("a: 1\n").number == 2  # released: taken without a takeover
    assert json.loads((tmp_path / "r" / ".lock").read_text())["attempt"] == 2


def test_a_killed_holders_lock_is_taken_over_and_said_so(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "r")], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(RunInUse, match=rf"attempt 7: host \S+, pid {holder.pid}, since "):
        RunLock(tmp_path / "r").acquire()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    lock = RunLock(tmp_path / "r")
    with caplog.at_level(logging.WARNING, logger="raytrain_ext.run_lock"):
        lock.acquire()
    assert "took over the lock of attempt 7: host" in caplog.text
    assert f"pid {holder.pid}" in caplog.text and "ended without releasing it" in caplog.text
    lock.release()
    assert (tmp_path / "r" / ".lock").read_text() == ""


def test_a_finished_run_is_refused_unless_more_steps_or_an_explicit_resume(tmp_path):
    (tmp_path / "summary.json").write_text(
        json.dumps({"status": "finished", "steps_completed": 300})
    )
    with pytest.raises(RunAlreadyFinished, match=r"already finished at step 300 .* above 300"):
        refuse_finished_run(tmp_path, 300, "auto")
    refuse_finished_run(tmp_path, 301, "auto")
    refuse_finished_run(tmp_path, 300, "never")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "steps_completed": 9}))
    refuse_finished_run(tmp_path, 9, "auto")
