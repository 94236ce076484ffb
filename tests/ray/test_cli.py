"""End to end through the real entrypoints, each in its own process with its own local Ray."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from raytrain_ext.metrics.start_phases import START_PHASES
from tests.helpers.cli import RaySessionWatch, clean_env, raytrain_ext_cmd, run
from tests.helpers.reference import uninterrupted
from tests.helpers.runs import FAST_MODEL, step_floor, wait_for_checkpoint

REPO = Path(__file__).resolve().parents[2]
STEPS = 60
PROGRESS = re.compile(
    r"^step +\d+/\d+  loss [\d.]+  lr [\d.e+-]+  grad_norm [\d.]+  "
    r"tokens/s +\d+  step_time [\d.]+ ms  world 2$",
    re.M,
)


@pytest.mark.slow
def test_cli_trains_logs_from_rank0_and_writes_the_run_dir(tmp_path):
    common = [
        f"run.max_steps={STEPS}",
        f"optim.decay_steps={STEPS}",
        "run.log_every=30",
        f"run.output_dir={tmp_path}",
        *FAST_MODEL,
    ]
    # Ray's own worker priority, asked for by name, reaches the ranks
    niceness = "scaling.worker_niceness=15"
    cli = run([*raytrain_ext_cmd(), "train", *common, "run.name=cli", niceness], cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert len(PROGRESS.findall(cli.stdout)) == 2, cli.stdout  # steps 30 and 60, rank 0 only
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["steps_completed"] == STEPS
    assert summary["params_sha256"] == uninterrupted(STEPS, *FAST_MODEL)["result"]["params_sha256"]
    assert (tmp_path / "cli" / "config.yaml").read_text().count(f"max_steps: {STEPS}") == 1
    assert list((tmp_path / "cli" / "tensorboard").glob("events.out.tfevents.*"))
    assert '"params_sha256"' in cli.stdout  # the summary is printed
    assert "Traceback" not in cli.stdout + cli.stderr  # a finished run keeps no state
    assert_start_is_accounted(summary)
    assert [w["niceness"] for w in summary["workers"]] == [15, 15]
    # every step's record, its phases adding up to its time
    lines = (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert sum(r["phases_s"].values()) == pytest.approx(r["step_time_s"], abs=1e-9)


def assert_start_is_accounted(summary):
    """The start's phases (``metrics.start_phases``) add up to the time to the first step;
    the ones this local run must have spent time in (a private Ray's start, rank 0's
    process and its imports, the group and the first step) are there."""
    phases = summary["start_phases_s"]
    assert list(phases) == [name for name, _ in START_PHASES]
    assert min(phases.values()) >= 0.0
    assert sum(phases.values()) == pytest.approx(summary["time_to_first_step_s"], abs=1e-6)
    for spent in ("ray_start", "worker_init", "imports", "rendezvous", "build", "first_step"):
        assert phases[spent] > 0.0, phases


def test_cli_config_error_exits_2_before_starting_ray(tmp_path):
    result = run([*raytrain_ext_cmd(), "train", "data.global_batch_sise=4"], cwd=tmp_path)
    assert result.returncode == 2
    assert "data.global_batch_sise: unknown key" in result.stderr
    assert "Did you mean 'data.global_batch_size'" in result.stderr
    assert "Ray" not in result.stdout + result.stderr and not (tmp_path / "runs").exists()


def test_positional_config_and_overrides(tmp_path):
    from raytrain_ext.cli import split_config_and_overrides

    assert split_config_and_overrides(None, ["c.yaml", "a=1"]) == ("c.yaml", ["a=1"])
    assert split_config_and_overrides("d.yaml", ["a=1"]) == ("d.yaml", ["a=1"])
    assert split_config_and_overrides(None, ["a=1"]) == (None, ["a=1"])


@pytest.mark.slow
def test_killed_cli_run_resumed_by_the_job_entrypoint_ends_as_if_uninterrupted(tmp_path):
    """SIGKILL the whole `raytrain-ext train` process group mid-run, then resume it with
    `python jobs/train.py --config configs/tiny_cpu.yaml` (the `ray job submit` entrypoint,
    whose config file equals the packaged default): same parameters, same samples."""
    common = [
        f"run.max_steps={STEPS}",
        "run.log_every=10",
        f"optim.decay_steps={STEPS}",
        "checkpoint.every_steps=5",
        f"run.output_dir={tmp_path}",
        "run.tensorboard=false",
        "run.name=victim",
        *FAST_MODEL,
    ]
    proc = subprocess.Popen(
        [*raytrain_ext_cmd(), "train", *common],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_checkpoint(tmp_path / "victim" / "checkpoints", 10, while_running=proc)
    watch = RaySessionWatch()
    second = run([*raytrain_ext_cmd(), "train", *common], cwd=tmp_path, env=watch.env())
    assert watch.sessions() == [], "a second writer of the run started Ray"
    shutil.rmtree(watch.dir, ignore_errors=True)
    assert second.returncode == 2 and "Traceback" not in second.stdout + second.stderr
    assert re.search(
        rf"error: run.name: run victim is already training in {tmp_path}/victim \(attempt 1: "
        rf"host \S+, pid {proc.pid}, since [^)]+\)\. Two runs must not write one run directory",
        second.stderr,
    ), second.stderr[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = run(
        [
            sys.executable,
            str(REPO / "jobs" / "train.py"),
            "--config",
            str(REPO / "configs" / "tiny_cpu.yaml"),
            *common,
        ],
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(  # the killed driver's lock text was left; the kernel freed the lock
        rf"run victim: took over the lock of attempt 1: host \S+, pid {proc.pid}, since .*, "
        "which ended without releasing it",
        resumed.stderr,
    ), resumed.stderr[-2000:]
    b = json.loads((tmp_path / "victim" / "summary.json").read_text())
    a = uninterrupted(STEPS, *FAST_MODEL)["result"]
    assert b["restored"]["step"] >= 10 and b["steps_completed"] == STEPS
    assert b["params_sha256"] == a["params_sha256"] and b["samples_digest"] == a["samples_digest"]
    # the killed attempt's records stay (as many as its driver had received: it polls rank 0
    # about once a second, so maybe none); the resumed one's follow from its checkpoint (none
    # when the killed run had checkpointed its last step: then there is no file at all)
    records = tmp_path / "victim" / "metrics.jsonl"
    lines = records.read_text().splitlines() if records.exists() else []
    steps = [json.loads(line)["step"] for line in lines]
    resumed_steps = list(range(b["restored"]["step"] + 1, STEPS + 1))
    killed = len(steps) - len(resumed_steps)
    assert steps == list(range(1, killed + 1)) + resumed_steps


def assert_resumes_where_it_stopped(cmd, run_dir, stopped):
    """The same command resumes from the checkpoint at ``stopped`` (zero steps redone) and
    ends with the parameters and samples of the uninterrupted run."""
    resumed = run(cmd, cwd=run_dir.parent)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((run_dir / "summary.json").read_text())
    assert after["restored"]["step"] == stopped  # zero steps redone
    reference = uninterrupted(STEPS, *FAST_MODEL)["result"]
    assert after["params_sha256"] == reference["params_sha256"]
    assert after["samples_digest"] == reference["samples_digest"]


def no_process_left(pids, within_s):
    """Every process in ``pids`` has ended within ``within_s`` (the private Ray's processes
    end as it shuts down, a moment after the command itself exits)."""
    alive = []
    for pid in pids:
        try:
            alive.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, still_alive = psutil.wait_procs(alive, timeout=within_s)
    return not still_alive


def _worker_pids(root_pid):
    """The live rank processes under ``root_pid``: a killed one lingers as a zombie until
    its raylet reaps it, and one may end while it is looked at."""
    pids = []
    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            if " ".join(process.cmdline()).startswith("ray::TrainWorker"):
                pids.append(process.pid)
        except psutil.NoSuchProcess:  # ZombieProcess included
            continue
    return pids


@pytest.mark.slow
def test_sigterm_to_a_worker_checkpoints_then_resumes_with_zero_steps_redone(tmp_path):
    common = [
        f"run.max_steps={STEPS}",
        "run.log_every=10",
        f"optim.decay_steps={STEPS}",
        "checkpoint.every_steps=5",
        "checkpoint.every_seconds=null",
        # two tiers: the ranks without the notice must join the deadline checks too
        "checkpoint.memory=true",
        f"run.output_dir={tmp_path}",
        "run.tensorboard=false",
        "run.name=spot",
        *FAST_MODEL,
    ]
    cmd = [*raytrain_ext_cmd(), "train", *common]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(tmp_path / "spot" / "checkpoints", 5, while_running=proc)
    os.kill(_worker_pids(proc.pid)[1], signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr[-3000:]
    assert "preempted: emergency checkpoint at step" in stderr
    summary = json.loads((tmp_path / "spot" / "summary.json").read_text())
    stopped = summary["steps_completed"]
    assert summary["status"] == "preempted" and 5 <= stopped < STEPS
    assert (tmp_path / "spot" / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").exists()
    assert_resumes_where_it_stopped(cmd, tmp_path / "spot", stopped)


@pytest.mark.slow
def test_a_killed_worker_is_recovered_by_default_and_ctrl_c_checkpoints_then_resumes(tmp_path):
    """With no elastic.* setting, a worker SIGKILLed from outside is recovered (the default
    failure budget, stated in the log line). Then SIGINT to the command's process group, as
    a terminal's Ctrl-C sends it: every rank takes an emergency checkpoint at the next step
    boundary, the run ends ``interrupted`` (exit 130, no traceback, no worker left), and the
    same command resumes from that step with nothing redone, ending as if never stopped."""
    common = [
        f"run.max_steps={STEPS}",
        "run.log_every=10",
        f"optim.decay_steps={STEPS}",
        f"run.output_dir={tmp_path}",
        "run.tensorboard=false",
        "run.name=ctrlc",
        # progress lines reach stdout at each poll, and this test acts on them within a
        # run of about a second: poll as often as before the 1 s default
        "elastic.poll_interval_s=0.2",
        # and every step lasts at least 30 ms (a sleep changes no number): on a fast
        # machine the 30 steps after the Ctrl-C outran the interrupt's next poll
        *step_floor(0.03, attempts=3),
        *FAST_MODEL,
    ]
    cmd = [*raytrain_ext_cmd(), "train", *common]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    for line in proc.stdout:
        if line.startswith(f"step     10/{STEPS}"):
            os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL)
        if line.startswith(f"step     30/{STEPS}"):
            workers = _worker_pids(proc.pid)
            os.killpg(proc.pid, signal.SIGINT)
            break
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    summary = json.loads((tmp_path / "ctrlc" / "summary.json").read_text())
    stopped = summary["steps_completed"]
    assert summary["status"] == "interrupted" and 30 <= stopped < STEPS
    (recovery,) = summary["recoveries"]
    assert recovery["kind"] == "failure" and recovery["steps_redone"] == 0
    assert "failure 1 of 3 allowed (elastic.max_failures)" in stderr
    assert (
        f"interrupted (Ctrl-C): checkpoint at step {stopped} committed; rerun the same command "
        "to resume" in stderr
    )
    assert (tmp_path / "ctrlc" / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").exists()
    assert len(workers) == 2 and no_process_left(workers, within_s=30)
    assert_resumes_where_it_stopped(cmd, tmp_path / "ctrlc", stopped)
