"""Framework overhead: raytrain-ext vs a plain torchrun DDP script, same model and batch.

Runs both as real commands (alternating, `--repeats` times each) and prints the
median step time of each (best run and the range over runs), their ratio, the time
from command start to the end of the first step, and where a step's time goes: the
median of each phase (``raytrain_ext.train.step_clock``) beside torchrun's, so that a
regression names its phase.  The start is split the same way (``metrics.start_phases``;
torchrun's rank 0 writes down the same moments).  ``--warm-ray`` adds runs of ours that
join a Ray head started once by the bench (``RAY_ADDRESS``, as ``ray job submit`` on a
running cluster does), so that Ray's own start is told apart from ours; it stops every
Ray on the machine at the end (``ray stop``).
Usage: `python jobs/bench/overhead.py [--steps 60] [--warm-ray] [key=value ...]`.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from raytrain_ext.worker.rendezvous import free_port  # noqa: E402

LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def run_raytrain_ext(
    workdir: Path, workers: int, overrides: list, name: str, ray_address: str = ""
) -> dict:
    """The default user path (checkpointing on, every 600 s and at the end); with
    ``ray_address``, joining that running Ray instead of starting a private one."""
    cmd = [
        sys.executable,
        str(REPO / "jobs" / "train.py"),
        f"run.output_dir={workdir}",
        f"run.name={name}",
        f"scaling.num_workers={workers}",
        "run.tensorboard=false",
        *overrides,
    ]
    env = {**os.environ, **LOOPBACK_RAY, "RAY_ADDRESS": ray_address} if ray_address else None
    start = time.time()
    subprocess.run(cmd, check=True, capture_output=True, cwd=workdir, env=env, timeout=600)
    summary = json.loads((workdir / name / "summary.json").read_text())
    return {
        "median_step_s": statistics.median(summary["step_times"][2:]),
        "first_step_s": summary["first_step_at"] - start,
        "final_loss": summary["final_loss"],
        "phases_s": summary["step_phases_s"],
        "start_s": {"command": summary["started_at"] - start, **summary["start_phases_s"]},
    }


def run_torchrun(workdir: Path, workers: int, overrides: list) -> dict:
    out = workdir / "torchrun.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={workers}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port('127.0.0.1')}",
        str(REPO / "jobs" / "bench" / "torchrun_ddp.py"),
        "--out",
        str(out),
        f"scaling.num_workers={workers}",
        *overrides,
    ]
    start = time.time()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, env=env, timeout=600)
    if done.returncode != 0:  # its own error, not a traceback of this script's
        sys.exit(f"torchrun failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    steady = result["phases_s"][2:]
    marks = result["start_marks"]
    return {
        "median_step_s": statistics.median(result["step_times"][2:]),
        "first_step_s": result["first_step_at"] - start,
        "final_loss": result["final_loss"],
        "phases_s": {k: statistics.median(p[k] for p in steady) for k in steady[0]},
        "start_s": {  # torchrun's launcher, then rank 0's moments
            "launcher": marks["process_started_at"] - start,
            "imports": marks["imports_done_at"] - marks["process_started_at"],
            "rendezvous": marks["formed_at"] - marks["imports_done_at"],
            "build": marks["built_at"] - marks["formed_at"],
            "first_step": result["first_step_at"] - marks["built_at"],
        },
    }


def start_ray_head(workdir: Path) -> str:
    """A Ray head on loopback, as a running cluster: its address."""
    port = free_port("127.0.0.1")
    subprocess.run(
        [
            "ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={workdir / 'ray'}",
        ],
        check=True, capture_output=True, env={**os.environ, **LOOPBACK_RAY}, timeout=120,
    )  # fmt: skip
    return f"127.0.0.1:{port}"


def print_start(label: str, runs: list) -> None:
    """The phases of the run that reached its first step soonest, in their order."""
    best = min(runs, key=lambda r: r["first_step_s"])
    phases = ", ".join(f"{k} {v:.2f}" for k, v in best["start_s"].items())
    print(f"  {label}: {best['first_step_s']:.2f} s = {phases}")


def print_phases(ours: list, theirs: list) -> None:
    """Median ms per phase, from each side's best run (by median step time)."""
    best_ours = min(ours, key=lambda r: r["median_step_s"])["phases_s"]
    best_theirs = min(theirs, key=lambda r: r["median_step_s"])["phases_s"]
    print(f"{'phase (median ms)':22}{'raytrain-ext':>14}{'torchrun DDP':>14}")
    for name, seconds in best_ours.items():
        peer = best_theirs.get(name)
        peer_text = f"{peer * 1e3:14.2f}" if peer is not None else f"{'-':>14}"
        print(f"{name:22}{seconds * 1e3:14.2f}{peer_text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warm-ray", action="store_true", help="also join a running Ray")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [f"run.max_steps={args.steps}", *args.overrides]
    ours, theirs, joined = [], [], []
    workdir = Path(tempfile.mkdtemp(prefix="overhead-"))
    try:
        for repeat in range(args.repeats):  # alternating, with no other Ray on the machine
            ours.append(run_raytrain_ext(workdir, args.workers, overrides, f"bench-{repeat}"))
            theirs.append(run_torchrun(workdir, args.workers, overrides))
        if args.warm_ray:  # after: an idle head's daemons slowed the private Ray's start 3x
            address = start_ray_head(workdir)
            for repeat in range(args.repeats):
                name = f"joined-{repeat}"
                joined.append(run_raytrain_ext(workdir, args.workers, overrides, name, address))
    finally:
        if args.warm_ray:
            subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(workdir, ignore_errors=True)
    best_ours = min(r["median_step_s"] for r in ours)
    best_theirs = min(r["median_step_s"] for r in theirs)
    print(f"workers={args.workers} steps={args.steps} overrides={args.overrides}")
    print(f"{'':22}{'raytrain-ext':>14}{'torchrun DDP':>14}{'ratio':>8}")
    print(
        f"{'median step time (ms)':22}{best_ours * 1e3:14.1f}{best_theirs * 1e3:14.1f}"
        f"{best_ours / best_theirs:8.3f}"
    )
    for label, runs in (("raytrain-ext", ours), ("torchrun DDP", theirs)):
        medians = ", ".join(f"{r['median_step_s'] * 1e3:.1f}" for r in runs)
        print(f"  {label} median step per run (ms): {medians}")
    pairs = ", ".join(  # each run of ours against the torchrun run right after it
        f"{a['median_step_s'] / b['median_step_s']:.3f}" for a, b in zip(ours, theirs, strict=True)
    )
    print(f"  ratio run by run: {pairs}")
    first_ours = min(r["first_step_s"] for r in ours)
    first_theirs = min(r["first_step_s"] for r in theirs)
    print(
        f"{'start to 1st step (s)':22}{first_ours:14.2f}{first_theirs:14.2f}"
        f"{first_ours / first_theirs:8.3f}"
    )
    for label, runs in (("raytrain-ext", ours), ("torchrun DDP", theirs), ("joined", joined)):
        if runs:
            firsts = ", ".join(f"{r['first_step_s']:.2f}" for r in runs)
            print(f"  {label} start to 1st step per run (s): {firsts}")
    if joined:
        first_joined = min(r["first_step_s"] for r in joined)
        print(
            f"{'  ...joining a running Ray':22}{first_joined:14.2f}{first_theirs:14.2f}"
            f"{first_joined / first_theirs:8.3f}"
        )
    print("where the start went (s), each side's soonest run:")
    print_start("raytrain-ext", ours)
    if joined:
        print_start("raytrain-ext joining a running Ray", joined)
    print_start("torchrun DDP", theirs)
    print_phases(ours, theirs)


if __name__ == "__main__":
    main()
