"""The S3 tier against moto's standalone server, through real boto3 HTTP calls."""

import contextlib
import shutil
import threading
import time
import uuid

import boto3
import pytest
import torch

from raytrain_ext.checkpoint.tiers.base import TierError
from raytrain_ext.checkpoint.tiers.s3 import S3Tier
from tests.helpers.dist import train_processes

BASE = [
    "data.global_batch_size=8",
    "data.micro_batch_size=2",
    "optim.decay_steps=8",
    "checkpoint.every_steps=4",
    "checkpoint.every_seconds=null",
]


@pytest.fixture()
def bucket(s3_endpoint):
    name = f"ckpt-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


def keys(endpoint, bucket):
    listing = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listing.get("Contents", []))


@contextlib.contextmanager
def moto_checks_credentials():
    """Make the in-process moto server authenticate requests, as real S3 does."""
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    saved = (settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count)
    settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = 0, 0
    try:
        yield
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = saved


def test_write_probe_names_the_problem(s3_endpoint, bucket, monkeypatch):
    S3Tier(f"s3://{bucket}/run", endpoint_url=s3_endpoint).probe()  # a good one passes
    with pytest.raises(TierError, match=r"bucket 'no-such-bucket' does not exist"):
        S3Tier("s3://no-such-bucket/x", endpoint_url=s3_endpoint).probe()
    with pytest.raises(
        TierError,
        match=r"checkpoint\.s3\.endpoint_url: cannot reach "
        r"http://127\.0\.0\.1:9",
    ):
        S3Tier(f"s3://{bucket}/x", endpoint_url="http://127.0.0.1:9").probe()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong-key")
    with moto_checks_credentials():
        with pytest.raises(
            TierError,
            match=r"S3 credentials: no usable credentials for s3://\S+ "
            r"\(checkpoint\.s3\.uri\) at http://127.*"
            r"\(InvalidAccessKeyId\).* Fix the credentials",
        ):
            S3Tier(f"s3://{bucket}/x", endpoint_url=s3_endpoint).probe()
    assert keys(s3_endpoint, bucket) == []  # probes clean up after themselves


@pytest.mark.slow
def test_s3_only_run_resumes_bit_identically(s3_endpoint, bucket, tmp_path):
    s3 = [
        f"checkpoint.s3.uri=s3://{bucket}/runs/a",
        f"checkpoint.s3.endpoint_url={s3_endpoint}",
        "checkpoint.local=false",
    ]
    reference = train_processes(
        2, BASE + ["run.max_steps=8", "checkpoint.enabled=false"], tmp_path / "ref"
    )
    train_processes(2, BASE + s3 + ["run.max_steps=4"], tmp_path / "a")
    stored = keys(s3_endpoint, bucket)
    assert "runs/a/step-00000004/manifest.json" in stored
    assert {
        "runs/a/step-00000004/__0_0.distcp",
        "runs/a/step-00000004/__1_0.distcp",
        "runs/a/step-00000004/.metadata",
    } <= set(stored)
    resumed = train_processes(2, BASE + s3 + ["run.max_steps=8"], tmp_path / "b")
    result = resumed[0]["result"]
    assert result["restored"]["tier"] == "s3" and result["restored"]["step"] == 4
    assert result["params_sha256"] == reference[0]["result"]["params_sha256"]
    assert result["samples_digest"] == reference[0]["result"]["samples_digest"]


@pytest.mark.slow
def test_dual_write_survives_the_loss_of_local_disk(s3_endpoint, bucket, tmp_path):
    dual = [
        f"checkpoint.s3.uri=s3://{bucket}/dual",
        f"checkpoint.s3.endpoint_url={s3_endpoint}",
        f"checkpoint.dir={tmp_path / 'local'}",
        "checkpoint.keep_last=1",
    ]
    first = train_processes(2, BASE + dual + ["run.max_steps=8"], tmp_path / "a")
    assert first[0]["result"]["checkpoint"]["committed"] == {"local": 8, "s3": 8}
    assert sorted({k.split("/")[1] for k in keys(s3_endpoint, bucket)}) == ["step-00000008"]
    shutil.rmtree(tmp_path / "local")  # the node's disk is gone
    resumed = train_processes(2, BASE + dual + ["run.max_steps=10"], tmp_path / "b")
    assert resumed[0]["result"]["restored"]["tier"] == "s3"
    assert resumed[0]["result"]["restored"]["step"] == 8


