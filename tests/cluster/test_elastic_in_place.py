"""Elastic without a cold start, on real multi-node Ray clusters: a lost node shrinks the
group in place (survivors keep their processes and their state), a node that comes back
grows it in place, a lone killed process is replaced in place, and a sharded layout with
the per-step snapshot redoes at most one step.

Faults come from outside the run: ``Cluster.remove_node`` (SIGKILL of the node's
processes) and ``os.kill(pid, SIGKILL)``; nothing here goes through ``chaos.*``.

Tolerances: a group of 3 DDP ranks sums each gradient in another order than 2 ranks,
so parameters after segments at 3, 2 and 3 workers agree with the uninterrupted
2-rank run within ``ATOL_UNEVEN`` (tests/helpers/layouts.py), and samples exactly.
"""

import os
import signal
import time

import pytest

from raytrain_ext import Trainer, load_config
from raytrain_ext.checkpoint.export import load_model_state
from raytrain_ext.checkpoint.resolve import check_step
from raytrain_ext.checkpoint.tiers.disk import DiskTier
from tests.helpers.layouts import ATOL_UNEVEN
from tests.helpers.leaks import assert_nothing_left, idle_processes_with_torch
from tests.helpers.reference import uninterrupted
from tests.helpers.runs import (
    FAST_MODEL,
    FitThread,
    last_step,
    recovered,
    step_floor,
    tiny_overrides,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

SPLITS_3_AND_2 = ["data.global_batch_size=12", "data.micro_batch_size=2"]
THREE_WAY = [*SPLITS_3_AND_2, *FAST_MODEL]  # on the test-sized model
# Every step lasts at least 0.1 s (one rank sleeps, in every group of the run: a sleep
# changes no number), so that on a fast machine the run still outlasts what a test waits
# for mid-run (a spare's imports, a re-form) instead of finishing first.
STEP_FLOOR = step_floor(0.1, rank=1)


def add_nodes(cluster, count: int):
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20) for _ in range(count)]
    cluster.wait_for_nodes()
    return {n.node_id: n for n in nodes}


def run_config(tmp_path, steps: int, *extra: str):
    """The packaged default for ``steps`` steps, spread one worker a node, one failure
    allowed, the memory tier on (the settings every test here shares)."""
    return load_config(
        None,
        tiny_overrides(
            tmp_path,
            f"run.max_steps={steps}",
            f"optim.decay_steps={steps}",
            "scaling.placement_strategy=SPREAD",
            "checkpoint.memory=true",
            "parallel.timeout_s=15",
            "elastic.max_failures=1",
            *extra,
        ),
    )


def running_at(trainer, size: int) -> bool:
    c = trainer.controller
    return c.state.value == "RUNNING" and c.group.world_size == size


def processes(workers) -> set:
    """(node, pid) of each of a summary's ``workers``."""
    return {(w["node_id"], w["pid"]) for w in workers}


def group_processes(infos) -> set:
    """(node, pid) of each of the group's ranks (its ``RankInfo``s)."""
    return {(i.node_id, i.pid) for i in infos}


