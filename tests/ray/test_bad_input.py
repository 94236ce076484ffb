"""Bad input through the real CLI: one clear line naming the key or path and the fix, exit
code 2, no traceback, and (for everything the driver can check) no Ray session started.

One test per failure class of issue 16: 1 data and worker errors, 2 an earlier run's records
kept, 3 paths and S3, 4 one checkpoint resolution for every command, 5 input that used to be
accepted silently, 6 the rendezvous store's listening address.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli import (
    RaySessionWatch,
    clean_env,
    raytrain_ext_cmd,
    run,
    without_aws_credentials,
)
from tests.helpers.runs import FAST_MODEL

TRAIN = [*raytrain_ext_cmd(), "train"]


def refused_before_ray(args, cwd, env=None):
    """Run a command in a subprocess that must fail on the driver; return its stderr."""
    watch = RaySessionWatch()
    try:
        result = run(args, cwd, env=watch.env(env))
        assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
        text = result.stdout + result.stderr
        assert "Traceback" not in text, text
        assert watch.sessions() == [], "a Ray session was started"
        return result.stderr
    finally:
        shutil.rmtree(watch.dir, ignore_errors=True)


@pytest.fixture()
def cli(monkeypatch, capsys, tmp_path):
    """The same CLI entry (``raytrain_ext.cli.main``) in this process, for the further cases
    of a class (each class also runs once as a subprocess): returns stderr after asserting
    exit code 2, no traceback and no Ray session."""
    import ray

    from raytrain_ext.cli import main

    def refused(argv, env=None):
        watch = RaySessionWatch()
        monkeypatch.setenv("RAY_TMPDIR", str(watch.dir))
        for key, value in (env or {}).items():
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, value)
        monkeypatch.chdir(tmp_path)
        code = main(argv)
        out = capsys.readouterr()
        assert code == 2, (code, out.err[-3000:])
        assert "Traceback" not in out.out + out.err, out.err
        assert not ray.is_initialized() and watch.sessions() == [], "a Ray session was started"
        shutil.rmtree(watch.dir, ignore_errors=True)
        return out.err

    return refused


def write_parquet(path: Path, **columns) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


# ---- class 1: what the driver can check about the data ----------------------------------
DATA_CASES = {
    "text file": (
        lambda d: _text(d / "corpus.txt"),
        r"data\.path: \S+corpus\.txt is neither an Arrow IPC file nor a Parquet file.*"
        r"pre-tokenized ids",
    ),
    "no tokens column": (
        lambda d: write_parquet(d / "t.parquet", text=pa.array(["a"] * 9)),
        r"data\.path: \S+t\.parquet has no 'tokens' column \(columns: text\)",
    ),
    "float tokens": (
        lambda d: write_parquet(d / "f.parquet", tokens=pa.array([0.5] * 900)),
        r"column 'tokens' of \S+f\.parquet holds double, not integer token ids",
    ),
    "ids beyond the vocabulary": (
        lambda d: write_parquet(d / "v.parquet", tokens=pa.array(np.arange(9000) % 300)),
        r"data\.path: \S+ holds token id 299, but model\.vocab_size=256 .*Set "
        r"model\.vocab_size >= 300",
    ),
    "negative ids": (
        lambda d: write_parquet(d / "n.parquet", tokens=pa.array(np.arange(9000) % 200 - 1)),
        r"holds token id -1; ids must be >= 0",
    ),
    "empty": (
        lambda d: write_parquet(d / "e.parquet", tokens=pa.array([], pa.int32())),
        r"holds 0 tokens, fewer than one sample of model\.seq_len\+1=129",
    ),
    "missing": (lambda d: d / "nowhere.arrow", r"data\.path: \S+nowhere\.arrow does not exist"),
    "arrow stream": (
        lambda d: _stream(d / "s.arrow"),
        r"data\.path: \S+s\.arrow is an Arrow IPC stream .*Rewrite it as an "
        r"Arrow IPC file",
    ),
    # records given as token data: the keys that read them, the format guessed from them
    "chat records": (
        lambda d: _jsonl(d / "chats.jsonl", {"messages": [{"role": "user", "content": "hi"}]}),
        r"data\.path: \S+chats\.jsonl holds JSON records \(keys: messages\), not the token "
        r"ids data\.format=tokens reads\. Read records with data\.format=chat and "
        r"data\.tokenizer=<a tokenizer directory or tokenizer\.json>.*raytrain-ext data prepare",
    ),
    "preference records": (
        lambda d: _jsonl(d / "pairs.jsonl", {"prompt": "p", "chosen": "a", "rejected": "b"}),
        r"pairs\.jsonl holds JSON records \(keys: chosen, prompt, rejected\).*"
        r"Read records with data\.format=preference and data\.tokenizer=",
    ),
    "a directory of chat records": (
        lambda d: _jsonl(d / "chat-dir" / "part-0.jsonl", {"prompt": "q", "response": "a"}).parent,
        r"data\.path: \S+chat-dir/part-0\.jsonl holds JSON records \(keys: prompt, response\)"
        r".*Read records with data\.format=chat and data\.tokenizer=",
    ),
    "documents under another key": (
        lambda d: _jsonl(d / "docs.jsonl", {"id": 3, "body": "a document"}),
        r"docs\.jsonl holds JSON records \(keys: body, id\).*"
        r"Read records with data\.format=text data\.text_column=body and data\.tokenizer=",
    ),
}


def _jsonl(path: Path, record: dict) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_text((json.dumps(record) + "\n") * 50)
    return path


def _stream(path: Path) -> Path:
    table = pa.table({"tokens": pa.array(np.arange(9000) % 256)})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def _text(path: Path) -> Path:
    path.write_text("plain text, not tokens\n" * 100)
    return path


def test_bad_data_is_refused_before_ray_naming_the_key_file_and_fix(tmp_path, cli):
    """The text file through a real subprocess, every other case through the same entry
    in this process."""
    for number, case in enumerate(sorted(DATA_CASES, key=lambda c: c != "text file")):
        make, expected = DATA_CASES[case]
        data = make(tmp_path)
        args = ["train", f"data.path={data}", f"run.output_dir={tmp_path}"]
        stderr = refused_before_ray([*TRAIN[:-1], *args], tmp_path) if number == 0 else cli(args)
        assert re.search(expected, stderr), (case, stderr)
        assert not (tmp_path / "tiny").exists()  # nothing written by a refused start


# ---- class 5: accepted silently before --------------------------------------------------
def test_fewer_samples_than_a_global_batch_is_refused_unless_repeat_is_allowed(tmp_path):
    from raytrain_ext.config import load_config
    from raytrain_ext.inputs.preflight import preflight

    data = write_parquet(tmp_path / "small.parquet", tokens=pa.array(np.arange(5 * 128 + 1) % 256))
    stderr = refused_before_ray(
        [*TRAIN, f"data.path={data}", f"run.output_dir={tmp_path}"], tmp_path
    )
    assert re.search(
        r"data\.global_batch_size: 16 is more than the 5 samples in data\.path .*"
        r"set data\.allow_repeat=true",
        stderr,
    ), stderr
    allowed = load_config(
        None, [f"data.path={data}", "data.allow_repeat=true", f"run.output_dir={tmp_path}"]
    )
    preflight(allowed)  # the user said repeating is fine: accepted


def test_a_schedule_that_never_reaches_min_lr_is_said_before_anything_starts(tmp_path):
    stderr = refused_before_ray(
        [
            *TRAIN,
            "optim.warmup_steps=1000",
            "run.max_steps=5",
            f"run.output_dir={tmp_path}",
            f"data.path={tmp_path / 'none'}",
        ],
        tmp_path,
    )
    assert re.search(
        r"WARNING .*optim\.warmup_steps: 1000 warmup steps in a run of "
        r"run\.max_steps=5 keep the learning rate at or below 1\.5e-05, under "
        r"optim\.min_lr=0\.0003",
        stderr,
    ), stderr


# ---- class 3: local paths and S3, in train and export ------------------------------------
def test_unusable_local_paths_and_addresses_name_their_key(tmp_path, cli):
    """The first case through a real subprocess, the others through the same entry here."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (["train", "run.output_dir=/proc/rte"], r"run\.output_dir: cannot create /proc/rte"),
        (
            ["train", f"run.output_dir={a_file}/runs"],
            rf"run\.output_dir: cannot use {a_file}/runs/tiny: {a_file} is a file",
        ),
        (
            ["train", f"run.output_dir={tmp_path}", f"checkpoint.dir={a_file}"],
            rf"checkpoint\.dir: cannot use {a_file}: {a_file} is a file",
        ),
        (
            ["ckpt", "export", str(tmp_path), "--to", "/proc/x.safetensors"],
            r"--to: cannot write to /proc",
        ),
        (
            ["ckpt", "export", str(tmp_path), "--to", f"{a_file}/m.safetensors"],
            rf"--to: cannot use {a_file}: {a_file} is a file",
        ),
        (
            ["ckpt", "export", str(tmp_path), "--to", str(tmp_path)],
            rf"--to: {tmp_path} is a directory; give the path of the file",
        ),
        (
            ["ckpt", "export", str(tmp_path / "nope"), "--to", "m.safetensors"],
            r"RUN_OR_PATH: \S+nope does not exist",
        ),
        (
            ["train", f"run.output_dir={tmp_path}", "scaling.ray_address=127.0.0.1:1"],
            r"scaling\.ray_address: nothing answers at 127\.0\.0\.1:1 .*unset scaling\.ray_address",
        ),
    ]
    for number, (args, expected) in enumerate(cases):
        stderr = refused_before_ray([*TRAIN[:-1], *args], tmp_path) if number == 0 else cli(args)
        assert re.search(expected, stderr), (args, stderr)
    assert not Path("/proc/rte").exists() and a_file.read_text() == "x"


