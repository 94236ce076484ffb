"""Recovery trends of raytrain-ext (how the time to resume grows with the world size and
with the size of the training state), and the harness it shares with the node-loss bench.

Both tables kill one worker process (rank 1) from outside with SIGKILL after step
`--fault-at` (8) of a short run (`--steps`, 20), checkpoints every 5 steps with the memory
tier on, `elastic.max_failures=1`, on a `ray.cluster_utils.Cluster` of a 0-CPU head and four
1-CPU worker nodes (workers take a quarter CPU each, spread over the nodes):
(a) world size 2, 4, 8, 16 (`--sizes`): the global batch stays 16 (micro-batch 16/N), so a
    step does the same work at every size and only the recovery's own cost grows;
(b) state size: 2 workers, GPT shapes whose model + AdamW state is about 1, 10 and 50 MiB.
Each table prints fault -> first step after, steps redone and the restore time (min-max
over `--repeats`; `--details` adds each run's detect / decide / restore).

The harness: a throw-away multi-node Cluster (torn down whatever happens: the machine is
shared, `ray stop` is not an option), `fit()` in a thread, our run's figures from its
summary, and the command line of both benches.

Usage: python jobs/bench/recovery_scaling.py [--scenario world-size|state-size|all]
       [--repeats 1] [--steps 20] [--sizes 2,4,8,16] [--details]
(the same as `python jobs/bench/recovery_node_loss.py --scenario world-size`, ...)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# before ray is imported (see FIELD_NOTES): loopback-only clusters, fast node-death detection,
# and Ray Train's health check (which also paces its report()) as often as our poll (0.2 s)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
FAST_HEALTH = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}
os.environ.update(FAST_HEALTH)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

from raytrain_ext.config import load_config  # noqa: E402

MIB = 2**20
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * MIB}
RUN_TIMEOUT_S = 900.0


# ---------------------------------------------------------------- the harness both benches share


@contextlib.contextmanager
def ray_cluster(nodes: int, **node_args):
    """A head with 0 CPUs plus ``nodes`` worker nodes, the driver connected to it.

    Whatever happens, this cluster (and only this one) is torn down again: the
    machine is shared, so `ray stop` is not an option.
    """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 100 * MIB,
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
        },
    )
    try:
        for _ in range(nodes):
            cluster.add_node(**{**NODE_ARGS, **node_args})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        _tear_down(cluster)


def _tear_down(cluster) -> None:
    """Every step runs even when one fails, so no raylet is left behind."""
    import ray

    for step in (ray.shutdown, cluster.shutdown):
        with contextlib.suppress(Exception):
            step()
    for node in [*cluster.worker_nodes, *([cluster.head_node] if cluster.head_node else [])]:
        with contextlib.suppress(Exception):
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    ray.experimental.internal_kv._internal_kv_reset()
    ray._common.utils.reset_ray_address()


class Background:
    """A ``fit()`` in a thread (the main thread must stay free to add nodes), with the
    wall time of the call and its result or exception."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.outcome, self.wall_s = fn, None, None
        self.started = time.time()
        self.thread = threading.Thread(target=self._run, daemon=True, name="fit")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.outcome = self.fn()
        except BaseException as e:  # handed to the main thread
            self.outcome = e
        self.wall_s = time.time() - self.started

    def result(self, timeout_s: float = RUN_TIMEOUT_S) -> Any:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"fit() still running after {timeout_s:.0f} s")
        if isinstance(self.outcome, BaseException):
            raise RuntimeError(f"fit() failed: {self.outcome!r}") from self.outcome
        return self.outcome

    def alive(self) -> bool:
        return self.thread.is_alive()


