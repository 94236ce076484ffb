"""Training submitted as a Ray job, the way users run it on a cluster.

A real head node (`ray start --head`, dashboard and job server included) runs in a
private temp dir on loopback ports; jobs reach it through the `ray job submit` CLI
and through the Jobs Python SDK, with a runtime env derived from
examples/runtime_env.yaml. The head is stopped by terminating exactly the process
tree it started: `ray stop` would stop every Ray instance of this user on the machine.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
HEAD_PORTS = (
    "port",
    "dashboard-port",
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
    "node-manager-port",
    "object-manager-port",
)


@dataclass
class Head:
    dashboard_url: str
    env: Dict[str, str]  # for `ray job ...` commands: RAY_ADDRESS unset, auth off


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def head_env() -> Dict[str, str]:
    """The head's processes (and so the job's driver) run this venv's `python`, on loopback."""
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    return env


def wait_for_dashboard(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, f"ray start exited:\n{log.read_text()[-3000:]}"
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no dashboard at {url} after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop_process_tree(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM `ray start --block` (it stops its node), then SIGKILL what is left of its tree."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    proc.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def processes_under(temp_dir: str):
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if temp_dir in " ".join(p.info["cmdline"] or []):
            found.append(p.pid)
    return found


@pytest.fixture(scope="module")
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="rtj-", dir="/tmp")  # short: Ray's sockets live under it
    ports = {name: free_port() for name in HEAD_PORTS}
    log = Path(temp_dir) / "ray-start.log"
    cmd = [
        RAY,
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--num-cpus=4",
        "--object-store-memory=200000000",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        *[f"--{name}={port}" for name, port in ports.items()],
    ]
    env = head_env()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        wait_for_dashboard(url, proc, log)
        yield Head(url, env)
    finally:
        stop_process_tree(proc)
        left = processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert left == [], f"processes of the test head still running: {left}"


def example_runtime_env() -> dict:
    """examples/runtime_env.yaml without its pip packages: this venv already has them, and a
    per-job virtualenv would need the network and a minute."""
    env = yaml.safe_load((REPO / "examples" / "runtime_env.yaml").read_text())
    assert env["pip"]["packages"] and env["env_vars"]["NCCL_IB_DISABLE"] == "1"
    env.pop("pip")
    return env


def train_args(output_dir: Path, name: str):
    return [
        "python",
        "jobs/train.py",
        "--config",
        "configs/tiny_cpu.yaml",
        "run.max_steps=6",
        "run.log_every=3",
        "run.tensorboard=false",
        f"run.output_dir={output_dir}",
        f"run.name={name}",
    ]


def assert_finished(run_dir: Path, steps: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps_completed"] == steps
    assert len(summary["loss_history"]) == steps and summary["replicas_identical"] is True
    return summary


@pytest.mark.slow
def test_ray_job_submit_cli_runs_training_to_the_end(ray_head, tmp_path):
    runtime_env = tmp_path / "runtime_env.yaml"
    runtime_env.write_text(yaml.safe_dump(example_runtime_env()))
    submit = subprocess.run(
        [
            RAY,
            "job",
            "submit",
            "--address",
            ray_head.dashboard_url,
            "--working-dir",
            ".",
            "--runtime-env",
            str(runtime_env),
            "--",
            *train_args(tmp_path, "cli-job"),
        ],
        cwd=REPO,
        env=ray_head.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = submit.stdout + submit.stderr
    job_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", out)
    assert submit.returncode == 0 and job_id, out[-4000:]
    assert re.search(r"^step +6/6  loss", out, re.M), out[-4000:]  # logs are tailed to the end
    status = subprocess.run(
        [RAY, "job", "status", "--address", ray_head.dashboard_url, job_id.group(1)],
        env=ray_head.env,
        capture_output=True,
        text=True,
    )
    assert f"Job '{job_id.group(1)}' succeeded" in status.stdout, status.stdout + status.stderr
    assert_finished(tmp_path / "cli-job", 6)


@pytest.mark.slow
def test_jobs_python_sdk_applies_the_runtime_env_and_streams_rank0_progress(ray_head, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(ray_head.dashboard_url)
    runtime_env = {**example_runtime_env(), "working_dir": str(REPO)}
    entrypoint = "printenv NCCL_SOCKET_IFNAME NCCL_IB_DISABLE TORCH_EXTENSIONS_DIR && " + " ".join(
        train_args(tmp_path, "sdk-job")
    )
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    deadline = time.time() + 240
    while not (status := client.get_job_status(job_id)).is_terminal() and time.time() < deadline:
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    assert "^lo,docker0\n1\n/tmp/torch_extensions\n" in logs  # env_vars reached the job
    progress = re.findall(r"^step +(\d+)/6  loss [\d.]+ .* world 2$", logs, re.M)
    assert progress == ["3", "6"], logs[-4000:]  # rank 0 only, every log_every steps
    summary = assert_finished(tmp_path / "sdk-job", 6)
    assert f"{summary['final_loss']:.4f}" in logs