def test_s3_errors_name_the_bucket_endpoint_or_credentials(s3_endpoint, tmp_path, cli):
    """Without credentials in a real subprocess (boto3 caches credentials per process);
    the other cases through the same entry here."""
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="have-bucket")
    dead = "http://127.0.0.1:9"
    out = f"run.output_dir={tmp_path}"
    export = ["ckpt", "export"]
    no_creds = without_aws_credentials(clean_env())
    for args, expected in [
        (
            [
                "train",
                out,
                "checkpoint.s3.uri=s3://have-bucket/x",
                f"checkpoint.s3.endpoint_url={s3_endpoint}",
            ],
            r"S3 credentials: no usable credentials for s3://have-bucket \(checkpoint\.s3\.uri\).*"
            r"AWS_ACCESS_KEY_ID",
        ),
        (
            [
                *export,
                "s3://have-bucket/x",
                "--to",
                "m.safetensors",
                "--s3-endpoint-url",
                s3_endpoint,
            ],
            r"S3 credentials: no usable credentials for s3://have-bucket \(RUN_OR_PATH\)",
        ),
    ]:
        stderr = refused_before_ray([*TRAIN[:-1], *args], tmp_path, no_creds)
        assert re.search(expected, stderr), (args, stderr)
    for args, expected in [
        (
            [
                "train",
                out,
                "checkpoint.s3.uri=s3://have-bucket/x",
                "checkpoint.s3.endpoint_url=notaurl",
            ],
            r"checkpoint\.s3\.endpoint_url: 'notaurl' is not an endpoint URL",
        ),
        (
            [
                "train",
                out,
                "checkpoint.s3.uri=s3://no-bucket/x",
                f"checkpoint.s3.endpoint_url={s3_endpoint}",
            ],
            r"checkpoint\.s3\.uri: bucket 'no-bucket' does not exist at http://127",
        ),
        (
            [
                "train",
                out,
                "checkpoint.s3.uri=s3://have-bucket/x",
                f"checkpoint.s3.endpoint_url={dead}",
            ],
            r"checkpoint\.s3\.endpoint_url: cannot reach http://127\.0\.0\.1:9",
        ),
        (
            [
                "train",
                out,
                "data.path=s3://no-bucket/tokens",
                f"data.s3_endpoint_url={s3_endpoint}",
            ],
            r"data\.path: bucket 'no-bucket' does not exist",
        ),
        (
            [
                *export,
                "s3://no-bucket/x",
                "--to",
                "m.safetensors",
                "--s3-endpoint-url",
                s3_endpoint,
            ],
            r"RUN_OR_PATH: bucket 'no-bucket' does not exist",
        ),
        (
            [*export, "s3://have-bucket/x", "--to", "m.safetensors", "--s3-endpoint-url", dead],
            r"--s3-endpoint-url: cannot reach http://127\.0\.0\.1:9",
        ),
        (
            [
                *export,
                "s3://have-bucket/x",
                "--to",
                "m.safetensors",
                "--s3-endpoint-url",
                "notaurl",
            ],
            r"--s3-endpoint-url: 'notaurl' is not an endpoint URL",
        ),
        (
            [
                *export,
                "s3://have-bucket/x",
                "--to",
                "m.safetensors",
                "--s3-endpoint-url",
                s3_endpoint,
            ],
            r"RUN_OR_PATH: s3://have-bucket/x holds no committed checkpoint",
        ),
    ]:
        stderr = cli(args)
        assert re.search(expected, stderr), (args, stderr)
    assert not (tmp_path / "tiny").exists()
    check_s3_token_data(s3_endpoint, tmp_path)