@pytest.mark.slow
@pytest.mark.chaos
def test_s3_outage_during_training_delays_uploads_but_loses_nothing(aws_env, tmp_path):
    """The S3 server goes away for a few seconds mid-run and comes back on the same port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="outage")
    servers = [server]

    def outage():  # starts once training has committed its step-20 checkpoint locally
        marker = tmp_path / "local" / "step-00000020" / "manifest.json"
        deadline = time.time() + 120
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.02)
        servers[0].stop()
        # longer than botocore's own three attempts can bridge (backoff up to 1 + 2 s,
        # jittered): a 4 s outage was once absorbed there, and no retry of ours counted it
        time.sleep(8.0)
        servers.append(ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False))
        servers[-1].start()

    chaos = threading.Thread(target=outage)
    chaos.start()
    try:
        ranks = train_processes(
            2,
            BASE
            + [
                "run.max_steps=80",
                "optim.decay_steps=80",
                "checkpoint.every_steps=10",
                "checkpoint.s3.uri=s3://outage/run",
                f"checkpoint.s3.endpoint_url={endpoint}",
                "checkpoint.s3.retry_backoff_s=0.5",
                "checkpoint.s3.max_attempts=7",
                f"checkpoint.dir={tmp_path / 'local'}",
            ],
            tmp_path / "out",
        )
    finally:
        chaos.join()
        servers[-1].stop()
    stats = ranks[0]["result"]["checkpoint"]
    assert ranks[0]["result"]["steps"] == 80  # training never stopped
    assert stats["committed"] == {"local": 80, "s3": 80}  # the final state reached S3
    retried = sum(r["result"]["checkpoint"]["retries"]["s3"] for r in ranks)
    assert retried > 0, "the outage was not noticed"
    assert stats["failed"] == []


@pytest.mark.slow
@pytest.mark.parametrize("on_busy", ["skip", "wait"])
def test_saves_due_while_one_persists_are_skipped_or_waited_for(
    s3_endpoint, bucket, tmp_path, on_busy
):
    """Every step is due; S3 persistence is slower than a step, so saves overlap."""
    ranks = train_processes(
        2,
        BASE
        + [
            "run.max_steps=12",
            "checkpoint.every_steps=1",
            f"checkpoint.on_busy={on_busy}",
            f"checkpoint.s3.uri=s3://{bucket}/busy",
            f"checkpoint.s3.endpoint_url={s3_endpoint}",
            "checkpoint.local=false",
            "checkpoint.keep_last=20",
        ],
        tmp_path,
    )
    stats = [r["result"]["checkpoint"] for r in ranks]
    assert stats[0]["saves"] + stats[0]["skipped"] == 12  # every due save is accounted for
    assert [(s["saves"], s["skipped"], s["committed"]) for s in stats] == [
        (stats[0]["saves"], stats[0]["skipped"], stats[0]["committed"])
    ] * 2  # ranks agreed
    committed = S3Tier(f"s3://{bucket}/busy", endpoint_url=s3_endpoint).committed_steps()
    if on_busy == "wait":
        assert stats[0]["skipped"] == 0 and committed == list(range(1, 13))
    else:
        assert stats[0]["skipped"] > 0 and committed[-1] == 12  # the final save is never skipped
        assert len(committed) == stats[0]["saves"]


@pytest.mark.slow
def test_export_from_s3_reads_only_the_verified_model_ranges(s3_endpoint, bucket, tmp_path):
    from safetensors.torch import load_file

    from raytrain_ext.checkpoint.export import export_safetensors

    s3 = [
        f"checkpoint.s3.uri=s3://{bucket}/big",
        f"checkpoint.s3.endpoint_url={s3_endpoint}",
        "checkpoint.local=false",
        "checkpoint.checksum_chunk_kb=256",
        "model.d_model=256",
    ]
    ranks = train_processes(2, BASE + s3 + ["run.max_steps=2"], tmp_path / "a")
    info = export_safetensors(f"s3://{bucket}/big", tmp_path / "m.safetensors", s3_endpoint)
    assert info["ranged"] and info["fetched_bytes"] < 0.6 * info["total_bytes"]
    exported = load_file(str(tmp_path / "m.safetensors"))
    params = ranks[0]["params"]
    assert exported.keys() == params.keys()
    assert all(torch.equal(exported[k], params[k]) for k in params)

    # flip one byte in every 256 KiB chunk of the data files: whichever chunk the ranged
    # read fetches first fails its checksum, and nothing is exported
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for key in keys(s3_endpoint, bucket):
        if key.endswith(".distcp"):
            data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
            for offset in range(100, len(data), 256 * 1024):
                data[offset] ^= 0xFF
            client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(
        ValueError,
        match=r"damaged checkpoint: __\d_\d\.distcp bytes \d+-\d+ "
        r"fail their checksum \(corrupted\)",
    ):
        export_safetensors(f"s3://{bucket}/big", tmp_path / "m2.safetensors", s3_endpoint)
    assert not (tmp_path / "m2.safetensors").exists()
