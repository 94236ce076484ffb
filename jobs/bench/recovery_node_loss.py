"""Recovery benchmark, node loss: a whole node dies mid-run and a fresh one joins 3 s later.

Side by side, in one run, on a real multi-node `ray.cluster_utils.Cluster` on this machine
(a head with 0 CPUs and three 1-CPU worker nodes, all on 127.0.0.1, Ray health checks
tightened so a dead node is noticed in about 2 s):
- raytrain-ext: 3 workers spread one per node (elastic 1..3), checkpoints every 5 steps
  with the memory tier on, `elastic.max_failures=1`;
- Ray Train: `TorchTrainer`, `ScalingConfig(num_workers=(1, 3), placement_strategy="SPREAD")`,
  a checkpoint every 5 steps through `ray.train.report`, restarted from `get_checkpoint()`.
Same model (the default tiny GPT), same global batch (12: 4 samples a rank at 3 workers).
`fit()` runs in a thread; the main thread (the only one allowed to add nodes) waits for
step `--fault-at`, SIGKILLs the node of a non-rank-0 worker (its raylet and every process
under it at once, then `remove_node(..., allow_graceful=False)`), waits 3 s and adds a
fresh 1-CPU node.

Prints per framework: fault -> first step after, steps redone, the grow-back pause (last
step before the re-form that grows the group back -> first step after it), the wall time
of the whole run, and Ray Train / raytrain-ext for each; min-max over `--repeats`.
The trends (recovery vs world size, vs state size) are in recovery_scaling.py.

Usage: python jobs/bench/recovery_node_loss.py [--scenario node-loss|world-size|state-size|all]
       [--repeats 1] [--steps 60] [--fault-at 11] [--strategy ddp|fsdp] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recovery_scaling  # noqa: E402 (sets the Ray environment before ray is imported)
from recovery_scaling import (  # noqa: E402
    NODE_ARGS,
    Background,
    keep_or_remove,
    load_config,
    ours_at_step,
    ours_recovery,
    ours_trainer,
    parse_args,
    print_side_by_side,
    ray_cluster,
    wait_for,
)

# How often each framework looks for capacity to grow back: Ray Train's
# elastic_resize_monitor_interval_s (default 60 s) is set to our elastic.grow_check_s (2 s).
# Ray Train grows as soon as a check sees room (its only hysteresis is that interval since
# the group started), so ours gets a short stability window and cooldown too (defaults
# 10 s and 60 s, which would put the grow-back beyond the end of a 60-step run).
GROW_CHECK_S = 2.0
OURS_ELASTIC = [
    f"elastic.grow_check_s={GROW_CHECK_S}",
    "elastic.grow_stable_s=1",
    f"elastic.resize_cooldown_s={GROW_CHECK_S}",
]


# ---------------------------------------------------------------- the node-loss fault


def lose_a_node(
    cluster, node_id: str, rejoin_after_s: float, rejoin: Optional[List[float]] = None
) -> float:
    """SIGKILL a whole node at once, then add a fresh one; the wall-clock time of the fault.
    ``rejoin`` (when given) gets the times ``add_node`` was called and returned.

    ``remove_node(allow_graceful=False)`` SIGKILLs the node's raylet and agents but not
    the worker processes under the raylet, which go on training for about half a second
    (until they notice their raylet is gone): a step or two more, in whichever framework
    happens to be mid-step.  A machine that dies takes them all at the same instant, so
    they are SIGKILLed together with the raylet first; ``remove_node`` then does the rest.
    """
    import psutil

    (node,) = [n for n in cluster.list_all_nodes() if n.node_id == node_id]
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    doomed = [raylet, *raylet.children(recursive=True)]
    fault = time.time()
    for process in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    cluster.remove_node(node, allow_graceful=False)
    time.sleep(rejoin_after_s)
    started = time.time()
    cluster.add_node(**NODE_ARGS)
    if rejoin is not None:
        rejoin[:] = [started, time.time()]
    return fault


def node_loss_ours(args, workdir: Path, name: str) -> dict:
    """Our run through the node loss; figures from its summary."""
    trainer = ours_trainer(
        workdir,
        name,
        args.steps,
        [
            "scaling.num_workers=3",
            "scaling.min_workers=1",
            "scaling.max_workers=3",
            "scaling.placement_strategy=SPREAD",
            "data.global_batch_size=12",
            f"elastic.max_failures={args.max_failures}",
            f"parallel.strategy={args.strategy}",
            *OURS_ELASTIC,
        ],
    )
    with ray_cluster(3) as cluster:
        run = Background(trainer.fit)
        wait_for(lambda: ours_at_step(trainer, args.fault_at), run, "ours: the fault step")
        victim = trainer.controller.group.infos[1].node_id  # rank 1's node
        rejoin: List[float] = []
        fault = lose_a_node(cluster, victim, args.rejoin_after, rejoin)
        summary = run.result()
    figures = ours_recovery(summary, fault)
    figures.update(ours_grow_back(summary))
    resumed = fault + figures["first_step_after_s"]
    figures["steps_while_back"] = steps_while_the_node_returns(summary, resumed, *rejoin)
    figures.update(wall_s=run.wall_s, fault_at_s=fault - run.started)
    figures["sizes"] = [h["world_size"] for h in summary["world_size_history"]]
    figures["detail"] += "; " + checkpoint_stall(summary)
    return figures


def steps_while_the_node_returns(summary: dict, resumed: float, added: float, up: float) -> str:
    """Rank 0's step times (median, max) at each stage of the node's return: the shrunk
    group before the node is added (from the recovery's first step on), while its raylet
    and daemons start (``add_node``), while its process warms (until the grow-back's
    checkpoint step), and the grown group after.  On this machine every node shares the
    same two cores, so what the new node starts competes with the ranks; on a real
    cluster it does not."""
    ends = summary["step_end_times"]
    grow = next((r for r in summary.get("resizes", []) if r["to"] > r["from"]), None)
    grow_end = next((end for step, end in ends if grow and step == grow["step"]), float("inf"))
    stages = (
        ("before the node returns", resumed, added),
        ("while it starts", added, up),
        ("while its process warms", up, grow_end),
        ("after the grow-back", grow_end + 1.0, float("inf")),  # past its first step
    )
    took = [(end, end - prev) for (_, prev), (_, end) in zip(ends, ends[1:], strict=False)]
    parts = []
    for label, lo, hi in stages:
        times = sorted(d for end, d in took if lo < end - d and end <= hi)
        if times:
            median = times[len(times) // 2]
            parts.append(f"{label} {median:.2f}/{times[-1]:.2f} ({len(times)})")
    return "step s median/max (steps): " + ", ".join(parts)


def checkpoint_stall(summary: dict) -> str:
    """The checkpoints' stall (per-step snapshots included) against the steps' time."""
    ends = [end for _, end in summary["step_end_times"]]
    steps_s = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    stall = summary["checkpoint_stall_s"]
    share = f" ({stall / steps_s:.1%} of the steps' time)" if steps_s > 0 else ""
    return f"checkpoint stall {stall:.2f} s in {len(ends)} steps{share}"


def ours_grow_back(summary: dict) -> dict:
    """The first resize that grew the group: its pause and where its state came from.

    ``pause_s``/``state_from`` are read from the resize record when the controller
    writes them; before that the pause is measured from rank 0's step end times (a
    resize stops at a checkpoint boundary, ``resize["step"]``, and goes on from there).
    """
    grow = next((r for r in summary.get("resizes", []) if r["to"] > r["from"]), None)
    if grow is None:
        return {"grow_pause_s": None, "grow_redone": None, "grow_state": None}
    pause = grow.get("pause_s")
    if pause is None:
        ends = summary["step_end_times"]
        last = max((i for i, (step, _) in enumerate(ends) if step == grow["step"]), default=-1)
        pause = ends[last + 1][1] - ends[last][1] if 0 <= last < len(ends) - 1 else None
    return {
        "grow_pause_s": pause,
        "grow_redone": 0,  # a planned stop at a checkpoint boundary
        "grow_state": grow.get("state_from", "?"),
        "grow": f"{grow['from']}->{grow['to']}"
        + "".join(f", {k} {v:.2f}" for k, v in (grow.get("phases") or {}).items()),
    }


# ---------------------------------------------------------------- Ray Train


def ray_train_loop(config: dict) -> None:
    """The Ray Train side: the default GPT under DDP, a random-token batch of this rank's
    share of the global batch, a checkpoint every ``every`` steps (rank 0 writes it), and
    rank 0's step times appended to a log the driver reads back."""
    import ray.train as train
    import torch
    import torch.nn.functional as F

    from raytrain_ext.models import build_model

    cfg = load_config(None, [])
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = train.torch.prepare_model(build_model(cfg.model, 0))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    start = _ray_train_restore(model, opt)
    _ray_train_note(config["log_dir"], "workers", {"rank": rank, "node_id": _node_id()})
    share = config["global_batch"] // world + (rank < config["global_batch"] % world)
    for step in range(start + 1, config["steps"] + 1):
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randint(0, cfg.model.vocab_size, (share, cfg.model.seq_len), generator=gen)
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            note = {"step": step, "time": time.time(), "world_size": world, "resumed_from": start}
            _ray_train_note(config["log_dir"], "steps", note)
        _ray_train_report(step, model, opt, config["every"] if rank == 0 else 0)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _ray_train_note(log_dir: str, kind: str, fields: dict) -> None:
    """Append a line the driver reads back: Ray Train's own reports reach the driver only
    through its controller, too late to time a step or to find a worker's node."""
    with open(os.path.join(log_dir, f"{kind}.jsonl"), "a") as f:
        f.write(json.dumps({**fields, "pid": os.getpid()}) + "\n")