def check_s3_token_data(s3_endpoint, tmp_path):
    """S3 data gets the same checks as local data: a good prefix passes, bad ids are named."""
    import boto3

    from raytrain_ext.config import load_config
    from raytrain_ext.errors import InputError
    from raytrain_ext.inputs.data_check import check_token_data

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for name, ids in (("good", np.arange(9000) % 256), ("bad", np.arange(9000) % 300)):
        path = write_parquet(tmp_path / f"{name}.parquet", tokens=pa.array(ids))
        client.upload_file(str(path), "have-bucket", f"{name}/part-0.parquet")
    settings = [f"data.s3_endpoint_url={s3_endpoint}"]
    check_token_data(load_config(None, ["data.path=s3://have-bucket/good", *settings]))
    with pytest.raises(InputError, match=r"data\.path: s3://have-bucket/bad holds token id 299"):
        check_token_data(load_config(None, ["data.path=s3://have-bucket/bad", *settings]))


# ---- classes 1 and 2: a failure inside the workers, and the records of the earlier run ---
@pytest.mark.slow
def test_a_failed_resume_leaves_the_earlier_runs_records_and_reports_one_line(tmp_path):
    """A finished run resumed (to more steps) with another model fails in the workers
    (checkpoint mismatch): one line naming the rank, the checkpoint and the fix; the full
    trace, without colour codes, in the attempt's error.log; summary.json, config.yaml and
    every checkpoint file of the earlier run byte-identical.  A later start refused by the
    preflight adds nothing, and a rerun of the finished run as it was is told so before Ray
    (exit 0: nothing to do)."""
    common = [
        f"run.output_dir={tmp_path}",
        "run.name=r",
        "run.max_steps=4",
        "checkpoint.every_steps=2",
        "run.tensorboard=false",
        *FAST_MODEL,
    ]
    first = run([*TRAIN, *common], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "r"
    before = snapshot(run_dir)

    watch = RaySessionWatch()
    resumed = run(
        [*TRAIN, *common, "run.max_steps=6", "model.d_model=128"], tmp_path, env=watch.env()
    )
    assert watch.sessions(), "the resume ran on Ray (this is the in-worker case)"
    shutil.rmtree(watch.dir, ignore_errors=True)
    assert resumed.returncode == 1
    assert "Traceback" not in resumed.stderr.split("controller: RUNNING -> FAILED")[-1]
    line = [ln for ln in resumed.stderr.splitlines() if ln.startswith("training failed")]
    assert len(line) == 1 and re.search(
        r"worker rank \d \(node 127\.0\.0\.1, pid \d+\) raised CheckpointMismatch: checkpoint "
        r"\S+/r/checkpoints/step-00000004 was saved from a different model: .* Resume with the "
        r"model config it was saved with",
        line[0],
    ), resumed.stderr[-2000:]
    assert snapshot(run_dir) == before  # summary, config and checkpoints untouched
    attempt = json.loads((run_dir / "attempts" / "002" / "summary.json").read_text())
    assert attempt["status"] == "failed" and attempt["error"] == line[0]
    assert "\x1b[" not in json.dumps(attempt) and "\n" not in attempt["error"]
    trace = (run_dir / "attempts" / "002" / "error.log").read_text()
    assert "\x1b[" not in trace and 'manager.py", line' in trace  # the worker's own frames
    assert (
        f"full error: {run_dir}/attempts/002/error.log (this attempt's records: "
        f"{run_dir}/attempts/002)" in resumed.stderr
    )

    refused_before_ray(
        [
            *TRAIN,
            *common,
            "run.max_steps=6",  # not the finished run's own length: that is said first
            "checkpoint.s3.uri=s3://b/x",
            "checkpoint.s3.endpoint_url=http://127.0.0.1:9",
        ],
        tmp_path,
    )
    assert snapshot(run_dir) == before and not (run_dir / "attempts" / "003").exists()
    watch = RaySessionWatch()
    again = run([*TRAIN, *common], tmp_path, env=watch.env())
    assert watch.sessions() == [], "a finished run started Ray"
    shutil.rmtree(watch.dir, ignore_errors=True)
    assert again.returncode == 0 and "Traceback" not in again.stdout + again.stderr
    assert (
        f"run r already finished at step 4 ({run_dir}/summary.json); nothing to train. Use a "
        "new run.name, or raise run.max_steps above 4" in again.stderr
    )
    assert snapshot(run_dir) == before and not (run_dir / "attempts" / "003").exists()

    # the report covers every attempt: the finished first and the failed resume, its line
    # and its log (the run's summary.json describes the first alone)
    reported = run([*raytrain_ext_cmd(), "report", str(run_dir), "--out", str(tmp_path)], tmp_path)
    assert reported.returncode == 0, reported.stderr[-3000:]
    markdown = (tmp_path / "report.md").read_text()
    assert "| attempt 1 | finished | 4 |  |" in markdown
    assert f"| attempt 2 | failed | 0 | {line[0]} ({run_dir}/attempts/002/error.log) |" in markdown
    assert "No failures." not in markdown and "attempt(s) 2 failed" in markdown


def snapshot(run_dir: Path) -> dict:
    """Bytes of the run's summary, config and every checkpoint file."""
    files = [
        run_dir / "summary.json",
        run_dir / "config.yaml",
        *sorted((run_dir / "checkpoints").rglob("*")),
    ]
    return {str(p): p.read_bytes() for p in files if p.is_file()}


# ---- class 4: one resolution of "the newest usable checkpoint" ---------------------------
def test_a_damaged_newest_manifest_is_described_alike_by_export_report_and_restore(tmp_path):
    from raytrain_ext.checkpoint.manifest import MANIFEST, Manifest, step_dir_name
    from raytrain_ext.checkpoint.resolve import newest_usable
    from raytrain_ext.checkpoint.tiers.disk import DiskTier

    ckpt = tmp_path / "run" / "checkpoints"
    tier = DiskTier(ckpt)
    for step in (4, 6):
        (ckpt / step_dir_name(step)).mkdir(parents=True)
        tier.commit(Manifest(step=step, world_size=1, tier="local", files={}))
    (ckpt / step_dir_name(8)).mkdir()  # a save that never committed
    (ckpt / step_dir_name(6) / MANIFEST).write_text("{ not json")

    found = newest_usable(tier)
    damaged = (
        r"local step-00000006/manifest\.json is there but is not a valid manifest "
        r"\(JSONDecodeError: .*\): the step was committed, then its manifest was damaged"
    )
    assert found.step == 4 and len(found.skipped) == 1 and re.search(damaged, found.skipped[0])

    export = run(
        [
            *raytrain_ext_cmd(),
            "ckpt",
            "export",
            str(ckpt / step_dir_name(6)),
            "--to",
            str(tmp_path / "m.safetensors"),
        ],
        tmp_path,
    )
    assert export.returncode == 2 and "Traceback" not in export.stderr
    assert re.search(
        r"RUN_OR_PATH: no usable checkpoint in \S+step-00000006: " + damaged, export.stderr
    ), export.stderr
    assert "never committed" not in export.stderr

    from raytrain_ext.config import load_config, to_yaml
    from raytrain_ext.ops.report import newest_local_checkpoint

    cfg = load_config(None, [f"checkpoint.dir={ckpt}"])
    assert re.search(rf"step 4 in {ckpt}; skipped " + damaged, newest_local_checkpoint(cfg))
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(cfg))


