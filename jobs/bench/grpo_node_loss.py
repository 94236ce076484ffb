"""GRPO, a trainer node lost: healed in place against stopping and restarting the whole job
from its last checkpoint (what verl, OpenRLHF and NeMo-RL do), on the same cluster, in one
run.

Cluster (recovery_scaling.ray_cluster): a head with 0 CPUs and three 1-CPU nodes on this
machine, Ray's health checks tightened so a dead node is noticed in about 2 s.  The run is
configs/grpo_tiny.yaml (a tiny Llama, 4 prompt groups of 8 completions of at most 12
tokens a step, TRL's quick-start reward) on 2 trainer ranks spread over two nodes and 1
rollout engine (0.5 CPU, so on the third node), a checkpoint every 5 steps (memory tier on).
At step ``--fault-at`` the node of trainer rank 1 is SIGKILLed whole and a fresh node is
added ``--rejoin-after`` s later.
- in place (raytrain-ext): elastic 1..2; the survivor re-forms at 1 with its state, the
  engine keeps its process and weights, and the group grows back onto the new node.
- restart: the same run with ``elastic.max_failures=0``; the moment fit() fails, a new
  fit() of the same run starts (new trainers, a new rollout service and engine) and resumes
  from its newest checkpoint on disk.  It restarts in the same driver, with Ray connected
  and the imports warm: a real job restart (a new driver, ``ray job submit``) costs more.

Prints per mode fault -> first step after, steps redone and whether the engine kept its
process, and restart / in place; min-max over ``--repeats`` (the modes alternate).

Usage: python jobs/bench/grpo_node_loss.py [--repeats 2] [--steps 30] [--fault-at 11]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery_node_loss import lose_a_node  # noqa: E402 (sets the Ray environment first)
from recovery_scaling import (  # noqa: E402
    REPO,
    Background,
    keep_or_remove,
    load_config,
    ours_at_step,
    ours_recovery,
    print_side_by_side,
    ray_cluster,
    wait_for,
)

CONFIG = REPO / "configs" / "grpo_tiny.yaml"


def grpo_trainer(workdir: Path, name: str, steps: int, extra: List[str]):
    from raytrain_ext import Trainer

    return Trainer(
        load_config(
            str(CONFIG),
            [
                f"run.output_dir={workdir}",
                f"run.name={name}",
                "run.tensorboard=false",
                f"run.log_every={steps}",
                f"run.max_steps={steps}",
                "scaling.min_workers=1",
                "scaling.max_workers=2",
                "scaling.placement_strategy=SPREAD",
                "checkpoint.every_steps=5",
                "checkpoint.every_seconds=null",
                "checkpoint.memory=true",
                "elastic.grow_check_s=2",
                "elastic.grow_stable_s=1",
                "elastic.resize_cooldown_s=2",
                *extra,
            ],
        )
    )


def engine_pid(summary: dict) -> int:
    return summary["rollout"]["engines"][0][1]


def in_place(args, workdir: Path, name: str) -> dict:
    """Our run through the node loss; figures from its summary."""
    trainer = grpo_trainer(workdir, name, args.steps, ["elastic.max_failures=1"])
    with ray_cluster(3) as cluster:
        run = Background(trainer.fit)
        wait_for(lambda: ours_at_step(trainer, args.fault_at), run, "in place: the fault step")
        engines = trainer_engines(name)
        fault = lose_a_node(cluster, trainer.controller.group.infos[1].node_id, args.rejoin_after)
        summary = run.result()
    figures = ours_recovery(summary, fault)
    figures["engine_kept"] = engines == [list(p) for p in summary["rollout"]["engines"]]
    figures["sizes"] = [h["world_size"] for h in summary["world_size_history"]]
    figures["generations"] = summary["rollout"]["generations"]
    return figures


def trainer_engines(run_name: str) -> list:
    """The run's engines' (node, pid) before the fault."""
    import ray

    from raytrain_ext.rollout.run_service import find_run_rollout

    placements = ray.get(find_run_rollout(run_name).engine_placements.remote(), timeout=30)
    return [list(p) for p in placements]


def restart(args, workdir: Path, name: str) -> dict:
    """The whole job stopped by the node loss and started again from its last checkpoint."""
    trainer = grpo_trainer(workdir, name, args.steps, ["elastic.max_failures=0"])
    with ray_cluster(3) as cluster:
        run = Background(trainer.fit)
        wait_for(lambda: ours_at_step(trainer, args.fault_at), run, "restart: the fault step")
        fault = lose_a_node(cluster, trainer.controller.group.infos[1].node_id, args.rejoin_after)
        run.thread.join(600)
        if not isinstance(run.outcome, BaseException):
            raise RuntimeError(f"the run did not fail on the node loss: {run.outcome!r:.300}")
        failed_at = time.time()
        last = last_step_before(workdir / name, fault)
        again = grpo_trainer(workdir, name, args.steps, ["elastic.max_failures=0"])
        summary = again.fit()
    restored = summary["restored"]["step"]
    first_end = summary["step_end_times"][0][1]
    return {
        "first_step_after_s": first_end - fault,
        "steps_redone": last - restored,
        "fault_step": last,
        "engine_kept": False,
        "sizes": [h["world_size"] for h in summary["world_size_history"]],
        "generations": summary["rollout"]["generations"],
        "detail": f"the job failed {failed_at - fault:.2f} s after the fault, resumed at "
        f"step {restored} from {summary['restored']['tier']}",
    }


def last_step_before(run_dir: Path, fault: float) -> int:
    """The newest step rank 0 finished before the fault (from metrics.jsonl)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return max(r["step"] for r in map(json.loads, lines) if r["time"] <= fault)


ROWS = (
    ("fault -> first step after (s)", "first_step_after_s", "{:.2f}"),
    ("steps redone", "steps_redone", "{:.0f}"),
)


def report(args, ours: List[dict], peer: List[dict]) -> None:
    print(
        f"\nGRPO trainer node loss: 2 trainer ranks on two 1-CPU nodes, 1 engine on a third; "
        f"rank 1's node SIGKILLed after step >= {args.fault_at}, a fresh node added "
        f"{args.rejoin_after:.0f} s later; {args.steps} steps, a checkpoint every 5; "
        f"{len(ours)} repeat(s), min-max"
    )
    print_side_by_side(ROWS, ours, peer, ("in place", "restart"), "restart / in place")
    for who, runs in (("in place", ours), ("restart", peer)):
        for i, r in enumerate(runs, 1):
            print(
                f"  {who} #{i}: after step {r['fault_step']}; world sizes {r['sizes']}, "
                f"engine kept {r['engine_kept']}, {r['generations']} generations; {r['detail']}"
            )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault-at", type=int, default=11)
    parser.add_argument("--rejoin-after", type=float, default=3.0)
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="grpo-node-loss-"))
    ours, peer = [], []
    try:
        for i in range(args.repeats):
            ours.append(in_place(args, workdir, f"in-place-{i}"))
            peer.append(restart(args, workdir, f"restart-{i}"))
    finally:
        keep_or_remove(workdir, args.keep)
    report(args, ours, peer)


if __name__ == "__main__":
    main()
