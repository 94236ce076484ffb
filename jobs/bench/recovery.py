"""Recovery benchmark: a worker process dies mid-run; how long until training resumes?

Same tiny model, 2 workers, same fault (rank 1's process exits right after step
`--kill-at`) in both frameworks, in one run on this machine:
- raytrain-ext: `chaos.kill_rank`, checkpoints every `--ours-every` steps into the Ray object
  store (and local disk), `elastic.max_failures=1`;
- Ray Train: `TorchTrainer` with `FailureConfig(max_failures=1)`, a checkpoint every
  `--ray-every` steps through `ray.train.report`, restarted from `get_checkpoint()`.
Prints fault -> detect / decide / re-form / restore / first step after, and steps redone.
Ours runs five times: the defaults (`elastic.replacement=auto`: the group waits for the
new process only where a warm one takes the place, else the survivor trains on alone at
once and the new process joins at a step boundary once warm); `elastic.replacement=in_place`
(the group waits for the dead rank's new process in its freed slot, which takes the idle
process `elastic.prestart_processes` keeps on the node, still importing or not); the same
without that idle process (an interpreter starts); `elastic.replacement=background`; and
with one warm spare (`elastic.spare_workers=1`, one more slot reserved) taking its place.
Each line gives the decision: `replace` waited for the new process, `shrink` went on.
The node-loss scenario and the trends are in recovery_node_loss.py.

Usage: python jobs/bench/recovery.py [--steps 30 --kill-at 12]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from raytrain_ext.config import load_config  # noqa: E402


def ours(
    args, workdir: Path, spares: int = 0, replacement: str = "auto", prestart: bool = True
) -> dict:
    from raytrain_ext import Trainer

    cfg = load_config(
        None,
        [
            f"run.output_dir={workdir}",
            f"run.name=ours-{spares}-{replacement}-{int(prestart)}",
            "run.tensorboard=false",
            f"elastic.spare_workers={spares}",
            f"run.max_steps={args.steps}",
            f"optim.decay_steps={args.steps}",
            f"checkpoint.every_steps={args.ours_every}",
            "checkpoint.every_seconds=null",
            "checkpoint.memory=true",
            "elastic.max_failures=1",
            "chaos.kill_rank=1",
            f"chaos.kill_at_step={args.kill_at}",
            f"elastic.replacement={replacement}",
            f"elastic.prestart_processes={str(prestart).lower()}",
            "scaling.min_workers=1",
        ],
    )
    summary = Trainer(cfg).fit()
    recovery = summary["recoveries"][0]
    fault = _fault_time(summary, args.kill_at)
    transitions = {t["target"]: t["at"] for t in summary["transitions"][1:]}
    running_again = [t["at"] for t in summary["transitions"] if t["target"] == "RUNNING"][-1]
    return {
        "detect_s": recovery["detected_at"] - fault,
        "decide_s": recovery["decided_s"],
        "reform_s": running_again - transitions["SCHEDULING"],
        "restore_s": recovery["restore_s"],
        "first_step_after_s": recovery["first_step_after_s"] + recovery["detected_at"] - fault,
        "steps_redone": recovery["steps_redone"],
        "decision": recovery["decision"],
        "restored_from": recovery["restored_from"],
        "reformed": recovery.get("reformed"),
        "sizes": [h["world_size"] for h in summary["world_size_history"]],
        "grow_pause_s": [r.get("pause_s") for r in summary["resizes"]],
    }


def _fault_time(summary: dict, kill_at: int) -> float:
    """The first end of step `kill_at` on rank 0 (rank 1 exits right after the same step)."""
    return next(t for step, t in summary["step_end_times"] if step == kill_at)


def ray_train(args, workdir: Path) -> dict:
    import ray
    from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log_path = workdir / "ray_train_steps.jsonl"
    marker = workdir / "ray_train_killed"

    def loop(config):
        import ray.train as train
        import torch
        import torch.nn.functional as F

        from raytrain_ext.models import build_model

        cfg = load_config(None, [])
        model = train.torch.prepare_model(build_model(cfg.model, 0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        start = 0
        checkpoint = train.get_checkpoint()
        if checkpoint:
            with checkpoint.as_directory() as d:
                state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
                start = state["step"]
        rank = train.get_context().get_world_rank()
        for step in range(start + 1, config["steps"] + 1):
            x = torch.randint(0, 256, (4, cfg.model.seq_len))
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
            if rank == 0:
                with open(config["log"], "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "step": step,
                                "time": time.time(),
                                "resumed_from": start,
                                "pid": os.getpid(),
                            }
                        )
                        + "\n"
                    )
            if rank == 1 and step == config["kill_at"] and not os.path.exists(config["marker"]):
                with open(config["marker"], "w") as f:
                    f.write(str(time.time()))
                os._exit(1)
            if step % config["every"] == 0:
                with tempfile.TemporaryDirectory() as tmp:
                    torch.save(
                        {"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
                        os.path.join(tmp, "state.pt"),
                    )
                    train.report({"step": step}, checkpoint=Checkpoint.from_directory(tmp))
            else:
                train.report({"step": step})

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        TorchTrainer(
            loop,
            train_loop_config={
                "steps": args.steps,
                "kill_at": args.kill_at,
                "every": args.ray_every,
                "log": str(log_path),
                "marker": str(marker),
            },
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(
                storage_path=str(workdir / "ray_train"),
                name="bench",
                failure_config=FailureConfig(max_failures=1),
            ),
        ).fit()
    finally:
        ray.shutdown()
    fault = float(marker.read_text())
    steps = [json.loads(line) for line in log_path.read_text().splitlines()]
    # the restarted group's first step: rank 0 of the first group may still log the fault's
    # own step just after rank 1 exited, so "after the fault" is told by a new process
    first_pid = steps[0]["pid"]
    after = [s for s in steps if s["pid"] != first_pid]
    return {
        "first_step_after_s": after[0]["time"] - fault,
        "steps_redone": args.kill_at - after[0]["resumed_from"],
    }


VARIANTS = (  # (label, spare_workers, replacement, prestart_processes), elastic.*
    ("defaults (0 spares, auto)", 0, "auto", True),
    ("0 spares, in place", 0, "in_place", True),
    ("0 spares, in place, no idle process", 0, "in_place", False),
    ("0 spares, in the background", 0, "background", True),
    ("1 warm spare", 1, "auto", True),
)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--ours-every", type=int, default=1)
    parser.add_argument("--ray-every", type=int, default=5)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    import ray

    # 3 logical CPUs on this machine's cores: the spare's slot (it idles once warm)
    ray.init(num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        try:
            runs = {
                label: ours(args, workdir, spares, replacement, prestart)
                for label, spares, replacement, prestart in VARIANTS
            }
        finally:
            ray.shutdown()
        b = ray_train(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"fault: rank 1's process exits after step {args.kill_at} of {args.steps}, 2 workers")
    for label, a in runs.items():
        print(
            f"raytrain-ext, {label} (checkpoint every {args.ours_every} step(s), "
            f"restored from {a['restored_from']}, {a['decision']}, slots {a['reformed']}): detect "
            f"{a['detect_s']:.2f} s, decide {a['decide_s']:.2f} s, re-form {a['reform_s']:.2f} s, "
            f"restore {a['restore_s']:.2f} s, first step after {a['first_step_after_s']:.2f} s, "
            f"{a['steps_redone']} step(s) redone; world sizes {a['sizes']}, grow-back pauses "
            f"{[round(p, 2) for p in a['grow_pause_s'] if p is not None]} s"
        )
    print(
        f"Ray Train TorchTrainer (checkpoint every {args.ray_every} steps): first step after "
        f"{b['first_step_after_s']:.2f} s, {b['steps_redone']} step(s) redone"
    )
    for label, a in runs.items():
        print(
            f"time from fault to resumed training, {label}: Ray Train / raytrain-ext "
            f"= {b['first_step_after_s'] / a['first_step_after_s']:.1f}x"
        )


if __name__ == "__main__":
    main()