# ---- class 6: the rendezvous store listens where the group talks -------------------------
def test_the_rendezvous_store_listens_on_the_group_address_only():
    import psutil

    from raytrain_ext.worker.dist_env import host_store

    store = host_store("127.0.0.1", timeout_s=5)
    listening = [
        c.laddr
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    ]
    assert [addr.ip for addr in listening] == ["127.0.0.1"], listening
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_s3_error_mapper_names_the_key_for_each_class():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    from raytrain_ext.storage.s3_errors import CHECKPOINT_KEYS, DATA_KEYS, describe_s3_error

    def client_error(code):
        return ClientError({"Error": {"Code": code, "Message": "m"}}, "PutObject")

    uri, endpoint = "s3://bkt/prefix", "http://127.0.0.1:9000"
    expected = [
        (
            client_error("NoSuchBucket"),
            CHECKPOINT_KEYS,
            r"^checkpoint\.s3\.uri: bucket 'bkt' "
            r"does not exist at http://127\.0\.0\.1:9000",
        ),
        (client_error("AccessDenied"), CHECKPOINT_KEYS, r"^S3 credentials: .*AWS_ACCESS_KEY_ID"),
        (NoCredentialsError(), DATA_KEYS, r"^S3 credentials: .*\(data\.path\)"),
        (
            client_error("AuthorizationHeaderMalformed"),
            CHECKPOINT_KEYS,
            r"^checkpoint\.s3\.region: s3://bkt is not in the region .* Set checkpoint\.s3\.region",
        ),
        (client_error("PermanentRedirect"), DATA_KEYS, r"^data\.s3_region: "),
        (
            EndpointConnectionError(endpoint_url=endpoint),
            DATA_KEYS,
            r"^data\.s3_endpoint_url: cannot reach http://127\.0\.0\.1:9000",
        ),
        (
            OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: curl error"),
            DATA_KEYS,
            r"^data\.s3_endpoint_url: cannot reach",
        ),
        (
            OSError("AWS Error ACCESS_DENIED during HeadObject operation: HTTP response code: 403"),
            DATA_KEYS,
            r"^S3 credentials: ",
        ),
    ]
    for error, keys, pattern in expected:
        message = describe_s3_error(error, keys, uri, endpoint)
        assert re.search(pattern, message), (error, message)
        assert "\n" not in message


