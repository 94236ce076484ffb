"""End to end through the real entrypoints, each in its own process with its own local Ray."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r"^step +\d+/\d+  loss [\d.]+  lr [\d.e+-]+  grad_norm [\d.]+  "
                      r"tokens/s +\d+  step_time [\d.]+ ms  world 2$", re.M)


def run(cmd, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def raytrain_ext_cmd():
    exe = Path(sys.executable).with_name("raytrain-ext")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "raytrain_ext"]


@pytest.mark.slow
def test_cli_and_job_entrypoint_train_the_same_model(tmp_path):
    common = ["run.max_steps=6", "run.log_every=3", f"run.output_dir={tmp_path}"]
    cli = run([*raytrain_ext_cmd(), "train", *common, "run.name=cli"], cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert len(PROGRESS.findall(cli.stdout)) == 2, cli.stdout  # steps 3 and 6, rank 0 only
    job = run([sys.executable, str(REPO / "jobs" / "train.py"), "--config",
               str(REPO / "configs" / "tiny_cpu.yaml"), *common, "run.name=job"], cwd=tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    a = json.loads((tmp_path / "cli" / "summary.json").read_text())
    b = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert a["steps_completed"] == b["steps_completed"] == 6
    assert a["params_sha256"] == b["params_sha256"]  # packaged default == configs/tiny_cpu.yaml
    assert (tmp_path / "cli" / "config.yaml").read_text().count("max_steps: 6") == 1
    assert list((tmp_path / "cli" / "tensorboard").glob("events.out.tfevents.*"))
    assert '"params_sha256"' in cli.stdout  # the summary is printed


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
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL the whole `raytrain-ext train` process group mid-run, rerun, compare."""
    common = ["run.max_steps=40", "run.log_every=10", "optim.decay_steps=40",
              "checkpoint.every_steps=5", f"run.output_dir={tmp_path}", "run.tensorboard=false"]
    reference = run([*raytrain_ext_cmd(), "train", *common, "run.name=ref"], cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    cmd = [*raytrain_ext_cmd(), "train", *common, "run.name=victim"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = tmp_path / "victim" / "checkpoints" / "step-00000010" / "manifest.json"
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert marker.exists() and proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = run(cmd, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = json.loads((tmp_path / "ref" / "summary.json").read_text())
    b = json.loads((tmp_path / "victim" / "summary.json").read_text())
    assert b["restored"]["step"] >= 10 and b["steps_completed"] == 40
    assert b["params_sha256"] == a["params_sha256"] and b["samples_digest"] == a["samples_digest"]


def _worker_pids(root_pid):
    return [p.pid for p in psutil.Process(root_pid).children(recursive=True)
            if " ".join(p.cmdline()).startswith("ray::TrainWorker")]


@pytest.mark.slow
def test_sigterm_to_a_worker_checkpoints_then_resumes_with_zero_steps_redone(tmp_path):
    common = ["run.max_steps=150", "run.log_every=50", "optim.decay_steps=150",
              "checkpoint.every_seconds=null", f"run.output_dir={tmp_path}",
              "run.tensorboard=false"]
    cmd = [*raytrain_ext_cmd(), "train", *common, "run.name=spot"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(_worker_pids(proc.pid)) < 2 and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)  # well into training
    os.kill(_worker_pids(proc.pid)[1], signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr[-3000:]
    assert "preempted: emergency checkpoint at step" in stderr
    summary = json.loads((tmp_path / "spot" / "summary.json").read_text())
    stopped = summary["steps_completed"]
    assert summary["status"] == "preempted" and 0 < stopped < 150
    assert (tmp_path / "spot" / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").exists()
    resumed = run(cmd, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((tmp_path / "spot" / "summary.json").read_text())
    assert after["restored"]["step"] == stopped  # zero steps redone
    reference = run([*raytrain_ext_cmd(), "train", *common, "run.name=ref",
                     "checkpoint.enabled=false"], cwd=tmp_path)
    assert reference.returncode == 0
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert after["params_sha256"] == ref["params_sha256"]
    assert after["samples_digest"] == ref["samples_digest"]


def test_unusable_s3_bucket_fails_before_anything_starts(tmp_path, s3_endpoint):
    result = run([*raytrain_ext_cmd(), "train", f"run.output_dir={tmp_path}",
                  "checkpoint.s3.uri=s3://no-such-bucket/runs",
                  f"checkpoint.s3.endpoint_url={s3_endpoint}"], cwd=tmp_path)
    assert result.returncode == 2
    assert "checkpoint storage error: checkpoint.s3.uri: bucket 'no-such-bucket' does not " \
           "exist" in result.stderr
    assert "Started a local Ray instance" not in result.stderr
