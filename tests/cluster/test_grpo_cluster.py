"""GRPO on a 3-node ``Cluster`` (two trainer nodes, one engine node), faults from outside:
an engine's process SIGKILLed while the run generates, then a trainer's node removed.  The
run finishes; the other engine keeps its process through both; no step is generated twice;
and the ledger holds exactly the prompt groups of the global order, each step's whole, as
computed here from the sampler alone (the world shrank from 2 to 1 in between)."""

from __future__ import annotations

import os
import signal

import pytest

from raytrain_ext import Trainer
from raytrain_ext.config import load_config
from raytrain_ext.rollout.run_service import find_run_rollout
from tests.helpers.grpo import CONFIG, expected_samples_digest
from tests.helpers.runs import FitThread, last_step, step_floor, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

STEPS, GROUPS = 16, 4


def test_grpo_through_a_killed_engine_and_a_lost_trainer_node(ray_cluster, tmp_path):
    trainer_nodes = [ray_cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20) for _ in "ab"]
    ray_cluster.add_node(num_cpus=1, resources={"rollout": 2}, object_store_memory=80 * 2**20)
    ray_cluster.wait_for_nodes()
    nodes = {node.node_id: node for node in trainer_nodes}
    cfg = load_config(
        str(CONFIG),
        [
            f"run.output_dir={tmp_path}",
            "run.name=grpo-cluster",
            f"run.max_steps={STEPS}",
            "run.tensorboard=false",
            f"data.global_batch_size={GROUPS}",
            "scaling.num_workers=2",
            "scaling.min_workers=1",
            "scaling.resources_per_worker={CPU: 1}",
            "scaling.placement_strategy=SPREAD",
            "rollout.engines=2",
            "rollout.groups_per_call=2",
            "rollout.resources_per_engine={CPU: 0.5, rollout: 1}",
            "parallel.timeout_s=15",
            "checkpoint.memory=true",
            # every step at least 0.3 s (a sleep changes no number): the node goes mid-run,
            # not after the last step however fast the machine
            *step_floor(0.3, attempts=3),
        ],
    )
    trainer = Trainer(cfg)
    with FitThread(trainer) as run:
        wait_until(lambda: last_step(trainer) >= 2, "step 2", timeout_s=180)
        import ray

        service = find_run_rollout("grpo-cluster")
        engines = ray.get(service.engine_placements.remote(), timeout=30)
        os.kill(engines[0][1], signal.SIGKILL)
        wait_until(lambda: last_step(trainer) >= 6, "step 6")
        ray_cluster.remove_node(nodes[trainer.controller.group.infos[1].node_id], False)
        summary = run.summary(timeout_s=300)
    assert summary["status"] == "finished" and summary["steps_completed"] == STEPS
    assert [h["world_size"] for h in summary["world_size_history"]] == [2, 1]
    (recovery,) = summary["recoveries"]
    assert recovery.get("lost") == [{"rank": 1, "fate": "node_died"}], recovery
    (lost_engine,) = summary["rollout_recoveries"]
    assert lost_engine["engine"] == 0
    final = summary["rollout"]["engines"]
    assert final[1] == list(engines[1]) and final[0][1] != engines[0][1]
    assert summary["samples_consumed"] == STEPS * GROUPS
    assert summary["samples_digest"] == expected_samples_digest(STEPS, GROUPS, cfg.data.seed)
    assert recovery["last_step"] < STEPS and recovery["restored_from"] == "peers", recovery
    assert recovery["steps_redone"] == 0
    assert summary["rollout"]["generated_steps"] == list(range(1, STEPS + 1))  # each once