def test_damaged_pretrained_weights_are_named_before_ray(tmp_path, cli):
    """A truncated or overwritten ``.safetensors`` in ``model.hf.path`` is found on the
    driver from its header alone, naming the file, the key and the fix."""
    from tests.helpers.hf_models import save_tiny

    directory = save_tiny(tmp_path / "model")
    weights = directory / "model.safetensors"
    whole = weights.read_bytes()
    train = ["train", f"run.output_dir={tmp_path}", "model.source=hf", f"model.hf.path={directory}"]
    weights.write_bytes(whole[: len(whole) // 2])
    assert re.search(
        rf"error: model\.hf\.path: {weights} is damaged \(truncated: tensor '[\w.]+' ends at "
        r"data byte \d+ but the file holds \d+ bytes of data\)\. Download or copy it again, or "
        r"set model\.hf\.pretrained=false",
        cli(train),
    )
    weights.write_bytes(b"\xff" * 8 + whole[8:])
    assert f"{weights} is damaged (its header claims 18446744073709551615 bytes" in cli(train)
    weights.write_bytes(whole)
    (directory / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}'
    )
    assert "names model-00002-of-00002.safetensors, which is missing" in cli(train)


@pytest.fixture()
def small_disk(tmp_path):
    """A 2.5 MB tmpfs: room for one checkpoint of FAST_MODEL, not two (a disk that fills)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"a small disk needs a tmpfs mount (root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


@pytest.mark.slow
def test_a_full_checkpoint_disk_is_one_line_per_save_and_the_run_goes_on(tmp_path, small_disk):
    """checkpoint.dir fills up after the first save: each later save is one line naming the
    key, the path, the free and needed space and what happens next; no thread's traceback
    reaches the console; the run finishes and the committed step stays loadable."""
    trained = run(
        [
            *TRAIN,
            f"run.output_dir={tmp_path}",
            "run.max_steps=15",
            "checkpoint.every_steps=5",
            f"checkpoint.dir={small_disk}",
            "run.tensorboard=false",
            *FAST_MODEL,
        ],
        tmp_path,
    )
    output = trained.stdout + trained.stderr
    assert trained.returncode == 0 and "Traceback" not in output, output[-3000:]
    line = (
        rf"checkpoint\.dir: {small_disk} is full \([\d.]+ MiB free; this rank's part of step "
        r"(\d+) needs about [\d.]+ MiB\): step \1 was not saved\. Training goes on; the newest "
        r"committed checkpoint \(step 5\) stays loadable"
    )
    ended_with = re.findall(rf"^ALARM: {line}", trained.stderr, re.MULTILINE)
    assert ended_with == ["10", "15"], output[-3000:]  # the driver's last lines
    failed = json.loads((tmp_path / "tiny" / "summary.json").read_text())["checkpoint"]["failed"]
    assert [re.match(line, f["error"]).group(1) for f in failed] == ["10", "15"]  # the final
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-00000005"]  # partials freed
    exported = run(
        [*raytrain_ext_cmd(), "ckpt", "export", str(small_disk), "--to", str(tmp_path / "m.st")],
        tmp_path,
    )
    assert exported.returncode == 0 and "exported step 5" in exported.stdout, exported.stderr