def wait_for(probe: Callable[[], Any], run: Background, what: str, timeout_s: float = 600.0):
    """Poll ``probe`` until it returns a truthy value; fail if the run ends first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and run.alive():
        value = probe()
        if value:
            return value
        time.sleep(0.02)
    ended = "" if run.alive() else f"; it ended with {run.outcome!r}"
    raise RuntimeError(f"gave up waiting for {what} (run alive: {run.alive()}{ended})")


def ours_at_step(trainer, step: int) -> bool:
    """Whether our run has finished ``step``.

    The records the controller forwards lag a poll (0.2 s) or more behind, which on a
    loaded machine is a step or two; close to ``step`` the ranks' heartbeats are asked
    instead (read-only, unlike the controller's poll, which takes the records).
    """
    controller = trainer.controller
    records = controller.result.records if controller is not None else []
    if not records or records[-1]["step"] < step - 2:
        return False
    beats = controller.group.heartbeats(timeout_s=1.0)
    return max((b.step for b in beats.values()), default=0) >= step


def ours_trainer(workdir: Path, name: str, steps: int, extra: List[str]):
    """A Trainer of the default model writing under ``workdir/name`` (a fresh run each time:
    the same name would resume from the previous run's checkpoints)."""
    from raytrain_ext import Trainer

    return Trainer(
        load_config(
            None,
            [
                f"run.output_dir={workdir}",
                f"run.name={name}",
                "run.tensorboard=false",
                f"run.log_every={steps}",
                f"run.max_steps={steps}",
                f"optim.decay_steps={steps}",
                "checkpoint.every_steps=5",
                "checkpoint.every_seconds=null",
                "checkpoint.memory=true",
                *extra,
            ],
        )
    )


def ours_recovery(summary: dict, fault: float) -> dict:
    """Fault -> first step after and steps redone, from the first recovery opened after the
    fault and rank 0's step end times.

    The first step after is the first to end once the controller is RUNNING again: a
    controller that lets a later re-form (a grow-back) re-account the recovery record
    (so ``first_step_after_s``, ``steps_redone`` and the restore are the grow-back's)
    then still gives the right figures; the restore is left out when that happened.
    """
    recovery = next((r for r in summary["recoveries"] if r["detected_at"] >= fault - 1.0), None)
    if recovery is None:
        raise RuntimeError(f"no recovery after the fault; transitions: {summary['transitions']}")
    running = next(
        t["at"] for t in summary["transitions"] if t["target"] == "RUNNING" and t["at"] > fault
    )
    step, end = next((step, end) for step, end in summary["step_end_times"] if end > running)
    detect = recovery["detected_at"] - fault
    own = abs(recovery["detected_at"] + recovery["first_step_after_s"] - end) < 0.01
    if own and recovery.get("phases"):  # the record's split of every second after detection
        after = {k: v for k, v in recovery["phases"].items() if k not in ("detect", "decide")}
        restore = "then " + ", ".join(f"{k} {v:.2f}" for k, v in after.items()) + " s"
    elif own:
        rest = end - fault - detect - recovery["decided_s"] - recovery["restore_s"]
        restore = f"restore {recovery['restore_s']:.2f} s, the rest (re-form, step) {rest:.2f} s"
    else:
        restore = "restore n/a (the record was re-accounted by a later re-form)"
    return {
        "first_step_after_s": end - fault,
        "steps_redone": recovery["last_step"] - (step - 1),
        "restored_from": recovery["restored_from"] if own else "?",
        "restore_s": recovery["restore_s"] if own else None,
        "fault_step": recovery["last_step"],
        "detail": (
            f"detect {detect:.2f} s, decide {recovery['decided_s']:.2f} s "
            f"({recovery.get('decision')}, {recovery.get('world_size')} workers), {restore}"
        ),
    }


def span(values: List[Optional[float]], fmt: str = "{:.2f}") -> str:
    """min-max over the repeats; "n/a" for a repeat that had nothing to measure (no
    grow-back, say), counted when others had."""
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    lo, hi = fmt.format(min(known)), fmt.format(max(known))
    missing = len(values) - len(known)
    return (lo if lo == hi else f"{lo}-{hi}") + (f" ({missing} n/a)" if missing else "")


def print_side_by_side(
    rows, ours: List[dict], peer: List[dict], names: Tuple[str, str], ratio: str
) -> None:
    """A table of ``rows`` ((label, key, format) each), our runs beside the peer's, min-max
    over the repeats, and the ratio peer / ours paired repeat by repeat (n/a where ours is
    0 or the peer has no figure)."""
    print(f"{'':32}{names[0]:>16}{names[1]:>16}{ratio:>{len(ratio) + 4}}")
    for label, key, fmt in rows:
        ratios = [
            b[key] / a[key] if a[key] and b[key] is not None else None
            for a, b in zip(ours, peer, strict=False)
        ]
        print(
            f"{label:32}{span([a[key] for a in ours], fmt):>16}"
            f"{span([b[key] for b in peer], fmt):>16}{span(ratios, '{:.1f}x'):>{len(ratio) + 4}}"
        )


def keep_or_remove(workdir: Path, keep: bool) -> None:
    """The runs' directories (summary.json, Ray Train's step logs) stay with ``--keep``."""
    if keep:
        print(f"run directories kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def parse_args(argv=None, default_scenario: str = "node-loss", doc: str = __doc__):
    """The command line of both benches; each runs the parts of ``--scenario`` it holds
    (recovery_node_loss.py all of them)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--scenario",
        choices=["node-loss", "world-size", "state-size", "all"],
        default=default_scenario,
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, help="steps per run (default 60; trends 20)")
    parser.add_argument("--fault-at", type=int, help="fault after this step (11; trends 8)")
    parser.add_argument("--rejoin-after", type=float, default=3.0, help="s before the new node")
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument(
        "--strategy",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="node-loss: our layout (fsdp: per-step snapshots, its default; Ray Train stays DDP)",
    )
    parser.add_argument("--sizes", default="2,4,8,16", help="world sizes of the trend")
    parser.add_argument("--details", action="store_true", help="trends: each run's recovery")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the trends


TREND_NODES = 4
# the 50 MiB state's checkpoints (2 kept in memory, each replicated on a second node) need
# more room than the node-loss scenario's 80 MiB stores
TREND_NODE_ARGS = {"num_cpus": 1, "object_store_memory": 200 * MIB}
WORKER_CPU = 0.25
# model + AdamW state (fp32 weights, two moments) of the default GPT at these shapes
STATE_SHAPES = {
    "~1 MiB": ["model.n_layers=1", "model.d_model=64"],
    "~10 MiB": [],  # the default: 4 layers of width 128
    "~50 MiB": ["model.n_layers=4", "model.d_model=288"],
}


def kill_a_worker(trainer, rank: int = 1) -> float:
    """SIGKILL rank ``rank``'s process once the run passed the fault step; the fault time."""
    pid = trainer.controller.group.infos[rank].pid
    fault = time.time()
    os.kill(pid, signal.SIGKILL)
    return fault


def trend_case(args, workdir: Path, name: str, overrides: List[str]) -> dict:
    """One run with a worker killed mid-way; its recovery figures."""
    trainer = ours_trainer(
        workdir,
        name,
        args.steps,
        [
            "scaling.placement_strategy=SPREAD",
            f"scaling.resources_per_worker.CPU={WORKER_CPU}",
            f"elastic.max_failures={args.max_failures}",
            *overrides,
        ],
    )
    run = Background(trainer.fit)
    wait_for(lambda: ours_at_step(trainer, args.fault_at), run, f"{name}: the fault step")
    fault = kill_a_worker(trainer)
    summary = run.result()
    return ours_recovery(summary, fault)


def state_mib(shape: List[str]) -> float:
    """Model + AdamW state of a shape (three fp32 copies of the parameters), in MiB."""
    from raytrain_ext.models import build_model

    model = build_model(load_config(None, shape).model, 0)
    return sum(p.numel() for p in model.parameters()) * 3 * 4 / MIB


def world_size_table(args, workdir: Path) -> None:
    """Table (a): one cluster for every size, each run a fresh run directory."""
    sizes = [int(n) for n in args.sizes.split(",")]
    rows = {n: [] for n in sizes}
    with ray_cluster(TREND_NODES, **TREND_NODE_ARGS):
        for i in range(args.repeats):
            for n in sizes:
                overrides = [
                    f"scaling.num_workers={n}",
                    "scaling.min_workers=1",
                    f"scaling.max_workers={n}",
                    "data.global_batch_size=16",
                    f"data.micro_batch_size={max(1, 16 // n)}",
                ]
                rows[n].append(trend_case(args, workdir, f"world-{n}-{i}", overrides))
    print(
        f"\n(a) world size: rank 1's process SIGKILLed after step >= {args.fault_at} of "
        f"{args.steps}; {TREND_NODES} 1-CPU nodes, {WORKER_CPU} CPU a worker, global batch 16; "
        f"{args.repeats} repeat(s), min-max"
    )
    print_rows("workers", {str(n): r for n, r in rows.items()}, args.details)


def state_size_table(args, workdir: Path) -> None:
    """Table (b): the default run at three model shapes; the state printed is computed
    from the parameter count, not read from a checkpoint."""
    rows = {label: [] for label in STATE_SHAPES}
    with ray_cluster(TREND_NODES, **TREND_NODE_ARGS):
        for i in range(args.repeats):
            for j, (label, shape) in enumerate(STATE_SHAPES.items()):
                overrides = ["scaling.num_workers=2", *shape]
                rows[label].append(trend_case(args, workdir, f"state-{j}-{i}", overrides))
    print(
        f"\n(b) state size: 2 workers, rank 1's process SIGKILLed after step >= {args.fault_at} "
        f"of {args.steps}; {args.repeats} repeat(s), min-max"
    )
    labels = {f"{label} ({state_mib(STATE_SHAPES[label]):.1f})": r for label, r in rows.items()}
    print_rows("model+optimizer MiB", labels, args.details)


def print_rows(first: str, rows: dict, details: bool) -> None:
    """One row per case, min-max over its repeats (``details``: each run's breakdown)."""
    print(
        f"{first:>22}{'fault -> first step (s)':>26}{'steps redone':>14}"
        f"{'restore (s)':>14}{'restored from':>16}"
    )
    for label, runs in rows.items():
        print(
            f"{label:>22}{span([r['first_step_after_s'] for r in runs]):>26}"
            f"{span([r['steps_redone'] for r in runs], '{:.0f}'):>14}"
            f"{span([r['restore_s'] for r in runs]):>14}"
            f"{'/'.join(sorted({str(r['restored_from']) for r in runs})):>16}"
        )
        for i, r in enumerate(runs if details else [], 1):
            print(f"{'':>22}  #{i}: {r['detail']}")


def main(args) -> None:
    """Run the trend table(s) ``args.scenario`` names (``all``: both)."""
    args.steps = args.steps or 20
    args.fault_at = args.fault_at or 8
    workdir = Path(tempfile.mkdtemp(prefix="recovery-scaling-"))
    try:
        if args.scenario in ("world-size", "all"):
            world_size_table(args, workdir)
        if args.scenario in ("state-size", "all"):
            state_size_table(args, workdir)
    finally:
        keep_or_remove(workdir, args.keep)


if __name__ == "__main__":
    main(parse_args(default_scenario="all"))  # node-loss: recovery_node_loss.py