def _ray_train_restore(model, opt) -> int:
    """Load the newest reported checkpoint, if any; the step it holds (0: none)."""
    import ray.train as train
    import torch

    checkpoint = train.get_checkpoint()
    if not checkpoint:
        return 0
    with checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return state["step"]


def _ray_train_report(step: int, model, opt, every: int) -> None:
    """``report`` every step (every rank must); with a checkpoint every ``every`` steps."""
    import ray.train as train
    import torch

    if not every or step % every:
        train.report({"step": step})
        return
    with tempfile.TemporaryDirectory() as tmp:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        torch.save(state, os.path.join(tmp, "state.pt"))
        train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(tmp))


def node_loss_ray_train(args, workdir: Path, name: str) -> dict:
    """Ray Train's run through the same node loss; figures from its workers' logs."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log_dir = workdir / name
    log_dir.mkdir(parents=True)
    if __name__ != "__main__":  # imported: ship the loop's module by value, not by name
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={
            "steps": args.steps,
            "every": 5,
            "global_batch": 12,
            "log_dir": str(log_dir),
        },
        scaling_config=ScalingConfig(
            num_workers=(1, 3),
            placement_strategy="SPREAD",
            elastic_resize_monitor_interval_s=GROW_CHECK_S,
        ),
        run_config=RunConfig(
            storage_path=str(workdir / "ray_train"),
            name=name,
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    with ray_cluster(3) as cluster:
        run = Background(trainer.fit)
        steps = log_dir / "steps.jsonl"
        wait_for(lambda: _logged_step(steps) >= args.fault_at, run, "Ray Train: the fault step")
        workers = _read_jsonl(log_dir / "workers.jsonl")
        victim = [w for w in workers if w["rank"] == 1][-1]["node_id"]
        fault = lose_a_node(cluster, victim, args.rejoin_after)
        run.result()
    figures = ray_train_figures(_read_jsonl(steps), fault)
    figures.update(wall_s=run.wall_s, fault_at_s=fault - run.started)
    return figures


def _read_jsonl(path: Path) -> List[dict]:
    """The complete lines of a log still being written (a half-written last one is skipped)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _logged_step(path: Path) -> int:
    rows = _read_jsonl(path)
    return rows[-1]["step"] if rows else 0


