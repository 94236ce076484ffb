"""A Ray Train loop (raytrain_ext.train.TorchTrainer) on a 3-node cluster, checkpoints on
S3, through faults from outside: a SIGKILLed worker, a removed node and its grow-back.

The loop is fed by ``get_dataset_shard`` of a Ray Dataset alone
(tests/helpers/ray_train_loops.py: one report per batch, a checkpoint every CADENCE);
what is asserted is what a user of Ray Train would look at: the run completes, rank 0
keeps its process through every fault (it reports its pid), the metrics history repeats
no report beyond what the checkpoint cadence implies (nothing at all for the grow-back,
which stops at a checkpointed report), and every row stands exactly once per epoch
although the group took its rounds at world sizes 3, 2 and 3 again.
"""

import os
import signal
from collections import Counter

import pyarrow.fs as pafs
import pytest

from tests.helpers.leaks import assert_nothing_left
from tests.helpers.ray_train_loops import OURS, dataset_loop, line_rows, standing_ids
from tests.helpers.runs import FitThread, recovered, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

BUCKET, EPOCHS, CADENCE, ROWS = "loops", 7, 3, 120


def s3(endpoint: str) -> pafs.S3FileSystem:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    return pafs.S3FileSystem(
        endpoint_override=endpoint.removeprefix("http://"),
        scheme="http",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
        allow_delayed_open=True,  # small files in one PUT: moto fails pyarrow's multipart ones
    )


def reports(run) -> int:
    return 0 if run.controller is None else len(run.controller.result.records)


def running_at(run, size: int, after: int) -> bool:
    c = run.controller
    return (
        c is not None
        and c.state.value == "RUNNING"
        and c.group.world_size == size
        and reports(run) > after
    )


def test_a_ray_train_loop_survives_a_kill_a_lost_node_and_grows_back(
    ray_cluster, s3_endpoint, tmp_path
):
    import ray

    import raytrain_ext.train as train

    nodes = {}
    for _ in range(3):
        node = ray_cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        nodes[node.node_id] = node
    ray_cluster.wait_for_nodes()
    run = train.TorchTrainer(
        dataset_loop,
        train_loop_config={
            "api": OURS,
            "epochs": EPOCHS,
            "batch_size": 2,
            "every": CADENCE,
            "step_sleep_s": 0.03,
            "full_world": 3,
            "shrunk_step_sleep_s": 0.5,  # 150 reports at world 2 leave 75 s to grow back
        },
        datasets={"train": ray.data.from_items(line_rows(ROWS))},
        scaling_config=train.ScalingConfig(num_workers=(2, 3), placement_strategy="SPREAD"),
        run_config=train.RunConfig(
            name="loop",
            storage_path=f"s3://{BUCKET}/runs",
            storage_filesystem=s3(s3_endpoint),
            failure_config=train.FailureConfig(max_failures=3),
            checkpoint_config=train.CheckpointConfig(num_to_keep=2),
        ),
    )
    with FitThread(run) as thread:
        wait_until(  # a checkpoint to resume from: the kill then re-forms past step 0
            lambda: running_at(run, 3, 3) and run.storage.latest() is not None,
            "a committed checkpoint of three workers",
        )
        group = run.controller.group
        os.kill(group.infos[1].pid, signal.SIGKILL)
        killed_at = reports(run)
        wait_until(
            lambda: recovered(run, 1) and running_at(run, 3, killed_at),
            "the killed rank's replacement",
        )
        lost = run.controller.group.infos[2].node_id
        ray_cluster.remove_node(nodes.pop(lost), allow_graceful=False)
        lost_at = reports(run)
        wait_until(lambda: recovered(run, 2) and running_at(run, 2, lost_at), "the shrink")
        ray_cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        shrunk_at = reports(run)
        wait_until(lambda: running_at(run, 3, shrunk_at), "the grow-back", 180)
        result = thread.join(timeout_s=300)
    assert not isinstance(result, Exception), result
    summary = result.summary
    assert [h["world_size"] for h in summary["world_size_history"]] == [3, 3, 2, 3]
    kill, node_loss = summary["recoveries"]
    assert kill["decision"] == "replace" and node_loss["decision"] == "shrink"
    (grow,) = summary["resizes"]
    assert grow["in_place"] and (grow["from"], grow["to"]) == (2, 3)
    history = result.metrics_history
    assert {m["pid"] for m in history} == {history[0]["pid"]}  # rank 0 never restarted
    counts = Counter(m["count"] for m in history)
    assert sorted(counts) == list(range(1, max(counts) + 1))
    repeated = sum(count - 1 for count in counts.values())
    assert repeated == kill["steps_redone"] + node_loss["steps_redone"]
    assert kill["steps_redone"] <= CADENCE - 1 and node_loss["steps_redone"] <= CADENCE - 1
    standing = standing_ids(history)
    assert sorted(standing) == list(range(EPOCHS))
    for ids in standing.values():  # once each; at most world-1 rows left over at the end
        assert len(ids) == len(set(ids)) and ROWS - 3 < len(ids) <= ROWS
        assert sorted(ids) == list(range(len(ids)))
    assert result.checkpoint.path.endswith(f"checkpoint_{max(counts):06d}")  # persisted on S3
    with result.checkpoint.as_directory() as directory:
        assert os.listdir(directory) == ["state.pt"]
    assert len(result.best_checkpoints) == 2
    assert_nothing_left()