def test_node_loss_shrinks_in_place_from_peers_then_grows_back_in_place(ray_cluster, tmp_path):
    """3 nodes, one DDP worker each; rank 0's node (the rendezvous host) is lost mid-run.
    The two survivors keep their processes and re-form at 2 with their own state: no
    checkpoint read, no step redone.  A fresh node joins: Ray re-places the lost slot
    there, a spare warms up in it while the 2 ranks train, and it joins at a step
    boundary, taking the state from them."""
    nodes = add_nodes(ray_cluster, 3)
    # long enough for the spare to warm up beside 2 training ranks on 2 cores: the packaged
    # model, whose steps leave the spare about 20 s after the loss (the test-sized one left
    # 12 s, too few on a loaded CI)
    steps = 100
    cfg = run_config(
        tmp_path,
        steps,
        *SPLITS_3_AND_2,
        "scaling.num_workers=3",
        "scaling.min_workers=1",
        "checkpoint.every_steps=5",
        *STEP_FLOOR,
    )
    reference = uninterrupted(steps, *SPLITS_3_AND_2)
    trainer = Trainer(cfg)
    with FitThread(trainer) as run:
        wait_until(lambda: last_step(trainer) >= 8, "step 8")
        infos = trainer.controller.group.infos
        lost_node = infos[0].node_id
        survivors = group_processes(infos[1:])
        ray_cluster.remove_node(nodes[lost_node], allow_graceful=False)
        wait_until(lambda: running_at(trainer, 2), "the shrink")
        shrunk = group_processes(trainer.controller.group.infos)
        time.sleep(3.0)
        fresh = ray_cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        summary = run.summary(timeout_s=240)
    assert summary["status"] == "finished" and summary["steps_completed"] == steps
    assert shrunk == survivors  # the same processes, on their nodes: no restart
    assert [h["world_size"] for h in summary["world_size_history"]] == [3, 2, 3]
    (recovery,) = summary["recoveries"]
    assert recovery["decision"] == "shrink" and recovery["world_size"] == 2
    phases = recovery["phases"]  # the last step's end -> the first step's end, every second
    total = recovery["first_step_after_s"] + recovery["detected_at"] - recovery["last_step_at"]
    print("recovery phases", {k: round(v, 3) for k, v in phases.items()}, round(total, 3))
    assert abs(sum(phases.values()) - total) < 0.1
    assert phases["settle"] + phases["resume"] < 0.5  # after the restore, before the step
    assert recovery["reformed"] == {
        "kept": 2,
        "spares_used": 0,
        "started": 0,
        "prestarted": 0,
        "left_out": 1,
    }
    assert recovery["lost"] == [{"rank": 0, "fate": "node_died"}]  # Ray's verdict, recorded
    assert recovery["restored_from"] == "peers"  # no checkpoint was read
    assert recovery["steps_redone"] == 0 and recovery["restored_step"] == recovery["last_step"]
    (resize,) = summary["resizes"]
    assert resize["in_place"] and (resize["from"], resize["to"]) == (2, 3)
    assert resize["state_from"] == "peers" and 0 < resize["pause_s"] < 30
    final = processes(summary["workers"])
    assert survivors < final  # kept through the grow too
    (joined,) = final - survivors
    assert joined[0] == fresh.node_id  # the spare in the re-placed slot
    assert summary["samples_digest"] == reference["result"]["samples_digest"]  # exactly once
    disk = DiskTier(tmp_path / "tiny" / "checkpoints")
    ours, _ = load_model_state(disk, steps, check_step(disk, steps).manifest, tmp_path / "c")
    ref = reference["params"]
    assert max((ours[k] - ref[k]).abs().max().item() for k in ref) < ATOL_UNEVEN
    assert_nothing_left()


def kill_when_the_pool_is_stocked(trainer, rank: int, idle_before: set, steps: int):
    """SIGKILL ``rank``'s process once the pool's process on every node has started (its
    start, not the kill, is timed); returns the group's (node, pid) per rank before."""
    wait_until(lambda: len(idle_processes_with_torch() - idle_before) >= 3, "stocked pool")
    assert last_step(trainer) < steps - 4, "the run ended before its pool was stocked"
    before = [(i.node_id, i.pid) for i in trainer.controller.group.infos]
    os.kill(before[rank][1], signal.SIGKILL)
    return before


