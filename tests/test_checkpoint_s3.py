"""The S3 tier against moto's standalone server, through real boto3 HTTP calls."""

import contextlib
import shutil

import boto3
import pytest

from raytrain_ext.checkpoint.s3 import S3Tier
from raytrain_ext.checkpoint.tier import TierError
from tests.dist_helpers import train_processes

BASE = ["data.global_batch_size=8", "data.micro_batch_size=2", "optim.decay_steps=8",
        "checkpoint.every_steps=4", "checkpoint.every_seconds=null"]


@pytest.fixture()
def bucket(s3_endpoint, request):
    name = "ckpt-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
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
    with pytest.raises(TierError, match=r"checkpoint\.s3\.endpoint_url: cannot reach "
                                        r"http://127\.0\.0\.1:9"):
        S3Tier(f"s3://{bucket}/x", endpoint_url="http://127.0.0.1:9").probe()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong-key")
    with moto_checks_credentials():
        with pytest.raises(TierError, match=r"access to s3://.* was refused \(InvalidAccessKeyId\)"
                                            r"\. Check the credentials"):
            S3Tier(f"s3://{bucket}/x", endpoint_url=s3_endpoint).probe()
    assert keys(s3_endpoint, bucket) == []  # probes clean up after themselves


@pytest.mark.slow
def test_s3_only_run_resumes_bit_identically(s3_endpoint, bucket, tmp_path):
    s3 = [f"checkpoint.s3.uri=s3://{bucket}/runs/a", f"checkpoint.s3.endpoint_url={s3_endpoint}",
          "checkpoint.local=false"]
    reference = train_processes(2, BASE + ["run.max_steps=8", "checkpoint.enabled=false"],
                                tmp_path / "ref")
    train_processes(2, BASE + s3 + ["run.max_steps=4"], tmp_path / "a")
    stored = keys(s3_endpoint, bucket)
    assert "runs/a/step-00000004/manifest.json" in stored
    assert {"runs/a/step-00000004/__0_0.distcp", "runs/a/step-00000004/__1_0.distcp",
            "runs/a/step-00000004/.metadata"} <= set(stored)
    resumed = train_processes(2, BASE + s3 + ["run.max_steps=8"], tmp_path / "b")
    result = resumed[0]["result"]
    assert result["restored"]["tier"] == "s3" and result["restored"]["step"] == 4
    assert result["params_sha256"] == reference[0]["result"]["params_sha256"]
    assert result["samples_digest"] == reference[0]["result"]["samples_digest"]


@pytest.mark.slow
def test_dual_write_survives_the_loss_of_local_disk(s3_endpoint, bucket, tmp_path):
    dual = [f"checkpoint.s3.uri=s3://{bucket}/dual", f"checkpoint.s3.endpoint_url={s3_endpoint}",
            f"checkpoint.dir={tmp_path / 'local'}", "checkpoint.keep_last=1"]
    first = train_processes(2, BASE + dual + ["run.max_steps=8"], tmp_path / "a")
    assert first[0]["result"]["checkpoint"]["committed"] == {"local": 8, "s3": 8}
    assert sorted({k.split("/")[1] for k in keys(s3_endpoint, bucket)}) == ["step-00000008"]
    shutil.rmtree(tmp_path / "local")  # the node's disk is gone
    resumed = train_processes(2, BASE + dual + ["run.max_steps=10"], tmp_path / "b")
    assert resumed[0]["result"]["restored"]["tier"] == "s3"
    assert resumed[0]["result"]["restored"]["step"] == 8
