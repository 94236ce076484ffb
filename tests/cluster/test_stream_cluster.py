"""A Ray Data stream on a 3-node cluster without a shared filesystem, consumed exactly once
through every fault from outside: a SIGKILLed worker, a SIGKILLed reader, a lost node and
its grow-back, and a stop resumed on another world size.

No path is shared by the workers: the Parquet files and the checkpoints live on S3 (moto's
server), the checkpoints' other tier is the object store (``checkpoint.local=false``), and
nothing of the dataset is written anywhere (the run directory holds the driver's records
only).  What the run consumed is compared with the stream read straight through by a
:class:`StreamReader` in the test: the same samples, in the same steps, in the same order
(``stream_fingerprint``: a hash chain over every step's token ids), and every position once
(``samples_digest``).
"""

import os
import signal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raytrain_ext import Trainer, load_config
from raytrain_ext.data import open_token_dataset
from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.stream_reader import StreamReader
from raytrain_ext.data.stream_samples import SamplePacker
from raytrain_ext.train.ledger import SampleLedger
from tests.helpers.leaks import assert_nothing_left
from tests.helpers.runs import (
    FAST_MODEL,
    FitThread,
    last_step,
    recovered,
    tiny_overrides,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

BATCH, SEQ, WINDOW, AHEAD = 12, 64, 64, 4
BUCKET = "stream-data"
AFTER = 6  # steps the resumed run trains after the stop


def write_parquet(endpoint: str) -> pafs.S3FileSystem:
    """Three Parquet files of token-id lists on S3 (900 samples: 75 steps an epoch)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=BUCKET)
    fs = pafs.S3FileSystem(
        endpoint_override=endpoint.removeprefix("http://"),
        scheme="http",
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )
    tokens = open_token_dataset("builtin:corpus", SEQ).tokens[: 900 * SEQ + 1].astype(np.int64)
    for i, part in enumerate(np.array_split(tokens, 3)):
        records = [c.tolist() for c in np.array_split(part, 30)]
        sink = pa.BufferOutputStream()  # (pyarrow's multipart upload fails on moto)
        pq.write_table(pa.table({"tokens": records}), sink)
        s3.put_object(
            Bucket=BUCKET, Key=f"tokens/part-{i}.parquet", Body=sink.getvalue().to_pybytes()
        )
    return fs


def dataset(fs):
    import ray

    return ray.data.read_parquet(f"{BUCKET}/tokens", filesystem=fs)


def straight_through(fs, steps: int) -> str:
    """The stream's fingerprint after ``steps`` steps, the files read in order by pyarrow
    (no Ray Data, no training)."""
    files = sorted(f"{BUCKET}/tokens/part-{i}.parquet" for i in range(3))
    reader = StreamReader(
        lambda epoch: (pq.read_table(f, filesystem=fs) for f in files),
        lambda: SamplePacker(DataFormat.tokens, SEQ),
        BATCH,
        vocab_size=512,
        seed=7,
        shuffle_window=WINDOW,
    )
    try:
        return reader.take(steps - 1)[0].digest
    finally:
        reader.close()


def config(tmp_path, endpoint: str, steps: int, *extra: str):
    """``steps``: the first run's are more than it can reach before the test stops it."""
    return load_config(
        None,
        tiny_overrides(
            tmp_path,
            *FAST_MODEL,
            "run.name=streamed",
            f"run.max_steps={steps}",
            "optim.decay_steps=200",
            f"data.global_batch_size={BATCH}",
            "data.micro_batch_size=2",
            "data.seed=7",
            f"data.stream_shuffle_window={WINDOW}",
            f"data.stream_ahead_steps={AHEAD}",
            "scaling.placement_strategy=SPREAD",
            "scaling.min_workers=2",
            "elastic.replacement=in_place",  # the killed worker's place: waited for (sizes)
            "parallel.timeout_s=15",
            "elastic.max_failures=4",
            "checkpoint.memory=true",
            "checkpoint.local=false",
            "checkpoint.every_steps=5",
            "checkpoint.every_seconds=null",
            f"checkpoint.s3.uri=s3://{BUCKET}/checkpoints",
            f"checkpoint.s3.endpoint_url={endpoint}",
            *extra,
        ),
    )


def running_at(trainer, size: int, after_step: int) -> bool:
    c = trainer.controller
    return (
        c.state.value == "RUNNING"
        and c.group.world_size == size
        and last_step(trainer) > after_step
    )


def reader_stats(run_name: str) -> dict:
    import ray

    return ray.get(ray.get_actor(f"raytrain_ext.stream.{run_name}").stats.remote())


def test_a_parquet_stream_on_s3_is_consumed_once_through_kills_a_lost_node_and_a_resume(
    ray_cluster, s3_endpoint, tmp_path
):
    nodes = {}
    for _ in range(3):  # a trainer, a lost node's bundle re-placed by Ray, Ray Data's reads
        node = ray_cluster.add_node(num_cpus=3, object_store_memory=100 * 2**20)
        nodes[node.node_id] = node
    ray_cluster.wait_for_nodes()
    fs = write_parquet(s3_endpoint)
    trainer = Trainer(
        config(tmp_path, s3_endpoint, 10_000, "scaling.num_workers=3"), dataset=dataset(fs)
    )
    with FitThread(trainer) as run:
        wait_until(lambda: last_step(trainer) >= 4, "step 4")
        os.kill(trainer.controller.group.infos[1].pid, signal.SIGKILL)  # a worker
        wait_until(lambda: running_at(trainer, 3, 8), "the killed rank's replacement")
        lost_reader = reader_stats("streamed")
        os.kill(lost_reader["pid"], signal.SIGKILL)  # the reader: Ray restarts it
        killed_at = last_step(trainer)
        # the ranks hold up to AHEAD steps fetched before the loss (and the records lag the
        # ranks): the restarted reader is asked for the ones after (it re-reads up to them)
        wait_until(lambda: last_step(trainer) >= killed_at + 2 * AHEAD + 2, "the reader's restart")
        restarted = reader_stats("streamed")
        lost = trainer.controller.group.infos[2].node_id
        before = len(trainer.controller.result.recovery_log)
        ray_cluster.remove_node(nodes.pop(lost), allow_graceful=False)
        wait_until(
            lambda: (
                recovered(trainer, before + 1) and last_step(trainer) > killed_at + 2 * AHEAD + 2
            ),
            "the recovery from the node loss",
        )
        # a shrink to 2 as a rule, grown back on a fresh node; under load Ray may re-place
        # the lost node's bundle on a survivor with a CPU free first, and the group is then
        # replaced at 3, or grown back to 3 on that CPU before the fresh node comes
        if trainer.controller.group.world_size == 2:
            ray_cluster.add_node(num_cpus=3, object_store_memory=100 * 2**20)
        wait_until(lambda: running_at(trainer, 3, killed_at + 2 * AHEAD + 4), "the grow-back", 180)
        trainer.interrupt("the test stops it")
        first = run.summary(timeout_s=120)
    stopped = first["steps_completed"]
    assert first["status"] == "interrupted"
    # the killed worker replaced at 3, the lost node shrunk to 2, grown back to 3 (a loaded
    # machine may add a re-form at 3 before the loss: a rank timed out; it is named below)
    sizes = [h["world_size"] for h in first["world_size_history"]]
    reasons = [r.reason for r in trainer.controller.result.recovery_log]
    after_loss = sizes[-2:] in ([2, 3], [3, 3])  # shrunk and grown back, or replaced
    assert len(sizes) >= 3 and set(sizes[:-2]) == {3} and after_loss, (sizes, reasons)
    assert restarted["pid"] != lost_reader["pid"] and restarted["skipped_steps"] > 0
    steps = stopped + AFTER
    resumed = Trainer(
        config(tmp_path, s3_endpoint, steps, "scaling.num_workers=2"), dataset=dataset(fs)
    )
    summary = resumed.fit()
    assert summary["status"] == "finished" and summary["steps_completed"] == steps
    assert summary["restored"]["step"] == stopped
    assert {h["world_size"] for h in summary["world_size_history"]} == {2}
    # the same samples, in the same steps and order, as the stream read straight through
    assert summary["stream_fingerprint"] == straight_through(fs, steps)
    ledger = SampleLedger()
    for step in range(steps):
        ledger.record(step, np.arange(step * BATCH, (step + 1) * BATCH))
    assert summary["samples_digest"] == ledger.digest  # every position once
    run_dir = tmp_path / "streamed"
    written = {p.name for p in run_dir.iterdir()}
    assert not written & {"checkpoints", "ray-dataset", "data-cache"}, written
    assert_nothing_left()