def test_killed_rank_0_then_last_rank_are_replaced_in_place_bit_identical(ray_cluster, tmp_path):
    """3 nodes, one worker each; rank 0's process (the rendezvous host), then the last
    rank's, SIGKILLed from outside.  Their nodes are alive (Ray says the worker process
    died), so each time a new process takes the lost rank's own place on the same node,
    the others keep theirs, and the state comes from the live peers: nothing redone, each
    rank's samples and the order of the gradient sums as before (3 ranks: another order
    would round differently), and the run ends bit-identical to the uninterrupted one."""
    add_nodes(ray_cluster, 3)
    steps = 60  # each kill waits for the pool's processes (3-4 s of imports at idle priority)
    cfg = run_config(
        tmp_path,
        steps,
        *THREE_WAY,
        "scaling.num_workers=3",
        "elastic.max_failures=2",
        "checkpoint.every_steps=100",  # only the final one
        *STEP_FLOOR,
    )
    reference = uninterrupted(steps, *THREE_WAY, world=3)["result"]
    trainer = Trainer(cfg)
    idle_before = idle_processes_with_torch()
    groups = []
    with FitThread(trainer) as run:
        wait_until(lambda: last_step(trainer) >= 6, "step 6")
        for count, victim in enumerate((0, 2), start=1):
            before = kill_when_the_pool_is_stocked(trainer, victim, idle_before, steps)
            wait_until(lambda n=count: recovered(trainer, n) and running_at(trainer, 3), "recovery")
            after = [(i.node_id, i.pid) for i in trainer.controller.group.infos]
            groups.append((victim, before, after))
        summary = run.summary(timeout_s=180)
    assert summary["status"] == "finished" and summary["steps_completed"] == steps
    for (victim, before, after), recovery in zip(groups, summary["recoveries"], strict=True):
        assert recovery["decision"] == "replace" and recovery["world_size"] == 3
        # the new process is the idle one the pool kept on that node, torch already imported
        assert recovery["reformed"] == {
            "kept": 2,
            "spares_used": 0,
            "started": 1,
            "prestarted": 1,
            "left_out": 0,
        }
        assert recovery["lost"] == [{"rank": victim, "fate": "process_died"}]
        assert recovery["restored_from"] == "peers" and recovery["steps_redone"] == 0
        # every rank in its place: the kept processes where they were, a new one on the
        # lost rank's node in its rank
        assert [a for r, a in enumerate(after) if r != victim] == [
            b for r, b in enumerate(before) if r != victim
        ]
        assert after[victim][0] == before[victim][0] and after[victim] != before[victim]
    assert [h["world_size"] for h in summary["world_size_history"]] == [3, 3, 3]
    assert summary["params_sha256"] == reference["params_sha256"]
    assert summary["samples_digest"] == reference["samples_digest"]
    assert_nothing_left()


def test_fsdp_node_loss_with_the_per_step_snapshot_redoes_at_most_one_step(ray_cluster, tmp_path):
    """3 nodes, FSDP (each rank holds a third of the state, so no rank can hand it all
    over); with ``checkpoint.snapshot_every_step`` (FSDP's default, set here so that no
    probe of its cost can turn it off on a loaded machine) every step is in the memory
    tier of another node, each update waiting for the last snapshot's persist.  A node is
    lost: the survivors re-form at 2 in place and reshard the newest snapshot, redoing at
    most one step.  Each save is held open for most of a step (``chaos.stall_save_s``), so
    the node is most likely lost while the survivors wait for a persist it breaks, after
    their step's collectives: the race that redid two steps under a loaded CI."""
    nodes = add_nodes(ray_cluster, 3)
    steps = 16
    cfg = run_config(
        tmp_path,
        steps,
        *THREE_WAY,
        "parallel.strategy=fsdp",
        "scaling.num_workers=3",
        "scaling.min_workers=1",
        "checkpoint.every_steps=null",
        "checkpoint.every_seconds=null",
        "checkpoint.snapshot_every_step=true",
        "chaos.stall_save_s=0.8",
    )
    reference = uninterrupted(steps, *THREE_WAY)["result"]
    trainer = Trainer(cfg)
    with FitThread(trainer) as run:
        wait_until(lambda: last_step(trainer) >= 6, "step 6")
        lost = trainer.controller.group.infos[2].node_id
        ray_cluster.remove_node(nodes[lost], allow_graceful=False)
        wait_until(lambda: running_at(trainer, 2), "the shrink")
        # a node comes back (Ray's GCS spins while a slot waits for one: FIELD_NOTES)
        ray_cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        summary = run.summary(timeout_s=240)
    assert summary["status"] == "finished" and summary["steps_completed"] == steps
    (recovery,) = summary["recoveries"]
    assert recovery["decision"] == "shrink" and recovery["world_size"] == 2
    assert recovery["restored_from"] == "memory" and recovery["steps_redone"] <= 1, recovery
    # the snapshot of the step the survivors stopped at: each copies its own shards
    # (checkpoint.held_chunks) and reads only what the lost rank held; an older one: all
    held = recovery["restore_bytes"]["held"]
    assert (held > 0) == (recovery["steps_redone"] == 0), recovery["restore_bytes"]
    assert recovery["restore_bytes"]["read"] > 0
    sizes = [h["world_size"] for h in summary["world_size_history"]]
    assert sizes in ([3, 2], [3, 2, 3])  # the spare joins if it warms up before the end
    for resize in summary["resizes"]:  # sharded: the pause saved, the spare restored it
        assert resize["state_from"] == "memory" and resize["in_place"]
        # the survivors held the step they paused at: rank 0 copied its own shards
        assert resize["restore_bytes"]["held"] > 0, resize
    assert summary["samples_digest"] == reference["samples_digest"]
    assert_nothing_left()