def ray_train_figures(steps: List[dict], fault: float) -> dict:
    """Recovery and grow-back from rank 0's step log.

    Every restart (failure or resize) starts new processes, so a new pid marks a new
    group, and tells it apart from a step the old rank 0 finished just after the fault.
    """
    new_group = [i for i in range(1, len(steps)) if steps[i]["pid"] != steps[i - 1]["pid"]]
    first = next(steps[i] for i in new_group if steps[i]["time"] > fault)
    fault_step = max(s["step"] for s in steps if s["time"] <= fault)
    figures = {
        "first_step_after_s": first["time"] - fault,
        "steps_redone": fault_step - first["resumed_from"],
        "fault_step": fault_step,
        "restored_from": "storage",
        "restore_s": None,
        "sizes": [steps[0]["world_size"]] + [steps[i]["world_size"] for i in new_group],
        "grow_pause_s": None,
        "grow_redone": None,
        "grow_state": None,
    }
    grows = [
        i
        for i in new_group
        if steps[i]["time"] > fault and steps[i]["world_size"] > steps[i - 1]["world_size"]
    ]
    if grows:  # a resize is a full restart from the last reported checkpoint
        prev, nxt = steps[grows[0] - 1], steps[grows[0]]
        figures.update(
            grow_pause_s=nxt["time"] - prev["time"],
            grow_redone=prev["step"] - nxt["resumed_from"],
            grow_state="storage",
            grow=f"{prev['world_size']}->{nxt['world_size']}",
        )
    return figures


# ---------------------------------------------------------------- the report


ROWS = [
    ("fault -> first step after (s)", "first_step_after_s", "{:.2f}"),
    ("steps redone", "steps_redone", "{:.0f}"),
    ("grow-back pause (s)", "grow_pause_s", "{:.2f}"),
    ("steps redone at grow-back", "grow_redone", "{:.0f}"),
    ("wall time of the run (s)", "wall_s", "{:.1f}"),
]


def print_node_loss(args, ours: List[dict], ray_train: List[dict]) -> None:
    """The side-by-side table (ratios paired repeat by repeat), then each run's story."""
    print(
        f"\nnode loss: 3 workers, one per 1-CPU node; rank 1's node SIGKILLed after step "
        f">= {args.fault_at}, a fresh node added {args.rejoin_after:.0f} s later; "
        f"{args.steps} steps, a checkpoint every 5; {len(ours)} repeat(s), min-max"
    )
    print_side_by_side(ROWS, ours, ray_train, ("raytrain-ext", "Ray Train"), "Ray Train / ours")
    for who, runs in (("raytrain-ext", ours), ("Ray Train", ray_train)):
        for i, r in enumerate(runs, 1):
            print(
                f"  {who} #{i}: fault {r['fault_at_s']:.1f} s into fit(), after step "
                f"{r['fault_step']}; world sizes {r['sizes']}, "
                f"restored from {r['restored_from']}, "
                f"grow-back {r.get('grow', 'none')} (state from {r['grow_state']})"
                + (f"; {r['detail']}" if "detail" in r else "")
                + (f"\n    {r['steps_while_back']}" if "steps_while_back" in r else "")
            )


def node_loss(args) -> None:
    """Alternate the frameworks repeat by repeat, each on a fresh cluster."""
    workdir = Path(tempfile.mkdtemp(prefix="recovery-node-loss-"))
    ours, ray_train = [], []
    try:
        for i in range(args.repeats):
            ours.append(node_loss_ours(args, workdir, f"ours-{i}"))
            ray_train.append(node_loss_ray_train(args, workdir, f"ray-train-{i}"))
    finally:
        keep_or_remove(workdir, args.keep)
    print_node_loss(args, ours, ray_train)


def main(argv=None) -> None:
    """Node loss (60 steps, fault after 11 unless told) and/or the trends (20 and 8)."""
    args = parse_args(argv, "node-loss", __doc__)
    if args.scenario in ("node-loss", "all"):
        node_args = argparse.Namespace(**vars(args))
        node_args.steps = args.steps or 60
        node_args.fault_at = args.fault_at or 11
        node_loss(node_args)
    if args.scenario in ("world-size", "state-size", "all"):
        recovery_scaling.main(args)


if __name__ == "__main__":
    main()
